"""Run tests/gpu against the vLLM installed here, several test processes side by side on the
GPU, and write one JSON report.

    python tools/run_gpu_tests.py --out gpu-report.json            # the whole suite
    python tools/run_gpu_tests.py --out gpu-report.json --detach   # the same, in the background
    python tools/run_gpu_tests.py --out gpu-report.json --status   # how far it got
    python tools/run_gpu_tests.py --out gpu-report.json -- tests/gpu/test_kimi_k25_gpu.py -k eager

What ``nox -s gpu`` runs after it has installed vLLM; on a GPU host that cannot reach PyPI,
install vLLM by other means and run this directly.

The suite is cut into units (a test file, or each test of a file that declares
``GPU_TEST_UNIT = "function"``: its tests share no engine, or each value of one parameter
for ``"param:NAME"``) and ``--jobs`` pytest processes
take them longest first, each engine with a fixed KV cache (``VLLM_COMPAT_GPU_TEST_KV_BYTES``,
2 GiB unless set) so that they fit side by side. Each test's outcome and duration is
appended to the results file (``gpu-results.jsonl`` beside ``--out``) as it finishes, with
where it failed and the message, and the code it ran (the git commit, or a hash of the
sources without git); each unit's whole pytest output and its tests' records are kept in
``<report>-logs/``. A second run of the same code skips the tests already there (``--fresh``
runs everything, ``--retry-failed`` the failures again); durations of earlier runs order the
units, and where this host has none, those of a measured run shipped in
``tests/gpu/durations.json`` (``--save-durations`` merges the results file into it).
Stopped by SIGTERM or SIGINT, it stops its units and the engines they started. The report
holds the versions (vLLM, torch, CUDA, GPU), each test's outcome, the wall-clock time against
the sum of the tests' own, and the records the tests write (``VLLM_COMPAT_GPU_RESULTS``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = ROOT / "tests" / "gpu"
KV_BYTES = str(2 << 30)
PER_JOB_GIB = 14.0  # one test process: its engines' weights, a 2 GiB KV cache, activations
DEFAULT_TEST_S = 60.0  # a test never timed before, here or in SHIPPED_DURATIONS
# Each test's duration in a measured run, shipped so that a fresh host (no results file yet)
# still starts the longest units first: with every test at DEFAULT_TEST_S, a long unit added
# since can start last and hold the whole suite up.
SHIPPED_DURATIONS = GPU_TESTS / "durations.json"
FINISHED = {"passed", "skipped", "xfailed", "xpassed"}
STOP_GRACE_S = 10.0  # SIGTERM to a unit's processes, then SIGKILL
_UNITS: dict[int, subprocess.Popen] = {}  # running units by pid; each leads a process group
_UNITS_LOCK = threading.Lock()


# --------------------------------------------------------------------------- what ran


def code_id() -> str:
    """The code the tests run (:func:`vllm_compat.testing.provenance.code_id`)."""
    from vllm_compat.testing.provenance import code_id as of
    return of(ROOT)


def environment() -> dict[str, object]:
    code = ("import json, vllm_compat; from vllm_compat.testing.provenance import versions; "
            "print(json.dumps(dict(versions(), adapter=vllm_compat.detect().era)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:] or ["environment probe failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
    return rows


def latest_by_test(rows: list[dict[str, Any]], code: str) -> dict[str, dict[str, Any]]:
    return {r["test"]: r for r in rows if r.get("code") == code}


def durations(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each test's most recent duration, whatever code it ran."""
    return {r["test"]: float(r.get("seconds") or 0.0) for r in rows}


def shipped_durations(path: Path = SHIPPED_DURATIONS) -> dict[str, float]:
    if not path.exists():
        return {}
    try:
        return {t: float(s) for t, s in json.loads(path.read_text())["seconds"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        sys.stderr.write(f"{path}: not a durations file ({type(e).__name__}: {e}); "
                         "fix it or delete it\n")
        raise SystemExit(2) from None


def unit_seconds(earlier: list[dict[str, Any]],
                 shipped: Path = SHIPPED_DURATIONS) -> dict[str, float]:
    """What orders the units: this host's own durations, else the shipped ones."""
    return {**shipped_durations(shipped), **durations(earlier)}


def save_durations(results: Path, path: Path = SHIPPED_DURATIONS) -> dict[str, float]:
    """Merge the durations of the tests that ran (not skipped: a skip on a smaller host says
    nothing of the test's length) into the shipped file."""
    ran = durations([r for r in read_results(results) if r.get("outcome") != "skipped"])
    merged = dict(sorted({**shipped_durations(path), **ran}.items()))
    body = {"what": "seconds each GPU test took in its latest measured run; "
                    "tools/run_gpu_tests.py orders units by them where its results file "
                    "has not timed a test (its --save-durations merges a results file in)",
            "seconds": {t: round(s, 1) for t, s in merged.items()}}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return merged


# --------------------------------------------------------------------------- units


def collect(pytest_args: list[str], env: dict[str, str]) -> list[tuple[str, str]]:
    """``(node id, unit)`` of every selected test, as tests/gpu/conftest.py names them."""
    fd, out = tempfile.mkstemp(suffix=".jsonl", prefix="gpu-units-")
    os.close(fd)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                            "-p", "no:cacheprovider", *pytest_args], cwd=ROOT,
                           env=dict(env, VLLM_COMPAT_GPU_UNITS_OUT=out),
                           capture_output=True, text=True)
        if r.returncode not in (0, 5):  # 5: nothing selected
            sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
            raise SystemExit(f"collecting tests/gpu failed (pytest exit {r.returncode})")
        rows = [json.loads(x) for x in Path(out).read_text().splitlines() if x.strip()]
    finally:
        os.unlink(out)
    return [(r["nodeid"], r["unit"]) for r in rows]


