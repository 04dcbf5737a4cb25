"""bench.cpu_shard_writer on a small dataset: every mode runs, the FP8 modes write the same
dataset whether the samples come encoded or not, and the summary's arithmetic."""

from __future__ import annotations

import json

import pytest
from bench import cpu_shard_writer as csw

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_mode_runs_and_the_json_holds_the_medians(tmp_path):
    modes = csw.DEFAULT_MODES + csw.EXTRA_MODES
    res = csw.main(["--dir", str(tmp_path), "--mib", "32", "--rounds", "1", "--samples-per-shard", "1",
                    "--step-samples", "2", "--modes", ",".join(modes), "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["median_MB_s"] == res["median_MB_s"]
    assert set(res["median_MB_s"]) == set(modes) and all(v > 0 for v in res["median_MB_s"].values())
    b = {m: res["runs"][m][0]["bytes"] for m in modes}
    states = 2 * 1024 * 4 * 2048  # two 1024-token samples, 4 layers x 2048
    assert b["plain"] == states * 2 + 2 * 1024 * (8 + 1)  # bf16 states, int64 ids, bool mask
    assert b["plain_fp8"] == states + 2 * 1024 * (4 * 4 + 8 + 1)  # + the float32 scales
    assert b["c_fp8"] == b["c_fp8_encoded"] and b["plain_fp8"] < b["c_fp8"] < b["plain_fp8"] + 16384
    assert b["c_bf16"] > b["writer"] == b["writer_views"]  # + the manifest's bytes
    assert not (tmp_path / "vllm-compat-shard-bench").exists()
    with pytest.raises(SystemExit):
        csw.main(["--modes", "plain,before", "--out", str(tmp_path / "x.json")])


def test_summary_medians_and_ratios():
    runs = {"plain": [{"MB_s": 100.0}, {"MB_s": 300.0}, {"MB_s": 200.0}],
            "plain_fp8": [{"MB_s": 400.0}], "c_fp8": [{"MB_s": 40.0}],
            "c_fp8_encoded": [{"MB_s": 380.0}], "writer": []}
    s = csw.summarize(runs)
    assert s["median_MB_s"] == {"plain": 200.0, "plain_fp8": 400.0, "c_fp8": 40.0, "c_fp8_encoded": 380.0}
    assert s["ratios"] == {"c_fp8/plain_fp8": 0.1, "c_fp8_encoded/plain_fp8": 0.95,
                           "c_fp8_encoded/c_fp8": 9.5}
