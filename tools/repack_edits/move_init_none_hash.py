"""Repack edit: move ``init_none_hash`` and its ``NONE_HASH`` state (with the seed helpers)
from ``vllm/v1/core/kv_cache_utils.py`` to ``vllm/utils/hashing.py``, updating vLLM's own
callers, so vLLM itself still hashes as before. Written against the 0.33.0 sources.
"""

from __future__ import annotations

import re
from pathlib import Path

START = "NONE_HASH: BlockHash\n"
END = "    NONE_HASH = BlockHash(hash_fn(_NONE_HASH_SEED))\n"


def _sub(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: expected {old!r} once, found it {text.count(old)} times")
    path.write_text(text.replace(old, new))


def edit(root: Path) -> None:
    kcu = root / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    text = kcu.read_text()
    start, end = text.index(START), text.index(END) + len(END)
    moved = text[start:end]
    # the block now lives in vllm.utils.hashing; kv_cache_utils reads the root from there
    kcu.write_text(text[:start] + "# NONE_HASH and init_none_hash live in vllm.utils.hashing.\n"
                   + text[end:])
    _sub(kcu, "from vllm.utils.hashing import xxhash, xxhash_cbor\n",
         "from vllm.utils import hashing as _hashing\n"
         "from vllm.utils.hashing import xxhash, xxhash_cbor\n")
    _sub(kcu, "        parent_block_hash = NONE_HASH\n",
         "        parent_block_hash = _hashing.NONE_HASH\n")
    # in hashing.py BlockHash is plain bytes (the NewType is kv_cache_utils')
    moved = re.sub(r"\bBlockHash\(", "bytes(", moved).replace("NONE_HASH: BlockHash", "NONE_HASH: bytes")
    moved = moved.replace("        logger.warning(", "        init_logger(__name__).warning(")
    hashing = root / "vllm" / "utils" / "hashing.py"
    hashing.write_text(hashing.read_text() + "\n\n# Moved from vllm/v1/core/kv_cache_utils.py.\n"
                       "import os  # noqa: E402\n\nfrom vllm.logger import init_logger  # noqa: E402\n\n"
                       + moved)
    # vLLM's callers
    core = root / "vllm" / "v1" / "engine" / "core.py"
    text = core.read_text()
    block = re.search(r"from vllm\.v1\.core\.kv_cache_utils import \(\n(.*?)\)\n", text, re.S)
    if block is None or "    init_none_hash,\n" not in block.group(1):
        raise SystemExit(f"{core}: no kv_cache_utils import of init_none_hash")
    names = block.group(1).replace("    init_none_hash,\n", "")
    core.write_text(text[:block.start()] + f"from vllm.v1.core.kv_cache_utils import (\n{names})\n"
                    "from vllm.utils.hashing import init_none_hash\n" + text[block.end():])
    p2p = root / "vllm" / "v1" / "kv_offload" / "tiering" / "p2p" / "manager.py"
    if p2p.exists():
        _sub(p2p, "from vllm.v1.core.kv_cache_utils import get_none_hash_seed\n",
             "from vllm.utils.hashing import get_none_hash_seed\n")
