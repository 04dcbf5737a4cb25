"""Repack edit: ``Scheduler``'s optional ``hash_block_size`` (0.20+) becomes a required
keyword-only parameter; vLLM's own caller (``EngineCore``) already passes it. Written against
the 0.33.0 sources.
"""

from __future__ import annotations

from pathlib import Path

OLD = "        hash_block_size: int | None = None,\n"


def edit(root: Path) -> None:
    path = root / "vllm" / "v1" / "core" / "sched" / "scheduler.py"
    text = path.read_text(encoding="utf-8")
    start = text.index("    def __init__(\n")
    end = text.index(") -> None:\n", start)
    head = text[start:end]
    if head.count(OLD) != 1:
        raise SystemExit(f"{path}: Scheduler.__init__ has no optional hash_block_size")
    # moved to the end, after a `*`: a required keyword-only parameter
    head = head.replace(OLD, "").rstrip(" ")
    star = "" if "\n        *,\n" in head else "        *,\n"
    head += star + "        hash_block_size: int | None,\n    "
    path.write_text(text[:start] + head + text[end:], encoding="utf-8")
