"""bench.cpu_target_labels on a tiny shape: both ways give the same labels, both are timed."""

from __future__ import annotations

import json

import pytest
from bench import cpu_target_labels


@pytest.mark.usefixtures("one_torch_thread")
def test_both_ways_agree_and_are_timed(tmp_path, monkeypatch):
    from vllm_compat.eagle3 import model as M

    monkeypatch.setattr(M, "TARGET_ROWS_PER_MATMUL", 50)  # several pieces of a 200-id vocabulary
    out = tmp_path / "r.json"
    res = cpu_target_labels.main(["--out", str(out), "--batch", "3", "--seq", "16", "--hidden", "8",
                                  "--vocab", "200", "--draft-vocab", "40", "--rounds", "2"])
    assert json.loads(out.read_text()) == res
    assert res["same_labels"] is True
    assert all(len(v) == 2 and min(v) > 0 for v in res["seconds"].values())
    assert res["valid_tokens"] < res["padded_tokens"] == 48
