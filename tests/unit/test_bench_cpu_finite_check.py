"""bench.cpu_finite_check writes both timings and their ratio for the tensor it was given."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
from bench import cpu_finite_check as bench  # noqa: E402


def test_writes_both_timings_and_the_ratio(tmp_path):
    out = tmp_path / "r.json"
    res = bench.main(["--tokens", "16", "--layers", "2", "--hidden", "32", "--rounds", "3",
                      "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert [len(v) for v in res["ms_per_sample"].values()] == [3, 3]
    assert res["speedup"] == round(res["median_ms"]["isfinite_all"] / res["median_ms"]["all_finite"], 2)
