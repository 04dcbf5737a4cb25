"""examples.eagle3_e2e.fp8_compare on the CPU: the FP8 copy of a dataset, two drafts trained
from the same seed, and the comparison's arithmetic (vLLM's evaluation runs on a GPU)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from examples.eagle3_e2e import fp8_compare as F
from vllm_compat.eagle3.data import HiddenStatesDataset
from vllm_compat.eagle3.vocab import build_vocab
from vllm_compat.testing.synthetic import write_dataset, write_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_fp8_copy_and_two_drafts_from_the_same_seed(tmp_path):
    target = write_target(tmp_path / "target")
    write_dataset(tmp_path / "ds", target, num_samples=12, dtype=torch.bfloat16)
    conv = F.convert(tmp_path / "ds", tmp_path / "ds_fp8", samples_per_shard=5)
    assert conv["samples"] == 12 and conv["layer_ids"] == [2, 4, 5, 8]
    assert conv["fp8_bytes"] < 0.8 * conv["bf16_bytes"]  # hidden 16: headers and ids weigh in
    assert all(0 < e < 0.04 for e in conv["rel_error_per_layer"])
    man = json.loads((tmp_path / "ds_fp8" / "manifest.json").read_text())
    assert man["dtype"] == "float8_e4m3fn" and man["target"]["name_or_path"] == str(target)
    a, b = HiddenStatesDataset(tmp_path / "ds"), HiddenStatesDataset(tmp_path / "ds_fp8")
    for i in (0, 11):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
        x, y = a[i]["hidden_states"].float(), b[i]["hidden_states"].float()
        assert float((y - x).norm() / x.norm()) < 0.04
    with pytest.raises(ValueError, match="already FP8"):
        F.convert(tmp_path / "ds_fp8", tmp_path / "again")

    build_vocab(tmp_path / "ds", 96, draft_vocab_size=32, output_dir=tmp_path / "vocab")
    args = argparse.Namespace(draft_batch=4, ttt_steps=2, draft_lr=1e-3, draft_warmup=2, seed=0,
                              draft_steps=6, k=3)
    runs = {dt: F.train_one(tmp_path / name, tmp_path / "target", tmp_path / "vocab",
                            tmp_path / f"compare_{dt}", args)
            for dt, name in (("bf16", "ds"), ("fp8", "ds_fp8"))}
    for r in runs.values():
        assert r["steps"] == 6 and (tmp_path / r["draft"] / "config.json").is_file()
    assert runs["fp8"]["last"]["loss"] == pytest.approx(runs["bf16"]["last"]["loss"], rel=0.05)


def test_comparison_arithmetic_and_report():
    al = {"bf16": {"batch1": 3.10, "batch32": 3.00}, "fp8": {"batch1": 3.05, "batch32": 2.90}}
    c = F.compare(al, 0.02)
    assert c["ratio"]["batch1"] == pytest.approx(3.05 / 3.10) and c["within"] is False  # 2.90/3.00
    assert F.compare({"bf16": {"b": 3.0}, "fp8": {"b": 2.95}}, 0.02)["within"] is True
    assert F.compare({"bf16": {"b": 3.0}, "fp8": {"b": None}}, 0.02)["within"] is False
    md = F.report_md({"comparison": c, "acceptance_length": al,
                      "train": {dt: {"last": {"loss": 1.5}, "train_s": 10} for dt in al},
                      "conversion": {"fp8_bytes": 5e8, "bf16_bytes": 1e9, "rel_error_per_layer": [0.02],
                                     "layer_ids": [8]}})
    assert "| fp8 / bf16 | 0.9839 | 0.9667 |" in md and "**False**" in md
