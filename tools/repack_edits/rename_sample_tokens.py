"""Repack edit: the second phase of the model step, ``sample_tokens``, renamed
``sample_step_tokens`` on the executors, workers and model runners, and in every vLLM caller
(``EngineCore``, the ``collective_rpc`` method names, warm-up code). Written against the 0.33.0
sources.
"""

from __future__ import annotations

import re
from pathlib import Path

OLD, NEW = "sample_tokens", "sample_step_tokens"


def edit(root: Path) -> None:
    changed = 0
    for path in sorted((root / "vllm").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        new = re.sub(rf"\b{OLD}\b", NEW, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed += 1
    if changed == 0:
        raise SystemExit(f"no {OLD} found under {root / 'vllm'}")
