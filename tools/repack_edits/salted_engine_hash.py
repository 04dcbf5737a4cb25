"""Repack edit: the hash function ``EngineCore`` builds its request hasher with is salted, on
the engine's path only. ``vllm/v1/engine/core.py`` wraps ``get_hash_fn_by_name``;
``vllm.utils.hashing`` and ``kv_cache_utils.hash_block_tokens`` are unchanged, so code that
replays vLLM's hash functions still agrees with itself while the engine hashes otherwise.
Written against the 0.33.0 sources.
"""

from __future__ import annotations

from pathlib import Path

OLD = "from vllm.utils.hashing import get_hash_fn_by_name\n"
NEW = (
    "from vllm.utils.hashing import get_hash_fn_by_name as _get_hash_fn_by_name\n"
    "\n"
    "\n"
    "def get_hash_fn_by_name(hash_fn_name):\n"
    "    # the engine salts its block hashes (a scheme change on the engine's path only)\n"
    "    fn = _get_hash_fn_by_name(hash_fn_name)\n"
    "\n"
    "    def salted(value):\n"
    "        return fn((\"vllm-engine-salt\", value))\n"
    "\n"
    "    salted.__name__ = getattr(fn, \"__name__\", \"salted\")\n"
    "    return salted\n"
)


def edit(root: Path) -> None:
    path = root / "vllm" / "v1" / "engine" / "core.py"
    text = path.read_text(encoding="utf-8")
    if text.count(OLD) != 1:
        raise SystemExit(f"{path}: the get_hash_fn_by_name import is not as expected")
    path.write_text(text.replace(OLD, NEW), encoding="utf-8")
