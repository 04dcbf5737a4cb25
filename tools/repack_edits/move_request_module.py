"""Repack edit: ``vllm/v1/request.py`` moved to ``vllm/v1/engine/request_state.py``; the old
import path is gone and every vLLM caller imports the new one. Written against the 0.33.0
sources.
"""

from __future__ import annotations

import re
from pathlib import Path

OLD, NEW = "vllm.v1.request", "vllm.v1.engine.request_state"


def edit(root: Path) -> None:
    src = root / "vllm" / "v1" / "request.py"
    if not src.exists():
        raise SystemExit(f"{src} is missing")
    src.rename(root / "vllm" / "v1" / "engine" / "request_state.py")
    for path in sorted((root / "vllm").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        new = re.sub(rf"\b{re.escape(OLD)}\b(?!_)", NEW, text)
        if new != text:
            path.write_text(new, encoding="utf-8")
