"""Repack edit: ``Request.__init__`` gains a required keyword-only parameter ``priority_class``;
vLLM's own caller (``Request.from_engine_core_request``) passes it. Written against the 0.33.0
and 0.34.0 sources.
"""

from __future__ import annotations

import re
from pathlib import Path


def _sub(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: expected {old!r} once, found it {text.count(old)} times")
    path.write_text(text.replace(old, new))


def edit(root: Path) -> None:
    request = root / "vllm" / "v1" / "request.py"
    # the keyword goes last: 0.34 added block_hashes after kv_hints
    text = request.read_text()
    head, n = re.subn(r"(        kv_hints: KvHintsEnvelope \| None = None,\n(?:        [^\n]*\n)*?)    \) -> None:\n",
                      r"\1        *,\n        priority_class: int,\n    ) -> None:\n"
                      r"        self.priority_class = priority_class\n", text, count=1)
    if n != 1:
        raise SystemExit(f"{request}: Request.__init__'s parameter list (ending after kv_hints) not found")
    request.write_text(head)
    _sub(request, "            abort_immediately=request.abort_immediately,\n",
         "            abort_immediately=request.abort_immediately,\n            priority_class=0,\n")
