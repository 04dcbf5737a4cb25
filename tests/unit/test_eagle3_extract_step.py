"""`vllm-compat eagle3 extract`: prepare output -> shard dataset, default layers, resume."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from vllm_compat.eagle3.cli import main
from vllm_compat.eagle3.data import HiddenStatesDataset
from vllm_compat.eagle3.extract_step import aux_layer_ids_for, extract_dataset
from vllm_compat.testing.models import build_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def target(tmp_path):
    return build_model("llama", tmp_path / "target", dtype=torch.float32, vocab_size=64,
                       hidden_size=16, num_hidden_layers=8,
                       num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)


def _prepared(tmp_path, n):
    ids = torch.randint(0, 64, (n, 5), generator=torch.Generator().manual_seed(1))
    d = tmp_path / "prep"
    d.mkdir(exist_ok=True)
    (d / "prepared.jsonl").write_text("".join(
        json.dumps({"line": i + 1, "input_ids": r.tolist(), "loss_mask": [0, 1, 1, 1, 1]}) + "\n"
        for i, r in enumerate(ids)))
    return d


def test_default_aux_layers_are_eagle3s(target):
    assert aux_layer_ids_for(target, None) == (2, 4, 5)  # (2, L//2, L-3) for L = 8


@pytest.mark.parametrize("bad,msg", [([2, 8], "final layer 8"), ([-1, 2], "-1"), ([2, 2], "2"), ([9], "9")])
def test_bad_aux_layers_are_refused(target, bad, msg):
    with pytest.raises(ValueError, match=msg):
        aux_layer_ids_for(target, bad)


def test_cli_extract_resumes_where_it_stopped(target, tmp_path):
    prep = _prepared(tmp_path, 3)
    args = ["eagle3", "extract", str(prep), "--target", target, "-o", str(tmp_path / "ds"),
            "--backend", "transformers", "--dtype", "float32", "--samples-per-shard", "2", "--no-progress"]
    assert main(args) == 0
    assert len(HiddenStatesDataset(tmp_path / "ds")) == 3
    _prepared(tmp_path, 5)  # two more records appended (same first three)
    assert main(args) == 0
    ds = HiddenStatesDataset(tmp_path / "ds")
    assert len(ds) == 5 and ds.manifest.layer_ids == [2, 4, 5, 8]
    first = [s["hidden_states"] for s in ds][:3]
    fresh = extract_dataset(target, prep, tmp_path / "ds2", backend="transformers", dtype=torch.float32)
    assert fresh == 5
    assert all(torch.equal(a, b["hidden_states"]) for a, b in zip(first, HiddenStatesDataset(tmp_path / "ds2")))


def test_unknown_backend(target, tmp_path):
    with pytest.raises(ValueError, match="backend must be one of"):
        extract_dataset(target, tmp_path, tmp_path / "ds", backend="sglang")
