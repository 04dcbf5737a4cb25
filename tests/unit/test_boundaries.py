"""Architecture rules: vLLM is imported only by adapters, and every adapter has the same API."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from vllm_compat.adapters import ADAPTER_FUNCTIONS
from vllm_compat.versions import ERAS

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "vllm_compat"


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


def test_vllm_imported_only_in_adapters():
    offenders = {
        str(p.relative_to(SRC)): _vllm_imports(p)
        for p in SRC.rglob("*.py")
        if "adapters" not in p.relative_to(SRC).parts and _vllm_imports(p)
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


def _adapter_api(module_file: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            names.add(node.name)
        elif isinstance(node, ast.Assign):  # e.g. new_request = request_factory(...)
            names |= {t.id for t in node.targets if isinstance(t, ast.Name) and not t.id.startswith("_")}
        elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "_shared":
            names |= {a.asname or a.name for a in node.names if not (a.asname or a.name).startswith("_")}
    return names


@pytest.mark.parametrize("era", ERAS, ids=lambda e: e.name)
def test_every_adapter_has_the_same_function_set(era):
    api = _adapter_api(SRC / "adapters" / f"{era.module}.py")
    assert set(ADAPTER_FUNCTIONS) <= api, sorted(set(ADAPTER_FUNCTIONS) - api)
    extra = api - set(ADAPTER_FUNCTIONS) - {"ERA"}
    assert not extra, f"{era.module} exposes functions no other adapter has: {sorted(extra)}"


def test_version_branches_carry_a_comment():
    """Every probe-based branch in the adapters is preceded by a comment naming the change."""
    missing = []
    for path in (SRC / "adapters").glob("*.py"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if s.startswith(("if ", "elif ")) and any(k in s for k in ("hasattr(", "in _params(", "in {f.name", '"ndarray"')):
                window = " ".join(lines[max(0, i - 4):i])
                if not re.search(r"#.*\b0\.\d+", window):
                    missing.append(f"{path.name}:{i + 1}: {s}")
    assert missing == []
