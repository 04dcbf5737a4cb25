"""The support table shows what each release's drift check found, and which runs had none."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report():
    spec = importlib.util.spec_from_file_location("matrix_report", ROOT / "matrix" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_table_has_the_drift_check_of_each_run(tmp_path):
    (tmp_path / "matrix" / "results").mkdir(parents=True)
    (tmp_path / "matrix" / "releases.toml").write_text('releases = ["0.29.0", "0.30.0", "0.31.0", "0.32.0"]\n')
    base = {"passed": True, "tests": 113, "failures": 0, "errors": 0, "skipped": 0, "seconds": 400.4,
            "finished": "2026-12-01T20:48:04Z"}
    results = {
        "0.29.0": dict(base, adapter="v0_29", drift={"summary": "drift check against 0.29.0: no drift"}),
        "0.30.0": dict(base, adapter="v0_29", drift={
            "summary": "drift check against 0.30.0: 1 change, affects requests"}, passed=False, failures=2),
        "0.31.0": dict(base, tests=38, seconds=120.0, finished="2026-11-29T10:48:28Z"),  # before the check
    }
    for rel, r in results.items():
        (tmp_path / "matrix" / "results" / f"{rel}.json").write_text(json.dumps(r))
    rows = _report().table(tmp_path).splitlines()
    assert rows[0].split(" | ")[6] == "drift check"
    assert rows[2:] == [
        "| 0.29.0 | v0_29 | pass | 113 | 0 | 0 | no drift | 400 | 2026-12-01T20:48:04Z |",
        "| 0.30.0 | v0_29 | **FAIL** | 111 | 0 | 2 | 1 change, affects requests | 400 | 2026-12-01T20:48:04Z |",
        "| 0.31.0 | v0_29 | pass | 38 | 0 | 0 | not recorded | 120 | 2026-11-29T10:48:28Z |",
        "| 0.32.0 | v0_29 | not run | | | | | | |",
    ]
