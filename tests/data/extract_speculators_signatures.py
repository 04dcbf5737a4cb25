"""Regenerate ``speculators_signatures.json`` from speculators wheels, with ``ast`` only.

Nothing is imported or executed from the wheels. Usage::

    pip download speculators==0.3.0 speculators==0.4.0.1 --no-deps -d /tmp/spec
    python tests/data/extract_speculators_signatures.py /tmp/spec/*.whl \
        > tests/data/speculators_signatures.json

The same parser is used by ``tests/unit/test_speculators_signature.py`` to read an
installed speculators' source (``importlib.metadata``, no import) and compare it with
the snapshot.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import zipfile
from typing import Any

GENERATOR_MODULE = "speculators/data_generation/vllm_hidden_states_generator.py"
CLASS_NAME = "VllmHiddenStatesGenerator"
METHODS = ("__init__", "generate")

_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY",
          "VAR_KEYWORD")


def _default(node: ast.expr | None) -> dict[str, Any]:
    if node is None:
        return {"has_default": False}
    try:
        return {"has_default": True, "default": ast.literal_eval(node)}
    except ValueError:  # not a literal: keep its source text
        return {"has_default": True, "default_source": ast.unparse(node)}


def _params(fn: ast.FunctionDef) -> list[dict[str, Any]]:
    a = fn.args
    out: list[dict[str, Any]] = []
    positional = [(p, "POSITIONAL_ONLY") for p in a.posonlyargs] + [
        (p, "POSITIONAL_OR_KEYWORD") for p in a.args]
    defaults: list[ast.expr | None] = (
        [None] * (len(positional) - len(a.defaults)) + list(a.defaults))
    for (p, kind), d in zip(positional, defaults):
        out.append({"name": p.arg, "kind": kind, **_default(d),
                    "annotation": ast.unparse(p.annotation) if p.annotation else None})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "VAR_POSITIONAL", "has_default": False,
                    "annotation": None})
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append({"name": p.arg, "kind": "KEYWORD_ONLY", **_default(d),
                    "annotation": ast.unparse(p.annotation) if p.annotation else None})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "VAR_KEYWORD", "has_default": False,
                    "annotation": None})
    return out


def signatures_from_source(source: str) -> dict[str, Any]:
    """``{"__init__": [...], "generate": [...], "generate_returns": str}`` of the class."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS_NAME)
    found: dict[str, Any] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in METHODS:
            found[node.name] = _params(node)
            if node.name == "generate":
                found["generate_returns"] = ast.unparse(node.returns) if node.returns else None
    missing = [m for m in METHODS if m not in found]
    if missing:
        raise ValueError(f"{CLASS_NAME} has no {missing}")
    return found


def from_wheel(path: str) -> tuple[str, dict[str, Any]]:
    m = re.search(r"speculators-([^-]+)-", path)
    if not m:
        raise ValueError(f"not a speculators wheel: {path}")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    with zipfile.ZipFile(path) as z:
        source = z.read(GENERATOR_MODULE).decode()
    entry = signatures_from_source(source)
    entry["wheel_sha256"] = digest
    return m.group(1), entry


def main(argv: list[str]) -> int:
    snapshot: dict[str, Any] = {
        "_comment": "VllmHiddenStatesGenerator signatures read with ast from the PyPI "
                    "wheels (tests/data/extract_speculators_signatures.py). kinds are "
                    "inspect.Parameter kinds.",
        "module": GENERATOR_MODULE,
        "class": CLASS_NAME,
        "versions": {},
    }
    for path in argv:
        version, entry = from_wheel(path)
        snapshot["versions"][version] = entry
    if not snapshot["versions"]:
        print(__doc__, file=sys.stderr)
        return 2
    json.dump(snapshot, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
