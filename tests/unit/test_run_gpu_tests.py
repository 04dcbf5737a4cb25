"""tools/run_gpu_tests.py on a machine without a GPU: units, ordering, the results file, and a
second run of the same code skipping what finished (every GPU test skips here, which is an
outcome like any other)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
