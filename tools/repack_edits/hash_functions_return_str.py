"""Repack edit: ``get_hash_fn_by_name`` hands out functions that return ``str`` (the hex digest)
instead of ``bytes``, and says so in its annotation. Written against the 0.33.0 sources.
"""

from __future__ import annotations

from pathlib import Path

OLD = "def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:\n"


def edit(root: Path) -> None:
    path = root / "vllm" / "utils" / "hashing.py"
    text = path.read_text(encoding="utf-8")
    if text.count(OLD) != 1:
        raise SystemExit(f"{path}: get_hash_fn_by_name is not as expected")
    text = text.replace(OLD, "def _get_bytes_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:\n")
    text += ("\n\ndef get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], str]:\n"
             "    fn = _get_bytes_hash_fn_by_name(hash_fn_name)\n"
             "    return lambda value: fn(value).hex()\n")
    path.write_text(text, encoding="utf-8")
