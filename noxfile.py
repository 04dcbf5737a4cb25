"""Test sessions. vLLM goes in with its Python code only: CPU torch, no CUDA stack.

    nox -s unit                       # no vLLM: versions, boundaries, pure-Python pieces
    nox -s conformance                # every release in matrix/releases.toml
    nox -s "conformance(vllm='0.16.0')"
    nox -s conformance_ci             # the CI subset (one release per era + 0.16.0)
    nox -s nightly -- <wheel path | URL | requirement>   # drift check, then conformance
    nox -s snapshot                   # only the probe/surface snapshots (no tests), every release
    nox -s typecheck                  # mypy against the newest release (what CI runs)
    nox -s "gpu(vllm='0.26.0')"       # tests/gpu on a CUDA machine: vLLM from PyPI, JSON report
    nox -s speculators09              # speculators 0.9.0's own commands against serve-hidden-states
    nox -s demo                       # install vLLM (newest release, CPU) and run the quick start
    nox -s matrix_report              # support table from the last conformance results
    nox -s package                    # build sdist + wheel, twine check, install the wheel, run it
"""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
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
nox.options.sessions = ["unit", "typecheck", "package", "conformance_ci"]
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


def _env(session: nox.Session) -> dict[str, str]:
    return dict(TEST_ENV, VLLM_CACHE_ROOT=str(Path(session.create_tmp()) / "vllm-cache"))


def drift_check(session: nox.Session, out: Path) -> dict | None:
    """``vllm-compat doctor --drift --json`` into ``out`` (exit 1, drift that affects a
    capability, does not stop the session); the parsed report, None when skipped."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        rc = session.run("python", "-m", "vllm_compat.cli", "doctor", "--drift", "--json",
                         env=_env(session), stdout=f, success_codes=[0, 1, 2])
    if rc is None:  # --install-only
        return None
    text = out.read_text()
    return json.loads(text[text.index("{"):])


def write_snapshot(session: nox.Session) -> None:
    """The installed release's probe/surface snapshot (src/vllm_compat/snapshots/)."""
    session.run("python", str(ROOT / "matrix" / "snapshot.py"), env=_env(session))


