"""Test sessions. vLLM goes in with its Python code only: CPU torch, no CUDA stack.

    nox -s unit                       # no vLLM: versions, boundaries, pure-Python pieces
    nox -s conformance                # every release in matrix/releases.toml
    nox -s "conformance(vllm='0.16.0')"
    nox -s conformance_ci             # the CI subset (one release per era + 0.16.0)
    nox -s nightly -- <wheel path | URL | requirement>
    nox -s typecheck                  # mypy against the newest release (what CI runs)
    nox -s "gpu(vllm='0.26.0')"       # tests/gpu on a CUDA machine: vLLM from PyPI, JSON report
    nox -s demo                       # install vLLM (newest release, CPU) and run the quick start
    nox -s matrix_report              # support table from the last conformance results
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
MATRIX = tomllib.loads((ROOT / "matrix" / "releases.toml").read_text())
RELEASES: list[str] = MATRIX["releases"]
CI_RELEASES: list[str] = MATRIX["ci"]
CONSTRAINTS: dict[str, list[str]] = MATRIX.get("constraints", {})
GPU_RELEASES: list[str] = MATRIX["gpu"]
RESULTS = ROOT / "matrix" / "results"
PYTHON = "3.11"  # vLLM 0.32+ needs >= 3.11; the local CPU torch wheel is cp311

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["unit", "typecheck", "conformance_ci"]
nox.options.reuse_existing_virtualenvs = True

TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}


def _torch_source() -> list[str]:
    """Where the CPU build of torch 2.13.0 comes from: the local wheel folder, else PyTorch's CPU index."""
    links = os.environ.get("PIP_FIND_LINKS")
    if not links:
        try:
            links = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                                   capture_output=True, text=True).stdout.strip()
        except OSError:
            links = ""
    if not links and Path("/opt/wheels").is_dir():
        links = "/opt/wheels"
    if links:
        return ["--find-links", links]
    return ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]


def install_cpu_torch(session: nox.Session) -> None:
    # Ask for the +cpu local version: plain 2.13.0 from PyPI is a multi-GB CUDA build.
    session.install(*_torch_source(), "torch==2.13.0+cpu")


def install_vllm(session: nox.Session, spec: str, release: str | None = None) -> None:
    """vLLM with its own pins, minus the torch family and GPU stacks (matrix/excludes.txt)."""
    args = ["--excludes", str(ROOT / "matrix" / "excludes.txt")]
    pins = CONSTRAINTS.get(release or "", [])
    if pins:
        fd, path = tempfile.mkstemp(suffix=".txt", prefix="constraints-")
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(pins) + "\n")
        args += ["-c", path]
    session.install(*args, spec)


def run_conformance(session: nox.Session, label: str, pytest_args: list[str] | None = None) -> None:
    session.install("-e", f"{ROOT}[test]")
    env = dict(TEST_ENV, VLLM_CACHE_ROOT=str(Path(session.create_tmp()) / "vllm-cache"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    junit = RESULTS / f"{label}.xml"
    start = time.monotonic()
    ok = False
    try:
        session.run("python", "-m", "pytest", str(ROOT / "tests" / "conformance"), "-q",
                    "-p", "no:cacheprovider", f"--junitxml={junit}",
                    *(session.posargs if pytest_args is None else pytest_args), env=env)
        ok = True
    finally:
        record = {"release": label, "passed": ok, "seconds": round(time.monotonic() - start, 1),
                  "python": session.python, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        record.update(_junit_counts(junit))
        (RESULTS / f"{label}.json").write_text(json.dumps(record, indent=2) + "\n")


def _junit_counts(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    return {k: int(suite.get(k, 0)) for k in keys} if suite is not None else {}


@nox.session(python=PYTHON)
def unit(session: nox.Session) -> None:
    """Tests that need no vLLM (CPU torch for the pipeline pieces)."""
    install_cpu_torch(session)
    # ray: the replicas test runs a real local Ray cluster (a ~80 MB wheel, cached by uv)
    session.install("-e", f"{ROOT}[test,eagle3,testing,ray]")
    session.run("python", "-m", "pytest", str(ROOT / "tests" / "unit"), "-q", *session.posargs,
                env=TEST_ENV)


def _release(session: nox.Session, vllm: str) -> None:
    install_cpu_torch(session)
    install_vllm(session, f"vllm=={vllm}", vllm)
    run_conformance(session, vllm)


@nox.session(python=PYTHON)
@nox.parametrize("vllm", RELEASES)
def conformance(session: nox.Session, vllm: str) -> None:
    """The conformance suite against the real vLLM ``vllm`` on CPU."""
    _release(session, vllm)


@nox.session(python=PYTHON)
@nox.parametrize("vllm", CI_RELEASES)
def conformance_ci(session: nox.Session, vllm: str) -> None:
    """The CI subset of the matrix: one release per era plus 0.16.0."""
    _release(session, vllm)


@nox.session(python=PYTHON)
def nightly(session: nox.Session) -> None:
    """Conformance against a vLLM you name: ``nox -s nightly -- <wheel path | URL | spec>``.

    Nightly wheels come from vLLM's own wheel index, which must be reachable from your
    machine. Extra pytest arguments follow a second ``--``.
    """
    if not session.posargs:
        session.error("usage: nox -s nightly -- <wheel path | URL | requirement> [-- pytest args]")
    spec, *rest = session.posargs
    if rest and rest[0] == "--":
        rest = rest[1:]
    install_cpu_torch(session)
    install_vllm(session, spec)
    version = session.run("python", "-c", "import importlib.metadata as m; print(m.version('vllm'))",
                          silent=True).strip().splitlines()[-1]
    session.log(f"installed vLLM {version}")
    run_conformance(session, f"nightly-{version}", rest)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over src/ with the newest release installed, so vLLM's own types are checked
    (among them every era adapter against ``adapters.AdapterAPI``)."""
    install_cpu_torch(session)
    install_vllm(session, f"vllm=={RELEASES[-1]}", RELEASES[-1])
    session.install("-e", f"{ROOT}[eagle3]", "mypy>=1.10")
    session.run("mypy", *session.posargs, env=TEST_ENV)


@nox.session(python=PYTHON)
@nox.parametrize("vllm", GPU_RELEASES)
def gpu(session: nox.Session, vllm: str) -> None:
    """tests/gpu on a machine with a CUDA GPU: vLLM ``vllm`` from PyPI with the CUDA torch it
    pins, then ``tools/run_gpu_tests.py``, which writes ``gpu-report-<vllm>.json``."""
    session.install(f"vllm=={vllm}")
    session.install("-e", f"{ROOT}[test,eagle3]")
    session.run("python", str(ROOT / "tools" / "run_gpu_tests.py"),
                "--out", str(ROOT / f"gpu-report-{vllm}.json"), *session.posargs, env=TEST_ENV)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Install the newest supported vLLM (CPU) and run the quick start against it."""
    install_cpu_torch(session)
    install_vllm(session, f"vllm=={RELEASES[-1]}", RELEASES[-1])
    session.install("-e", str(ROOT))
    env = dict(TEST_ENV, VLLM_CACHE_ROOT=str(Path(session.create_tmp()) / "vllm-cache"))
    session.run("vllm-compat", "doctor", env=env)
    session.run("python", str(ROOT / "examples" / "quickstart.py"), env=env)


@nox.session(python=False)
def matrix_report(session: nox.Session) -> None:
    """Write docs/support-matrix.md and the README support table from matrix/results/*.json."""
    session.run(sys.executable, str(ROOT / "matrix" / "report.py"))
