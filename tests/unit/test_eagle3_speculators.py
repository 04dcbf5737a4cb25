"""Where speculators is installed (the ``speculators`` extra): its own classes load our export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("speculators", reason="speculators is not installed (optional extra)")

from vllm_compat.eagle3.export import export
from vllm_compat.eagle3.model import DraftConfig, Eagle3Draft
from vllm_compat.testing.synthetic import write_target
from vllm_compat.eagle3.training import save_final


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    target = write_target(d / "target")
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                    intermediate_size=32, target_vocab_size=96, draft_vocab_size=32,
                                    aux_layer_ids=[2, 4, 5], final_layer_id=8))
    for p in draft.parameters():  # away from the ones/zeros defaults, so every weight matters
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    draft.embed_tokens.weight.data.copy_(load_file(str(d / "target" / "model.safetensors"))["model.embed_tokens.weight"])
    ids = torch.arange(0, 64, 2)
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(32), t2d)
    save_final(d / "run" / "final", draft)
    return export(d / "run", target, d / "ckpt", speculative_tokens=3, dtype="float32"), draft


def test_config_parses_with_speculators_classes(ckpt):
    ckpt, _ = ckpt
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    cfg = SpeculatorModelConfig.from_pretrained(str(ckpt))
    assert isinstance(cfg, Eagle3SpeculatorConfig)
    assert cfg.eagle_aux_hidden_state_layer_ids == [2, 4, 5] and cfg.draft_vocab_size == 32
    assert cfg.norm_before_residual is True and cfg.transformer_layer_config.vocab_size == 96
    assert cfg.speculators_config.proposal_methods[0].speculative_tokens == 3
    assert json.loads((ckpt / "config.json").read_text())["speculators_model_type"] == "eagle3"


def test_every_exported_tensor_loads_into_speculators_model(ckpt):
    from speculators.models.eagle3.core import Eagle3DraftModel

    ckpt, _ = ckpt
    model = Eagle3DraftModel.from_pretrained(str(ckpt))
    ours = load_file(str(ckpt / "model.safetensors"))
    theirs = model.state_dict()
    assert set(ours) <= set(theirs)
    assert set(theirs) - set(ours) == {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    for k, v in ours.items():
        assert theirs[k].shape == v.shape and torch.equal(theirs[k].to(v.dtype), v), k


def test_first_step_logits_equal_speculators_forward(ckpt):
    """Same weights, same inputs: speculators' draft forward and ours give the same logits
    (decoder-layer math, norms, residual placement, rotary, fc)."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    ckpt, draft = ckpt
    model = Eagle3DraftModel.from_pretrained(str(ckpt)).eval()
    # the embedding is the verifier's (not in the checkpoint); speculators 0.9 does not always
    # fill it from a local verifier directory, so give both models the same one
    model.embed_tokens.weight.data.copy_(draft.embed_tokens.weight)
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    g = torch.Generator().manual_seed(3)
    t = 9
    tokens, aux = torch.randint(0, 96, (1, t), generator=g), torch.randn(1, t, 48, generator=g)
    with torch.no_grad():
        model(hidden_states=aux, input_ids=tokens, document_ids=torch.zeros(1, t, dtype=torch.long),
              position_ids=torch.arange(t)[None], ttt_steps=1)
        ours, _ = draft.step(tokens, draft.fc(aux), torch.arange(t)[None], [])
        perturbed, _ = draft.step(tokens, draft.fc(aux + 0.05 * torch.randn_like(aux)), torch.arange(t)[None], [])
    assert torch.allclose(captured[0], ours, atol=1e-5)
    assert not torch.allclose(captured[0], perturbed, atol=1e-3)  # the comparison can fail