def run_conformance(session: nox.Session, label: str, pytest_args: list[str] | None = None,
                    doctor: dict | None = None) -> dict | None:
    """The conformance suite; writes ``matrix/results/<label>.json``: counts, and what the
    drift check saw (version, adapter, routing, probes, drift). None when nothing ran."""
    session.install("-e", f"{ROOT}[test]")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if doctor is None:
        doctor = drift_check(session, RESULTS / f"{label}-doctor.json")
    junit = RESULTS / f"{label}.xml"
    start = time.monotonic()
    ran = None
    try:
        ran = session.run("python", "-m", "pytest", str(ROOT / "tests" / "conformance"), "-q",
                          "-p", "no:cacheprovider", f"--junitxml={junit}",
                          *(session.posargs if pytest_args is None else pytest_args),
                          env=_env(session), success_codes=[0, 1])
    finally:
        if ran is not None or junit.exists():  # not under --install-only
            record = {"release": label, "passed": False, "seconds": round(time.monotonic() - start, 1),
                      "python": session.python,
                      "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            record.update(_junit_counts(junit))
            record["passed"] = bool(record.get("tests")) and not (record.get("failures")
                                                                  or record.get("errors"))
            record.update(_detected(doctor))
            (RESULTS / f"{label}.json").write_text(json.dumps(record, indent=2) + "\n")
    if ran is None:
        return None
    if not record["passed"]:
        session.error(f"conformance failed: {record.get('failures')} failures, "
                      f"{record.get('errors')} errors (matrix/results/{label}.json)")
    return record


def _detected(doctor: dict | None) -> dict:
    """What vllm_compat made of the installed vLLM, for the result records."""
    if not doctor:
        return {}
    if not doctor.get("ok"):
        return {"doctor_error": doctor.get("error")}
    report = doctor.get("drift") or {}
    out = {"vllm": doctor["version"], "adapter": doctor["era"], "routing": doctor["routing"],
           "newer_than_tested": doctor["newer_than_tested"], "probes": doctor["probes"],
           "drifted": doctor.get("drifted") or {},
           "drift": {k: report.get(k) for k in ("nearest_tested", "summary", "affects_capability",
                                                "capabilities")}}
    if doctor.get("refused"):  # VLLM_COMPAT_STRICT refused the build: recorded, not hidden
        out["refused"] = doctor["refused"]
    return out


ORACLE_OUTDATED = "oracle needs updating for this build"


def _junit_counts(path: Path) -> dict[str, int]:
    """tests / tests_passed / failures / errors / skipped, and of the skipped: ``xfailed``
    (every expected failure) and ``oracle_outdated`` (the test's own raw-vLLM reference broke)."""
    if not path.exists():
        return {}
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    if suite is None:
        return {}
    keys = ("tests", "failures", "errors", "skipped")
    out = {k: int(suite.get(k, 0)) for k in keys}
    skipped = [el for case in suite.iter("testcase") for el in case.findall("skipped")]
    out["xfailed"] = sum(el.get("type") == "pytest.xfail" for el in skipped)
    out["oracle_outdated"] = sum((el.get("message") or "").startswith(ORACLE_OUTDATED)
                                 for el in skipped)
    out["tests_passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


@nox.session(python=PYTHON)
def unit(session: nox.Session) -> None:
    """Tests that need no vLLM (CPU torch for the pipeline pieces)."""
    install_cpu_torch(session)
    # ray: the replicas test runs a real local Ray cluster (a ~80 MB wheel, cached by uv)
    session.install("-e", f"{ROOT}[test,eagle3,testing,ray,serve]")
    session.run("python", "-m", "pytest", str(ROOT / "tests" / "unit"), "-q", *session.posargs,
                env=TEST_ENV)


def _release(session: nox.Session, vllm: str) -> None:
    install_cpu_torch(session)
    install_vllm(session, f"vllm=={vllm}", vllm)
    session.install("-e", f"{ROOT}[test]")
    write_snapshot(session)  # the matrix run keeps every release's snapshot current
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
@nox.parametrize("vllm", RELEASES)
def snapshot(session: nox.Session, vllm: str) -> None:
    """Only the probe/surface snapshot of a release (no tests): src/vllm_compat/snapshots/."""
    install_cpu_torch(session)
    install_vllm(session, f"vllm=={vllm}", vllm)
    session.install("-e", str(ROOT))
    write_snapshot(session)


@nox.session(python=PYTHON)
def nightly(session: nox.Session) -> None:
    """A vLLM you name: ``nox -s nightly -- <wheel path | URL | spec> [-- pytest args]``.

    First the drift check (``vllm-compat doctor --drift --json``), then the conformance suite;
    one result file, ``matrix/results/nightly-<version>.json``: version, adapter, routing,
    probes, the drift report, test counts (``oracle_outdated``: tests whose own raw-vLLM
    reference broke on this build), and ``nightly-<version>-drift.txt``, the report as text.
    Exits non-zero when conformance fails or the drift affects a capability. Nightly wheels
    come from vLLM's own wheel index (see docs/nightlies.md).
    """
    if not session.posargs:
        session.error("usage: nox -s nightly -- <wheel path | URL | requirement> [-- pytest args]")
    spec, *rest = session.posargs
    if rest and rest[0] == "--":
        rest = rest[1:]
    install_cpu_torch(session)
    install_vllm(session, spec)
    session.install("-e", f"{ROOT}[test]")
    version = session.run("python", "-c", "import importlib.metadata as m; print(m.version('vllm'))",
                          silent=True)
    if version is None:  # --install-only
        return
    version = version.strip().splitlines()[-1]
    label = f"nightly-{version}"
    session.log(f"installed vLLM {version}: drift check first")
    doctor = drift_check(session, RESULTS / f"{label}-doctor.json")
    report = (doctor or {}).get("drift") or {}
    with (RESULTS / f"{label}-drift.txt").open("w") as f:
        session.run("python", "-m", "vllm_compat.cli", "doctor", "--drift", env=_env(session),
                    stdout=f, success_codes=[0, 1, 2])
    session.log(report.get("summary") or f"doctor: {(doctor or {}).get('error')}")
    record = None
    try:
        record = run_conformance(session, label, rest, doctor=doctor)
    finally:
        path = RESULTS / f"{label}.json"
        if path.exists():  # one file with everything: the full drift report goes in too
            full = json.loads(path.read_text())
            full["drift"] = report or full.get("drift")
            path.write_text(json.dumps(full, indent=2) + "\n")
            session.log(f"wrote {path}")
    if record is not None and report.get("affects_capability"):
        session.error(f"drift affects {', '.join(report.get('capabilities') or [])} "
                      f"({RESULTS / (label + '-drift.txt')})")


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


SPECULATORS_09 = "speculators==0.9.0"


def speculators_python(session: nox.Session) -> str:
    """speculators 0.9.0 in a virtual environment of its own (its torch and transformers
    pins, CPU torch), beside the session's; the path of its Python."""
    venv = Path(session.virtualenv.location).parent / "speculators-0.9.0"
    python = venv / "bin" / "python"
    uv = [sys.executable, "-m", "uv"]
    if not python.exists():
        session.run(*uv, "venv", "-q", "-p", PYTHON, str(venv), external=True)
    session.run(*uv, "pip", "install", "-q", "--python", str(python), *_torch_source(),
                "torch==2.13.0+cpu", external=True)
    # its torchvision/torchaudio pins are never imported on the text path (matrix/excludes.txt)
    session.run(*uv, "pip", "install", "-q", "--python", str(python), "--excludes",
                str(ROOT / "matrix" / "excludes.txt"), SPECULATORS_09, external=True)
    return str(python)


@nox.session(python=PYTHON)
def speculators09(session: nox.Session) -> None:
    """speculators 0.9.0's own prepare-data, generate-offline-data and train (online, file
    and FP8) against ``vllm-compat serve-hidden-states`` on the CPU (tests/speculators09)."""
    install_cpu_torch(session)
    session.install("-e", f"{ROOT}[test,serve,eagle3]")
    python = speculators_python(session)
    session.run("python", "-m", "pytest", str(ROOT / "tests" / "speculators09"), "-q",
                *session.posargs, env=dict(TEST_ENV, SPECULATORS_PYTHON=python))


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


# A markdown link or image whose target is not absolute: broken on an index page.
RELATIVE_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s]+)\)")


