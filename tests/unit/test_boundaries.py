"""Architecture rules: where vLLM may be imported, and which layer may import which.

The era modules' function set is checked by the type checker (``adapters.AdapterAPI``, the
``typecheck`` nox session) and, on each real release, by the conformance suite.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "vllm_compat"
VLLM_ALLOWED = ("resolve", "adapters", "runtime")

# Lowest first. A module may import modules of its own layer or of lower ones, never of a
# higher one; the first matching prefix decides a module's layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "versions", "surface", "aliases", "drift"),
    ("resolve",),
    ("adapters",),
    ("detect",),
    ("hashing", "engine_hashing", "hash_check", "requests", "scheduling", "step", "rpc",
     "locking", "isolation", "target", "tokenizer", "extract.layers", "extract.ordering",
     "extract.staging", "extract.fp8",
     # the command-line error contract, shared by the eagle3, serve and speculators commands
     "cli_errors", "cli_args", "cli_output"),
    ("runtime",),
    ("extract",),
    ("eagle3", "speculators", "serve"),
    ("testing",),
    ("cli", "__init__"),
)


def _vllm_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "vllm"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "vllm":
                found.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("vllm"):
                found.append(node.args[0].value)
    return found


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _known_modules() -> set[str]:
    return {_module_name(p) for p in SRC.rglob("*.py")}


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """vllm_compat modules ``path`` imports, at module level or inside functions (a lazy
    import is still a dependency). ``from . import x`` names the module ``x`` when it is one."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("vllm_compat"):
                mod = node.module.removeprefix("vllm_compat").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}" if mod else alias.name
                out.add(sub if sub in known else mod or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vllm_compat."):
                    out.add(alias.name.removeprefix("vllm_compat."))
    return {m for m in out if m != me and (m in known or m == "__init__")}


def _graph() -> dict[str, set[str]]:
    known = _known_modules()
    return {_module_name(p): _imports(p, known) for p in SRC.rglob("*.py")}


def _layer(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({_layer(a)}) imports {b} ({_layer(b)})"
            for a, deps in sorted(graph.items()) for b in sorted(deps) if _layer(a) < _layer(b)]


def test_vllm_imported_only_in_the_resolver_adapters_and_runtime():
    offenders = {
        str(p.relative_to(SRC)): _vllm_imports(p)
        for p in SRC.rglob("*.py")
        if _module_name(p).split(".")[0] not in VLLM_ALLOWED and _vllm_imports(p)
    }
    assert offenders == {}


def test_the_check_catches_an_offender(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom vllm.v1.request import Request\nimport vllm\n")
    assert _vllm_imports(bad) == ["vllm.v1.request", "vllm"]


def test_import_vllm_compat_does_not_import_vllm():
    code = "import sys, vllm_compat; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_import_graph_has_no_cycle():
    assert _cycles(_graph()) == []


def test_no_layer_imports_a_higher_one():
    assert _upward(_graph()) == []


def test_the_graph_checks_catch_a_cycle_and_an_upward_import():
    graph = {"adapters._common": {"eagle3.validate"}, "eagle3.validate": {"adapters._common"}}
    assert _cycles(graph) == [["adapters._common", "eagle3.validate", "adapters._common"]]
    assert _upward(graph) == ["adapters._common (2) imports eagle3.validate (7)"]


def test_the_graph_sees_lazy_and_relative_imports():
    graph = _graph()
    assert "runtime.extraction" in graph["extract.extractor"]  # lazy, inside a method
    assert "versions" in graph["detect"]                     # from . import versions
    assert "adapters" in graph["detect"]                     # from .adapters import load
    assert "resolve" in graph["adapters._common"]            # from ..resolve import sym


def test_every_module_imports_first_on_its_own():
    """A cycle through a package's ``__init__`` shows only in the order modules are first
    imported: import each (but the resolver, adapters/ and runtime/, which need vLLM) into a fresh
    ``vllm_compat``."""
    names = sorted("vllm_compat." + m if m != "__init__" else "vllm_compat"
                   for m in _known_modules() if m.split(".")[0] not in VLLM_ALLOWED)
    code = (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "bad = []\n"
        "for name in names:\n"
        "    for k in [k for k in sys.modules if k.split('.')[0] == 'vllm_compat']:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        bad.append(f'{name}: {exc}')\n"
        "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_version_branches_carry_a_comment():
    """Every probe-based branch in adapters/ and runtime/ is preceded by a comment naming
    the vLLM change (a release number) behind it."""
    missing = []
    for folder in ("adapters", "runtime"):
        for path in (SRC / folder).glob("*.py"):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                s = line.strip()
                probe = any(k in s for k in ("hasattr(", "in _params(", "in {f.name", '"ndarray"', "probe(",
                                             "VLLM_VERSION"))
                if s.startswith(("if ", "elif ")) and probe:
                    window = " ".join(lines[max(0, i - 4):i + 1])
                    if not re.search(r"#.*\b0\.\d+", window):
                        missing.append(f"{folder}/{path.name}:{i + 1}: {s}")
    assert missing == []


TESTS = SRC.parents[1] / "tests" / "conformance"
# the conformance suite's doors to vLLM: its reference (the oracle), the engine path it replays,
# the real EngineCore it runs (engine_oracle.py), and the drift it injects; a test module
# reads vLLM only through them
VLLM_REFERENCE = ("reference.py", "engine_path.py", "engine_oracle.py", "drift_inject.py")


def test_conformance_tests_reach_vllm_only_through_the_reference():
    offenders = {p.name: _vllm_imports(p) for p in sorted(TESTS.glob("*.py"))
                 if p.name not in VLLM_REFERENCE and _vllm_imports(p)}
    assert offenders == {}
