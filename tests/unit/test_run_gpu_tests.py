"""tools/run_gpu_tests.py on a machine without a GPU: units, ordering, the results file, and a
second run of the same code skipping what finished (every GPU test skips here, which is an
outcome like any other)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import run_gpu_tests as R

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/gpu/test_extract_fp8_gpu.py"]


def test_units_run_longest_first_and_skip_what_finished():
    tests = [("a.py::t1", "a.py"), ("a.py::t2", "a.py"), ("b.py::t1", "b.py::t1"),
             ("b.py::t2[x]", "b.py::t2"), ("b.py::t2[y]", "b.py::t2")]
    secs = {"a.py::t1": 10, "a.py::t2": 10, "b.py::t1": 300, "b.py::t2[x]": 5}
    plan = R.plan_units(tests, done={"a.py::t2"}, seconds=secs)
    assert [u for u, _, _ in plan] == ["b.py::t1", "b.py::t2", "a.py"]
    assert plan[1] == ("b.py::t2", ["b.py::t2[x]", "b.py::t2[y]"], 5 + R.DEFAULT_TEST_S)
    assert plan[2][1] == ["a.py::t1"]  # the finished test is not run again


def test_a_cut_short_results_line_is_ignored(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({"test": "x", "outcome": "passed", "code": "c"}) + "\n{\"test\": \"y\"")
    assert list(R.latest_by_test(R.read_results(p), "c")) == ["x"]


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/run_gpu_tests.py", "--out",
                           str(tmp_path / "report.json"), "--jobs", "2", *extra, "--", *FILES],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_second_run_of_the_same_code_skips_what_finished(tmp_path):
    first = _run(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    rep = json.loads((tmp_path / "report.json").read_text())
    rows = R.read_results(tmp_path / "gpu-results.jsonl")
    assert rows and {r["outcome"] for r in rows} == {"skipped"}  # no GPU here
    assert {r["code"] for r in rows} == {rep["code"]} == {R.code_id()}
    assert rep["counts"] == {"skipped": len(rows)} and not rep["not_run"]
    assert [u["unit"] for u in rep["units"]] == FILES
    # a killed run leaves some lines: the next run does only the rest
    (tmp_path / "gpu-results.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows[:-1]) + "\n")
    second = _run(tmp_path)
    assert f"{len(rows) - 1} already finished" in second.stdout, second.stdout
    assert len(R.read_results(tmp_path / "gpu-results.jsonl")) == len(rows)
    status = _run(tmp_path, "--status")
    assert f"'skipped': {len(rows)}" in status.stdout


def test_a_failure_is_recorded_with_its_message_and_place(tmp_path):
    """The results line of a failed or errored test says where and why (the assertion's text,
    the exception's message), not only the exception's type."""
    (tmp_path / "test_fails.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise ValueError('layer id 2 is requested more than once')\n\n"
        "def test_assertion():\n"
        "    assert [1] == [2], 'cycle 1: greedy outputs changed'\n\n"
        "def test_fixture(broken):\n"
        "    pass\n")
    out = tmp_path / "outcomes.jsonl"
    env = dict(os.environ, VLLM_COMPAT_GPU_OUTCOMES=str(out), VLLM_COMPAT_CODE="c")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "tests.gpu.conftest", str(tmp_path / "test_fails.py")],
                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    rows = {r["test"].split("::")[1]: r for r in R.read_results(out)}
    assert rows["test_assertion"]["outcome"] == "failed"
    assert "test_fails.py:8" in rows["test_assertion"]["detail"]
    assert "cycle 1: greedy outputs changed" in rows["test_assertion"]["detail"]
    assert rows["test_fixture"]["outcome"] == "error"
    assert "ValueError: layer id 2 is requested more than once" in rows["test_fixture"]["detail"]


def test_a_skip_is_recorded_with_its_reason_and_a_path_inside_the_checkout(tmp_path):
    """A results file is published as it is: a skip or a failure names the test's file
    relative to the directory the suite ran from, not the host's absolute path (pytest gives
    a skip as a tuple, a failure's place as an absolute path)."""
    (tmp_path / "test_skips.py").write_text("import pytest\n\n"
                                            "def test_needs_two():\n"
                                            "    pytest.skip('needs >= 2 GPUs')\n\n"
                                            "def test_fails():\n"
                                            "    assert 1 == 2, 'off'\n")
    out = tmp_path / "outcomes.jsonl"
    env = dict(os.environ, VLLM_COMPAT_GPU_OUTCOMES=str(out), VLLM_COMPAT_CODE="c",
               PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "tests.gpu.conftest", str(tmp_path / "test_skips.py")],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    skip, fail = R.read_results(out)
    assert skip["outcome"] == "skipped"
    assert skip["detail"] == "test_skips.py:4: Skipped: needs >= 2 GPUs"
    assert fail["outcome"] == "failed" and fail["detail"].startswith("test_skips.py:7: AssertionError: off")


def test_each_units_output_is_kept_beside_the_report(tmp_path):
    first = _run(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    rep = json.loads((tmp_path / "report.json").read_text())
    logs = [Path(u["log"]) for u in rep["units"]]
    assert [p.parent for p in logs] == [tmp_path / "report-logs"]
    assert "skipped" in logs[0].read_text()


def test_a_unit_stopped_mid_test_keeps_what_its_processes_printed(tmp_path):
    """An engine's root cause is printed by its own process; a unit stopped by a timeout before
    pytest reports must still have it in its log (captured output would be lost with it)."""
    import os
    import signal
    import threading
    import time

    pid_file = tmp_path / "pid"
    (tmp_path / "test_stuck.py").write_text(
        "import os, subprocess, sys, time\nimport pytest\n\n"
        "@pytest.mark.gpu\n"
        "def test_engine_fails_then_hangs():\n"
        f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "    subprocess.run([sys.executable, '-c', "
        "'import sys; sys.stderr.write(\"root cause: KV cache does not fit\\\\n\")'])\n"
        "    time.sleep(120)\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    done = threading.Thread(target=R.run_unit, daemon=True, args=(
        "stuck", [str(tmp_path / "test_stuck.py")], logs, dict(os.environ), 0, []))
    done.start()
    log = logs / "unit-0.log"
    deadline = time.monotonic() + 60
    seen = False
    while time.monotonic() < deadline and not seen:
        time.sleep(0.5)
        seen = log.exists() and "root cause: KV cache does not fit" in log.read_text()
    if pid_file.exists():
        os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the timeout
    done.join(30)
    assert seen, log.read_text() if log.exists() else "no log"


def test_a_stopped_runner_stops_its_units_and_the_engines_they_started(tmp_path):
    """``timeout 560 python tools/run_gpu_tests.py`` once left a unit's engine holding 16 GiB of
    the GPU after the runner was gone, and the benchmark started next failed for memory."""
    import os
    import signal
    import time

    pid_file = tmp_path / "engine.pid"
    (tmp_path / "test_engine.py").write_text(
        "import subprocess, sys, time\nimport pytest\n\n"
        "@pytest.mark.gpu\n"
        "def test_with_an_engine_process():\n"
        "    engine = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"    open({str(pid_file)!r}, 'w').write(str(engine.pid))\n"
        "    time.sleep(300)\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    # the runner's main as far as units go: its signal handlers, one unit in a worker thread
    driver = ("import os, sys, threading\n"
              "from tools import run_gpu_tests as R\n"
              "R.stop_units_on_signals()\n"
              "t = threading.Thread(target=R.run_unit, args=('u', [sys.argv[1]], R.Path(sys.argv[2]), "
              "dict(os.environ), 0, ['-p', 'tests.gpu.conftest']))\n"
              "t.start(); t.join()\n")
    runner = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path / "test_engine.py"), str(logs)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not pid_file.exists() and time.monotonic() < deadline and runner.poll() is None:
        time.sleep(0.2)
    assert pid_file.exists(), runner.communicate(timeout=60)[0] if runner.poll() is not None else "no engine"
    engine = int(pid_file.read_text())
    runner.send_signal(signal.SIGTERM)
    out = runner.communicate(timeout=60)[0]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(engine, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(engine, signal.SIGKILL)
        raise AssertionError(f"the unit's engine process {engine} outlived the stopped runner: {out}")
    assert runner.returncode == 128 + signal.SIGTERM, out
    assert "stopped by signal 15: 1 unit(s) stopped" in out, out


def test_a_fresh_host_orders_units_by_the_shipped_durations(tmp_path):
    """With no results file yet, a long unit the host never timed still starts first: ordered by
    DEFAULT_TEST_S alone, the serve unit below would start last and hold the suite up."""
    tests = [("serve.py::t[kimi]", "serve.py::t[kimi]"), ("a.py::t1", "a.py"),
             ("a.py::t2", "a.py")]
    shipped = tmp_path / "durations.json"
    shipped.write_text(json.dumps({"seconds": {"serve.py::t[kimi]": 300.0, "a.py::t1": 20.0}}))
    plan = R.plan_units(tests, set(), R.unit_seconds([], shipped))
    assert [u for u, _, _ in plan] == ["serve.py::t[kimi]", "a.py"]
    # this host's own durations win over the shipped ones
    here = [{"test": "serve.py::t[kimi]", "outcome": "passed", "seconds": 5.0}]
    plan = R.plan_units(tests, set(), R.unit_seconds(here, shipped))
    assert [u for u, _, _ in plan] == ["a.py", "serve.py::t[kimi]"]


def test_save_durations_merges_what_ran_and_leaves_out_skips(tmp_path):
    shipped = tmp_path / "durations.json"
    shipped.write_text(json.dumps({"seconds": {"a.py::t1": 20.0, "b.py::t": 90.0}}))
    results = tmp_path / "gpu-results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in [
        {"test": "a.py::t1", "outcome": "passed", "seconds": 25.0},
        {"test": "b.py::t", "outcome": "skipped", "seconds": 0.1},  # a smaller host
        {"test": "c.py::t", "outcome": "failed", "seconds": 40.0}]) + "\n")
    R.save_durations(results, shipped)
    assert R.shipped_durations(shipped) == {"a.py::t1": 25.0, "b.py::t": 90.0, "c.py::t": 40.0}


def test_the_shipped_durations_name_tests_that_exist():
    """A renamed or removed GPU test leaves a stale entry; every entry names a collected test."""
    collected = {n for n, _ in R.collect([str(R.GPU_TESTS)], dict(os.environ))}
    stale = set(R.shipped_durations()) - collected
    assert R.shipped_durations() and not stale, sorted(stale)


def test_a_broken_durations_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "durations.json"
    bad.write_text('{"seconds": ')  # cut short
    with pytest.raises(SystemExit) as e:
        R.shipped_durations(bad)
    assert e.value.code == 2 and "not a durations file" in capsys.readouterr().err