def plan_units(tests: list[tuple[str, str]], done: set[str],
               seconds: dict[str, float]) -> list[tuple[str, list[str], float]]:
    """Units still to run, longest (by earlier durations) first: ``(unit, node ids, s)``."""
    units: dict[str, list[str]] = defaultdict(list)
    for nodeid, unit in tests:
        if nodeid not in done:
            units[unit].append(nodeid)
    planned = [(u, ids, sum(seconds.get(i, DEFAULT_TEST_S) for i in ids))
               for u, ids in units.items()]
    return sorted(planned, key=lambda x: -x[2])


def free_gpu_gib() -> float | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    r = subprocess.run([smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    try:
        return float(r.stdout.split()[0]) / 1024
    except (IndexError, ValueError):
        return None


def auto_jobs(n_units: int, per_job_gib: float) -> int:
    free = free_gpu_gib()
    by_memory = int(free // per_job_gib) if free else 1
    by_cpu = max(1, (os.cpu_count() or 2) // 2)
    return max(1, min(n_units, by_memory, by_cpu))


# --------------------------------------------------------------------------- the run


def run_unit(unit: str, ids: list[str], logs: Path, env: dict[str, str], n: int,
             extra: list[str]) -> dict[str, Any]:
    t0 = time.monotonic()
    log = logs / f"unit-{n}.log"
    with log.open("w") as f:
        # -s: the output (an engine process's root cause included) reaches the log as it is
        # written, so a unit stopped by a timeout keeps it; captured output would be lost
        # its own process group: the engines it starts can be stopped with it (stop_units)
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider",
                              "-q", "-s", *extra, *ids], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             env=dict(env, VLLM_COMPAT_GPU_RESULTS=str(logs / f"records-{n}.jsonl")),
                             start_new_session=True)
        with _UNITS_LOCK:
            _UNITS[p.pid] = p
        try:
            rc = p.wait()
        finally:
            with _UNITS_LOCK:
                _UNITS.pop(p.pid, None)
    tail = log.read_text(errors="replace").splitlines()[-3:]
    print(f"[{time.strftime('%H:%M:%S')}] {unit}: {len(ids)} test(s), pytest exit {rc}, "
          f"{time.monotonic() - t0:.0f} s  {' | '.join(tail)[-200:]}", flush=True)
    return {"unit": unit, "tests": len(ids), "pytest_exit_code": rc,
            "seconds": round(time.monotonic() - t0, 1), "log": str(log)}


def stop_units(signum: int, frame: Any = None) -> None:
    """On SIGTERM / SIGINT (a ``timeout``, a job scheduler, Ctrl-C): stop every running unit
    and the engine processes it started, then exit. Left running, their engines would hold
    GPU memory that whatever runs next on the GPU needs."""
    with _UNITS_LOCK:
        groups = list(_UNITS)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, sig)
        deadline = time.monotonic() + STOP_GRACE_S
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(map(_group_alive, groups)):
            time.sleep(0.2)
    print(f"stopped by signal {signum}: {len(groups)} unit(s) stopped; finished tests are in "
          "the results file", flush=True)
    os._exit(128 + signum)  # the pool's threads wait on the stopped units: leave without them


def stop_units_on_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_units)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unit_logs(out: Path) -> Path:
    """Each unit's whole pytest output and the records its tests write, kept beside the
    report (``<report>-logs/unit-N.log``, ``records-N.jsonl``), so a run stopped before its
    report still has its tracebacks and measurements; an earlier run's are replaced."""
    logs = out.with_name(out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    for old in [*logs.glob("unit-*.log"), *logs.glob("records-*.jsonl")]:
        old.unlink()
    return logs


def report(out: Path, results: Path, code: str, wall: float, jobs: int,
           units: list[dict[str, Any]], records: list[dict[str, Any]],
           selected: list[str]) -> dict[str, Any]:
    rows = latest_by_test(read_results(results), code)
    tests = [rows[t] for t in selected if t in rows]
    counts: dict[str, int] = defaultdict(int)
    for r in tests:
        counts[r["outcome"]] += 1
    rep = {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "code": code,
           "wall_s": round(wall, 1), "jobs": jobs,
           "sum_test_s": round(sum(float(r.get("seconds") or 0) for r in tests), 1),
           "environment": environment(), "counts": dict(counts),
           "not_run": [t for t in selected if t not in rows], "units": units, "tests": tests,
           "records": records}
    out.write_text(json.dumps(rep, indent=1) + "\n")
    return rep


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON report to write")
    ap.add_argument("--results", help="per-test results, one JSON line each "
                                      "(default: gpu-results.jsonl beside --out)")
    ap.add_argument("--jobs", type=int, default=0,
                    help="test processes side by side (default: what GPU memory and CPUs allow)")
    ap.add_argument("--per-job-gib", type=float, default=PER_JOB_GIB)
    ap.add_argument("--fresh", action="store_true", help="run tests that already finished too")
    ap.add_argument("--retry-failed", action="store_true", help="run failed tests again")
    ap.add_argument("--detach", action="store_true", help="run in the background; log beside --out")
    ap.add_argument("--status", action="store_true", help="print what the results file holds")
    ap.add_argument("--save-durations", action="store_true",
                    help=f"merge the results file's durations into {SHIPPED_DURATIONS.name}")
    ap.add_argument("pytest_args", nargs="*", help="test files or pytest arguments (after --)")
    return ap.parse_args(argv)


def status(results: Path, code: str) -> int:
    rows = latest_by_test(read_results(results), code)
    counts: dict[str, int] = defaultdict(int)
    for r in rows.values():
        counts[r["outcome"]] += 1
    print(f"{results}: code {code}: {dict(counts)} ({len(rows)} tests, "
          f"{sum(float(r.get('seconds') or 0) for r in rows.values()):.0f} s of tests)")
    for r in rows.values():
        if r["outcome"] not in FINISHED:
            print(f"  {r['outcome']}: {r['test']}  {r.get('detail') or ''}"[:300])
    return 0


def detach(argv: list[str], out: Path) -> int:
    log = out.with_suffix(".log")
    args = [a for a in argv if a != "--detach"]
    with log.open("ab") as f:
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], cwd=ROOT,
                             stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    print(f"running in the background (pid {p.pid}); log {log}; "
          f"progress: {Path(sys.argv[0]).name} --out {out} --status")
    return 0


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(raw)
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    results = Path(a.results).resolve() if a.results else out.parent / "gpu-results.jsonl"
    code = code_id()
    if a.status:
        return status(results, code)
    if a.detach:
        return detach(raw, out)
    if a.save_durations:
        print(f"{len(save_durations(results))} durations -> {SHIPPED_DURATIONS}")
        return 0
    env = dict(os.environ, VLLM_COMPAT_GPU_OUTCOMES=str(results), VLLM_COMPAT_CODE=code)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # greedy tests never reach it; no JIT
    env.setdefault("VLLM_COMPAT_GPU_TEST_KV_BYTES", KV_BYTES)
    # test files or folders among the arguments replace the default, the whole tests/gpu
    paths = [x for x in a.pytest_args
             if not x.startswith("-") and (ROOT / x.split("::")[0]).exists()]
    extra = [x for x in a.pytest_args if x not in paths]
    t0 = time.monotonic()
    tests = collect((paths or [str(GPU_TESTS)]) + extra, env)
    earlier = read_results(results)
    done = set()
    if not a.fresh:
        done = {t for t, r in latest_by_test(earlier, code).items()
                if r["outcome"] in FINISHED or not a.retry_failed}
    todo = plan_units(tests, done, unit_seconds(earlier))
    jobs = a.jobs or auto_jobs(len(todo), a.per_job_gib)
    print(f"{len(tests)} tests, {len(tests) - sum(len(u[1]) for u in todo)} already finished "
          f"for {code}; {len(todo)} units on {jobs} job(s); results -> {results}", flush=True)
    logs = unit_logs(out)
    stop_units_on_signals()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_unit, u, ids, logs, env, n, extra)
                   for n, (u, ids, _) in enumerate(todo)]
        units = [f.result() for f in futures]
    records = []
    for f in sorted(logs.glob("records-*.jsonl")):
        records += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    rep = report(out, results, code, time.monotonic() - t0, jobs, units, records,
                 [t for t, _ in tests])
    print(f"{rep['counts']} in {rep['wall_s']} s wall ({rep['sum_test_s']} s of tests, "
          f"{jobs} jobs); not run: {len(rep['not_run'])} -> {out}")
    bad = rep["not_run"] or any(r["outcome"] not in FINISHED for r in rep["tests"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
