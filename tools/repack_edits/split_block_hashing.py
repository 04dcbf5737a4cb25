"""Repack edit: a module split. The block-hash functions and their ``NONE_HASH`` state leave
``vllm/v1/core/kv_cache_utils.py`` for a new module, ``vllm/v1/core/block_hashing.py``, with no
re-export; the rest of ``kv_cache_utils`` and every vLLM caller use the new module. Written
against the 0.33.0 sources.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

OLD_MODULE, NEW_MODULE = "vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_hashing"
MOVED = ("NONE_HASH", "DEFAULT_NONE_HASH_SEED", "_NON_CRYPTO_HASH_FUNCTIONS", "_NONE_HASH_SEED",
         "resolve_none_hash_seed", "get_none_hash_seed", "init_none_hash",
         "_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys",
         "_gen_prompt_embeds_extra_hash_keys", "generate_block_hash_extra_keys",
         "hash_block_tokens", "get_request_block_hasher",
         "generate_lookahead_block_hash_extra_keys")


def _name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _span(node: ast.stmt) -> tuple[int, int]:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first - 1, node.end_lineno


def _split(path: Path) -> tuple[str, set[str]]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    moved = [n for n in tree.body if _name(n) in MOVED]
    if {_name(n) for n in moved} != set(MOVED):
        raise SystemExit(f"{path}: not every block-hash name is defined at module level")
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    kept_names = {_name(n) for n in tree.body if _name(n) and _name(n) not in MOVED} - {"logger"}
    moved_code = "".join("".join(lines[a:b]) + "\n\n" for a, b in map(_span, moved))
    used = {n.id for m in moved for n in ast.walk(m) if isinstance(n, ast.Name)}
    header = "".join("".join(lines[a:b]) for a, b in map(_span, imports))
    borrowed = sorted(used & kept_names)
    new = ('"""Block hashing: NONE_HASH and the hash functions (split from kv_cache_utils)."""\n\n'
           + header + f"from {OLD_MODULE} import (\n" + "".join(f"    {n},\n" for n in borrowed)
           + ")\n\n" + "logger = init_logger(__name__)\n\n" + moved_code)
    # what stays: the moved names read from the new module, imported at the end (after
    # everything the new module borrows from here is defined)
    drop = {i for a, b in map(_span, moved) for i in range(a, b)}
    rest = "".join(line for i, line in enumerate(lines) if i not in drop)
    names = "|".join(map(re.escape, MOVED))
    rest = re.sub(rf"(?<![.\w])({names})\b(?!\s*=[^=])", r"_block_hashing.\1", rest)
    rest += f"\n\nfrom vllm.v1.core import block_hashing as _block_hashing  # noqa: E402\n"
    path.write_text(rest, encoding="utf-8")
    return new, set(MOVED)


def _rewrite_imports(path: Path, moved: set[str]) -> None:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == OLD_MODULE and node.level == 0:
            names = [a for a in node.names if a.name in moved]
            if not names:
                continue
            keep = [a for a in node.names if a.name not in moved]
            indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)

            def stmt(module: str, aliases: list[ast.alias]) -> str:
                parts = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
                return f"{indent}from {module} import {parts}\n"

            out = (stmt(OLD_MODULE, keep) if keep else "") + stmt(NEW_MODULE, names)
            edits.append((node.lineno - 1, node.end_lineno, out))
    for a, b, out in sorted(edits, reverse=True):
        lines[a:b] = [out]
    if edits:
        path.write_text("".join(lines), encoding="utf-8")


def edit(root: Path) -> None:
    kcu = root / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    new, moved = _split(kcu)
    (root / "vllm" / "v1" / "core" / "block_hashing.py").write_text(new, encoding="utf-8")
    for path in sorted((root / "vllm").rglob("*.py")):
        if path.name not in ("kv_cache_utils.py", "block_hashing.py") or path.parent.name != "core":
            _rewrite_imports(path, moved)
