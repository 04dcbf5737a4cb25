"""bench.cpu_ttt_step runs one draft training step on a tiny shape and writes its JSON."""

from __future__ import annotations

import json
import math

import pytest
from bench import cpu_ttt_step

TINY = ["--batch", "2", "--seq", "12", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "48", "--vocab", "64", "--ttt-steps", "3", "--repeats", "2"]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_step_is_timed_and_written(tmp_path):
    res = cpu_ttt_step.main(["--out", str(tmp_path), *TINY])
    assert json.loads((tmp_path / "cpu_ttt_step.json").read_text()) == res
    assert len(res["seconds"]) == 2 and 0 < res["best_s"] <= res["median_s"]
    assert math.isfinite(res["loss"]) and res["loss"] > 0
    assert res["shape"]["ttt_steps"] == 3