def long_description_problems(wheel: Path) -> list[str]:
    """The relative links left in the wheel's long description (its METADATA body)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        body = email.message_from_bytes(zf.read(name)).get_payload()
    assert isinstance(body, str) and body.strip(), f"{wheel.name}: no long description"
    return RELATIVE_LINK.findall(body)


@nox.session(python=PYTHON)
def package(session: nox.Session) -> None:
    """What a release publishes: sdist + wheel (``uv build``), ``twine check --strict``, no
    relative link in the long description, the wheel installed alone in a clean venv runs."""
    session.install("twine>=6.1", "uv")
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("uv", "build", "--out-dir", str(dist), str(ROOT))
    files = sorted(dist.glob("*.whl")) + sorted(dist.glob("*.tar.gz"))
    if len(files) != 2:
        session.error(f"expected one wheel and one sdist in {dist}, found {[f.name for f in files]}")
    session.run("twine", "check", "--strict", *map(str, files))
    wheel = files[0]
    relative = long_description_problems(wheel)
    if relative:
        session.error(f"relative links in the long description: {relative}")
    with zipfile.ZipFile(wheel) as zf:
        if not any(n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist()):
            session.error(f"{wheel.name} carries no LICENSE")
    venv = Path(session.create_tmp()) / "clean-venv"
    shutil.rmtree(venv, ignore_errors=True)
    session.run("uv", "venv", "-q", "-p", PYTHON, str(venv))
    session.run("uv", "pip", "install", "-q", "--python", str(venv / "bin" / "python"), str(wheel))
    out = session.run(str(venv / "bin" / "vllm-compat"), "--version", silent=True, external=True)
    if out is not None and out.strip() != f"vllm-compat {wheel.name.split('-')[1]}":
        session.error(f"the installed wheel says {out.strip()!r}")
    session.log(f"{wheel.name}: {out.strip() if out else ''}")
