"""export -> validate, and one failing checkpoint per validation rule with its exact message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_compat.eagle3.export import export
from vllm_compat.testing.synthetic import write_dataset, write_target
from vllm_compat.eagle3.training import TrainConfig, train
from vllm_compat.eagle3.validate import CheckpointValidationError, validate
from vllm_compat.eagle3.vocab import build_vocab


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    write_target(d / "target")
    write_dataset(d / "ds", d / "target", num_samples=4)
    build_vocab(d / "ds", 96, draft_vocab_size=32, output_dir=d / "vocab")
    train(TrainConfig(dataset=str(d / "ds"), target=str(d / "target"), vocab=str(d / "vocab"),
                      output_dir=str(d / "run"), batch_size=2, dtype="fp32", progress=False, tensorboard=False))
    export(d / "run", d / "target", d / "ckpt", verifier="org/tiny-target", speculative_tokens=4)
    return d


def _copy(exported, tmp_path, config=None, tensors=None):
    out = tmp_path / "ckpt"
    shutil.copytree(exported / "ckpt", out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
    return out


def _errors(ckpt, target):
    with pytest.raises(CheckpointValidationError) as info:
        validate(ckpt, target, with_vllm=False)
    return [(p.code, p.message) for p in info.value.problems]


def test_exported_config_has_what_vllm_reads(exported):
    cfg = json.loads((exported / "ckpt" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["hidden_size"], layer["vocab_size"], layer["num_hidden_layers"]) == ("llama", 16, 96, 1)
    assert cfg["draft_vocab_size"] == 32 and cfg["norm_before_residual"] is True
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    t = load_file(str(exported / "ckpt" / "model.safetensors"))
    assert t["fc.weight"].shape == (16, 48) and t["fc.weight"].dtype == torch.bfloat16
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and "embed_tokens.weight" not in t


def test_export_validates(exported):
    report = validate(exported / "ckpt", exported / "target", with_vllm=False)
    assert report.ok and report.problems == [] and report.serving is None


def test_full_vocabulary_draft_ships_no_mapping(exported, tmp_path):
    build_vocab(exported / "ds", 96, draft_vocab_size=1000, output_dir=tmp_path / "vocab")  # capped at 96
    train(TrainConfig(dataset=str(exported / "ds"), target=str(exported / "target"), vocab=str(tmp_path / "vocab"),
                      output_dir=str(tmp_path / "run"), batch_size=4, dtype="fp32", progress=False, tensorboard=False))
    export(tmp_path / "run", exported / "target", tmp_path / "ckpt")
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    assert validate(tmp_path / "ckpt", with_vllm=False).ok  # target found through verifier.name_or_path


CASES = {
    "aux_missing": (
        dict(config=lambda c: c.pop("eagle_aux_hidden_state_layer_ids")),
        "eagle_aux_hidden_state_layer_ids is missing: vLLM falls back to the target's default layers (2, 4, 5), "
        "and acceptance collapses if the draft was trained on others"),
    "aux_invalid_range": (
        dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 4, 9])),
        "eagle_aux_hidden_state_layer_ids [0, 4, 9]: [0, 9] outside 1..7 (id k is the state entering decoder "
        "layer k; 0, the embeddings, crashes vLLM 0.10: it adds a None residual)"),
    "aux_invalid_order": (
        dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[5, 2, 4])),
        "eagle_aux_hidden_state_layer_ids [5, 2, 4] must be strictly increasing: vLLM 0.30+ sorts them, "
        "so fc would see the layers in another order"),
    "aux_final": (
        dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 8])),
        "eagle_aux_hidden_state_layer_ids [2, 4, 8] contains the final layer 8: that state is the training "
        "target, not a draft input"),
    "aux_count": (
        dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 4, 5])),
        "fc.weight takes 48 inputs = 3 x hidden 16, but eagle_aux_hidden_state_layer_ids lists 4 layers"),
    "d2t_shape": (
        dict(tensors=lambda t: t.update(d2t=t["d2t"][:-1].contiguous())),
        "d2t is int64 [31], expected int64 [32] (draft_vocab_size)"),
    "t2d_shape": (
        dict(tensors=lambda t: t.update(t2d=torch.cat([t["t2d"], torch.zeros(4, dtype=torch.bool)]))),
        "t2d is bool [100], expected bool [96] (target vocab size)"),
    "t2d_sum": (
        dict(tensors=lambda t: t["t2d"].__setitem__(int((~t["t2d"]).nonzero()[0]), True)),
        "t2d has 33 true entries, expected draft_vocab_size 32"),
    "d2t_t2d_mismatch": (
        dict(tensors=lambda t: t.update(d2t=torch.zeros(32, dtype=torch.int64))),
        "d2t (target = i + d2t[i]) and t2d select different target ids"),
    "lm_head_shape": (
        dict(tensors=lambda t: t.update(**{"lm_head.weight": t["lm_head.weight"][:30].contiguous()})),
        "lm_head.weight is [30, 16], expected [draft_vocab_size, hidden] = [32, 16]"),
}


@pytest.mark.parametrize("code", list(CASES))
def test_each_rule_fails_with_its_message(exported, tmp_path, code):
    change, message = CASES[code]
    ckpt = _copy(exported, tmp_path, **change)
    assert _errors(ckpt, exported / "target") == [(code.removesuffix("_range").removesuffix("_order"), message)]


def test_draft_for_another_target(exported, tmp_path):
    other = write_target(tmp_path / "other", hidden_size=32, vocab_size=128)
    errors = dict(_errors(exported / "ckpt", other))
    assert errors["target_hidden"] == f"draft made for hidden size 16, the target {other} has 32"
    assert errors["target_vocab"] == f"draft made for a vocabulary of 96, the target {other} has 128"
    assert errors["t2d_shape"] == "t2d is bool [96], expected bool [128] (target vocab size)"


def test_structure_and_weight_names(exported, tmp_path):
    ckpt = _copy(exported, tmp_path, config=lambda c: c["speculators_config"].pop("verifier"))
    assert _errors(ckpt, exported / "target") == [("structure", "speculators_config.verifier.name_or_path is missing")]
    ckpt2 = _copy(exported, tmp_path / "b", tensors=lambda t: t.update(
        **{"layers.0.extra.weight": torch.zeros(1)}, **{"norm.weight": t.pop("norm.weight")}) or t.pop("norm.weight"))
    assert _errors(ckpt2, exported / "target") == [
        ("missing_weight", "weights missing: ['norm.weight']"),
        ("unexpected_weight", "weights vLLM's EAGLE-3 loader has no parameter for: ['layers.0.extra.weight']"),
    ]


def test_absent_norm_before_residual_is_a_warning(exported, tmp_path):
    ckpt = _copy(exported, tmp_path, config=lambda c: c.pop("norm_before_residual"))
    report = validate(ckpt, exported / "target", with_vllm=False)
    assert report.ok and [p.code for p in report.warnings] == ["norm_before_residual"]
