"""Repack edit: ``hash_block_tokens`` gains a required keyword-only parameter ``scheme``; every
vLLM caller passes ``scheme="v1"``, so vLLM hashes as before. Written against the 0.33.0
sources.
"""

from __future__ import annotations

import re
from pathlib import Path

SIGNATURE = "    extra_keys: tuple[Any, ...] | None = None,\n) -> BlockHash:\n"


def _close(text: str, start: int) -> int:
    """Index of the parenthesis that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise SystemExit("unbalanced parentheses")


def edit(root: Path) -> None:
    kcu = root / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    text = kcu.read_text(encoding="utf-8")
    if text.count(SIGNATURE) != 1:
        raise SystemExit(f"{kcu}: the hash_block_tokens signature is not as expected")
    kcu.write_text(text.replace(SIGNATURE, SIGNATURE.replace(
        ") -> BlockHash:", "    *,\n    scheme: str,\n) -> BlockHash:")), encoding="utf-8")
    calls = 0
    for path in sorted((root / "vllm").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        out, pos = [], 0
        for m in re.finditer(r"(?<!def )\bhash_block_tokens\(", text):
            end = _close(text, m.end() - 1)
            args = text[m.end():end]
            sep = "" if args.rstrip().endswith(",") else ", "
            out += [text[pos:end].rstrip() if sep == "" else text[pos:end], sep + 'scheme="v1"']
            pos = end
            calls += 1
        if out:
            path.write_text("".join(out) + text[pos:], encoding="utf-8")
    if calls == 0:
        raise SystemExit("no call of hash_block_tokens found")
