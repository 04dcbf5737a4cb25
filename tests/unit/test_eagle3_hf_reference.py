"""The transformers reference extraction keeps vLLM's layer convention (final slot = pre-norm)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from vllm_compat.eagle3.data import HiddenStatesDataset
from vllm_compat.eagle3.hf_reference import extract_with_transformers
from vllm_compat.testing.models import build_model
from vllm_compat.eagle3.model import TargetHead
from vllm_compat.eagle3.target import load_target_tensors, read_target


def test_final_slot_reproduces_the_targets_logits(tmp_path):
    torch.set_num_threads(1)
    target = build_model("llama", tmp_path / "target", dtype=torch.float32, vocab_size=64,
                       hidden_size=16, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    ids = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "prepared.jsonl").write_text("".join(
        json.dumps({"line": i + 1, "input_ids": row.tolist(), "loss_mask": [1] * 7}) + "\n"
        for i, row in enumerate(ids)))
    assert extract_with_transformers(target, tmp_path / "prep", tmp_path / "ds", [1, 2, 3], samples_per_shard=2) == 3
    # rerunning resumes: nothing is extracted twice
    assert extract_with_transformers(target, tmp_path / "prep", tmp_path / "ds", [1, 2, 3]) == 3
    ds = HiddenStatesDataset(tmp_path / "ds")
    assert ds.manifest.layer_ids == [1, 2, 3, 4] and len(ds) == 3

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target).eval()
    heads = load_target_tensors(read_target(target))
    head = TargetHead(heads["norm"], heads["lm_head"], model.config.rms_norm_eps)
    with torch.no_grad():
        for i, sample in enumerate(ds):
            out = model(input_ids=ids[i : i + 1], output_hidden_states=True)
            assert torch.equal(sample["input_ids"], ids[i])
            for slot, k in enumerate([1, 2, 3]):  # id k = the state entering decoder layer k
                assert torch.allclose(sample["hidden_states"][:, slot], out.hidden_states[k][0])
            # slot L is before the final norm: norm + lm_head on it gives the model's logits
            assert torch.allclose(head(sample["hidden_states"][:, -1]), out.logits[0], atol=1e-5)
            assert not torch.allclose(sample["hidden_states"][:, -1], out.hidden_states[-1][0])
