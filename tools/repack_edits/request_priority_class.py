"""Repack edit: ``Request.__init__`` gains a required keyword-only parameter ``priority_class``;
vLLM's own caller (``Request.from_engine_core_request``) passes it. Written against the 0.33.0
sources.
"""

from __future__ import annotations

from pathlib import Path


def _sub(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: expected {old!r} once, found it {text.count(old)} times")
    path.write_text(text.replace(old, new))


def edit(root: Path) -> None:
    request = root / "vllm" / "v1" / "request.py"
    _sub(request, "        kv_hints: KvHintsEnvelope | None = None,\n    ) -> None:\n",
         "        kv_hints: KvHintsEnvelope | None = None,\n        *,\n"
         "        priority_class: int,\n    ) -> None:\n        self.priority_class = priority_class\n")
    _sub(request, "            abort_immediately=request.abort_immediately,\n        )\n",
         "            abort_immediately=request.abort_immediately,\n            priority_class=0,\n"
         "        )\n")
