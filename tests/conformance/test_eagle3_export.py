"""Our exported EAGLE-3 checkpoint through the real vLLM config machinery of this release (CPU).

``validate(with_vllm=True)`` parses the checkpoint with vLLM's ``SpeculatorsConfig`` and builds
a real ``SpeculativeConfig`` against a local target ``ModelConfig``, exactly as ``vllm serve
<draft>`` starts; nothing of vLLM is mocked. Every release of the matrix (0.10.2 onward) has
``transformers_utils/configs/speculators`` with ``eagle3``, so nothing here is skipped for lack
of it. (speculators' own classes are checked in ``tests/unit/test_eagle3_speculators.py``.)
"""

from __future__ import annotations

import json

import pytest
import torch
from packaging.version import Version

from vllm_compat.eagle3.export import export
from vllm_compat.eagle3.model import DraftConfig, Eagle3Draft
from vllm_compat.testing.synthetic import write_target
from vllm_compat.eagle3.training import save_final
from vllm_compat.eagle3.validate import read_checkpoint, validate

L, H, V, DV = 8, 16, 96, 32


def _export(tmp, name, target, aux_ids, **kw):
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                      target_vocab_size=V, draft_vocab_size=DV, aux_layer_ids=list(aux_ids), final_layer_id=L)
    draft = Eagle3Draft(cfg)
    ids = torch.arange(0, 2 * DV, 2)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(DV), t2d)
    save_final(tmp / name / "final", draft)
    return export(tmp / name, target, tmp / f"{name}-ckpt", speculative_tokens=4, **kw)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_target(tmp_path_factory.mktemp("eagle3-target") / "target", num_hidden_layers=L,
                        hidden_size=H, vocab_size=V)


def test_default_layers_serve_cleanly(tmp_path, target, vllm_version):
    ckpt = _export(tmp_path, "default", target, (2, L // 2, L - 3))
    report = validate(ckpt, target)
    s = report.serving
    assert report.ok, report.problems
    assert s.vllm_version.startswith(str(vllm_version)[:4])
    assert s.num_speculative_tokens == 4
    assert s.architectures == ["Eagle3LlamaForCausalLM"] and s.supported_architectures
    assert s.draft_vocab_size == DV and s.norm_before_residual is True
    assert s.fc_input_size == 3 * H == read_checkpoint(ckpt).shapes["fc.weight"][1]


def test_custom_layers_reach_vllm_from_0_11(tmp_path, target, vllm_version):
    ckpt = _export(tmp_path, "custom", target, (1, 3, 6))
    report = validate(ckpt, target, raise_on_error=False)
    if vllm_version < Version("0.11"):
        # 0.10's update_eagle3 drops eagle_aux_hidden_state_layer_ids: the target default is used
        assert report.serving.aux_layer_ids is None
        assert [(p.code, p.message) for p in report.errors] == [(
            "aux_ignored", f"vLLM {report.serving.vllm_version} ignores eagle_aux_hidden_state_layer_ids and feeds "
            "the target's default layers [2, 4, 5]; this draft was trained on [1, 3, 6]")]
    else:
        assert report.ok, report.problems
        assert report.serving.aux_layer_ids == [1, 3, 6]


def test_four_aux_layers_do_not_fit_vllms_fc(tmp_path, target):
    """vllm#54526: the speculators path sizes fc for three aux states whatever the config lists."""
    ckpt = _export(tmp_path, "four", target, (1, 3, 5, 6))
    report = validate(ckpt, target, raise_on_error=False)
    codes = {p.code: p.message for p in report.errors}
    assert report.serving.fc_input_size == 3 * H
    assert codes["aux_count_vllm"] == (f"vLLM {report.serving.vllm_version} builds fc with 48 inputs but fc.weight "
                                       "takes 64 (it sizes fc for a different number of aux layers)")


@pytest.mark.parametrize("breakage", ["verifier", "speculative_tokens", "transformer_layer_config"])
def test_our_structure_rules_match_vllms_parser(tmp_path, target, breakage):
    from vllm_compat.runtime import speculative

    cfg = json.loads((_export(tmp_path, "s", target, (2, 4, 5)) / "config.json").read_text())
    if breakage == "verifier":
        del cfg["speculators_config"]["verifier"]
    elif breakage == "speculative_tokens":
        del cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    else:
        del cfg["transformer_layer_config"]
    with pytest.raises(ValueError):
        speculative.speculative_config_dict(cfg)  # vLLM's own validation refuses it ...
    from vllm_compat.eagle3.validate import structure_problems

    assert structure_problems(cfg)  # ... and so do our rules

