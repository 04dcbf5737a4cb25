"""The draft: forward/backward, and what training-time test may and may not attend to."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_compat.eagle3.model import (
    DraftConfig,
    Eagle3Draft,
    RMSNorm,
    TargetHead,
    rotary,
    ttt_forward,
    ttt_masks,
)

H, V, DV = 16, 40, 24


def _models(seed=0, norm_before_residual=True):
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                      target_vocab_size=V, draft_vocab_size=DV, aux_layer_ids=[1, 2, 3], final_layer_id=5,
                      norm_before_residual=norm_before_residual)
    draft = Eagle3Draft(cfg)
    ids = torch.randperm(V)[:DV].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(DV), t2d)
    target = TargetHead(torch.ones(H), torch.randn(V, H), 1e-5)
    return draft, target


def _batch(b=2, t=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(b, t, dtype=torch.bool)
    if b > 1:
        valid[1, t - 3:] = False  # second sample is shorter (right padding)
    return {"input_ids": torch.randint(0, V, (b, t), generator=g), "loss_mask": torch.ones(b, t, dtype=torch.bool),
            "valid": valid, "hidden_states": torch.randn(b, t, 4, H, generator=g)}


def test_state_dict_names_are_vllm_checkpoint_names():
    draft, _ = _models()
    assert set(draft.exported_state_dict()) == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        *(f"layers.0.{n}" for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                    "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                                    "post_attention_layernorm.weight")),
    }
    assert draft.fc.weight.shape == (H, 3 * H) and draft.layers[0].self_attn.q_proj.weight.shape == (H, 2 * H)


def test_forward_backward_reaches_trainable_weights_only():
    draft, target = _models()
    out = ttt_forward(draft, target, _batch(), steps=3, decay=0.8)
    assert len(out.step_loss) == 3 and math.isfinite(out.loss.item())
    expected = sum(0.8 ** k * loss.item() for k, loss in enumerate(out.step_loss))
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    out.loss.backward()
    assert draft.embed_tokens.weight.grad is None
    assert all(p.grad is None for p in target.parameters())
    for name in ("fc.weight", "lm_head.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"):
        assert draft.get_parameter(name).grad.abs().sum() > 0, name


def test_ttt_masks_shift_by_one_per_step():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # last token is padding
    m = ttt_masks(loss_mask, valid, 3)
    # step k at draft position t predicts token t + 2 + k
    assert m[0].int().tolist() == [[1, 1, 1, 1, 0, 0, 0]]
    assert m[1].int().tolist() == [[1, 1, 1, 0, 0, 0, 0]]
    assert m[2].int().tolist() == [[1, 1, 0, 0, 0, 0, 0]]


def test_padding_and_masked_positions_do_not_change_the_loss():
    draft, target = _models()
    batch = _batch()
    a = ttt_forward(draft, target, batch, steps=2)
    noisy = {k: v.clone() for k, v in batch.items()}
    noisy["hidden_states"][1, -3:] = 1e3  # padding
    noisy["input_ids"][1, -3:] = 0
    b = ttt_forward(draft, target, noisy, steps=2)
    assert torch.allclose(a.loss, b.loss) and all(torch.equal(x, y) for x, y in zip(a.counted, b.counted, strict=True))


def _logits_per_step(draft, batch, steps):
    """Per-step logits via the same path ttt_forward takes (kept here to probe dependencies)."""
    ids, hs = batch["input_ids"], batch["hidden_states"]
    b, t = ids.shape
    n = t - 1
    hidden = draft.fc(hs[:, :n, :-1].flatten(2))
    tokens, cache, out = ids[:, 1:], [], []
    pos = torch.arange(n).expand(b, n)
    for k in range(steps):
        logits, hidden = draft.step(tokens, hidden, pos + k, cache)
        out.append(logits)
        tokens = draft.draft_to_target(logits.argmax(-1))
    return out


def test_ttt_is_causal_at_every_step():
    draft, _ = _models()
    batch = _batch(b=1, t=10)
    base = _logits_per_step(draft, batch, 3)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["hidden_states"][0, 6:] += 5.0
    changed["input_ids"][0, 7:] = (changed["input_ids"][0, 7:] + 1) % V
    after = _logits_per_step(draft, changed, 3)
    for k in range(3):  # draft positions 0..5 see only tokens <= t + 1 and states <= t
        assert torch.allclose(base[k][0, :6], after[k][0, :6], atol=1e-6), k
        assert not torch.allclose(base[k][0, 6:], after[k][0, 6:])


def test_later_steps_attend_to_their_own_chain_not_to_neighbours():
    """Step k at position t sees step 0's keys for positions <= t and its own steps 1..k-1:
    equal to drafting that one position alone at inference time."""
    draft, _ = _models()
    batch = _batch(b=1, t=10)
    full = _logits_per_step(draft, batch, 3)
    t = 4  # draft only positions 0..t (inference-time: the prefix), then speculate at t
    prefix = {k: v[:, : t + 2] for k, v in batch.items()}
    alone = _logits_per_step(draft, prefix, 3)
    for k in range(3):
        assert torch.allclose(full[k][0, t], alone[k][0, t], atol=1e-5), k


def test_norm_before_residual_changes_the_residual_path():
    a, target = _models(norm_before_residual=True)
    b, _ = _models(norm_before_residual=False)
    b.load_state_dict(a.state_dict())
    batch = _batch()
    for p in (a.layers[0].hidden_norm.weight, b.layers[0].hidden_norm.weight):
        p.data.fill_(0.5)
    assert not torch.allclose(ttt_forward(a, target, batch, 1).loss, ttt_forward(b, target, batch, 1).loss)


def test_rmsnorm_and_rotary_match_their_definitions():
    x = torch.randn(3, 8)
    n = RMSNorm(8, 1e-6)
    n.weight.data = torch.linspace(0.5, 2, 8)
    assert torch.allclose(n(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * n.weight, atol=1e-6)
    normed, res = n(x, torch.ones(3, 8))
    assert torch.allclose(res, x + 1)
    q = torch.randn(1, 2, 5, 8)
    pos = torch.arange(5)[None]
    r = rotary(q, pos, 10000.0)
    assert torch.allclose(r.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # a rotation
    assert torch.allclose(r[..., 0, :], q[..., 0, :])  # position 0 is the identity
    # relative: <R(p)q, R(p)k> depends only on positions' difference
    k = torch.randn(1, 2, 1, 8).expand(1, 2, 5, 8)
    rq = rotary(q[..., :1, :].expand(1, 2, 5, 8), pos, 10000.0)
    rk = rotary(k, pos, 10000.0)
    assert torch.allclose((rq * rk).sum(-1), (q[..., :1, :] * k[..., :1, :]).sum(-1).expand(1, 2, 5), atol=1e-4)


@pytest.mark.parametrize("rows", [7, 40, 32768])
def test_target_labels_equal_the_whole_vocabulary_softmax_and_argmax(monkeypatch, rows):
    """The target's labels computed in pieces of its lm_head, at the valid positions only, are
    the dense computation's: softmax over the draft vocabulary of the whole logits, argmax of
    the whole logits (ties included: the lower id, as argmax gives)."""
    from vllm_compat.eagle3 import model as Mod

    monkeypatch.setattr(Mod, "TARGET_ROWS_PER_MATMUL", rows)
    draft, target = _models()
    target.lm_head.weight.data[17] = target.lm_head.weight.data[3]  # ids 3 and 17 tie everywhere
    target.lm_head.weight.data[3] *= 50  # ...and lead, so the tie decides the argmax
    target.lm_head.weight.data[17] = target.lm_head.weight.data[3]
    batch = _batch(b=3, t=11)
    batch["valid"][2, 4:] = False
    last = batch["hidden_states"][:, :, -1, :]
    vocab = torch.arange(DV) + draft.d2t
    probs, best = Mod.target_labels(target, last, batch["valid"], vocab, draft.d2t, pad=3)
    dense = target(last)  # [B, T, V]
    want_p = dense[..., vocab].softmax(-1)
    want_b = dense.argmax(-1)
    v = batch["valid"]
    assert probs.shape == (3, 14, DV) and best.shape == (3, 14)
    assert torch.allclose(probs[:, :11][v], want_p[v], atol=1e-6)
    assert torch.equal(best[:, :11][v], want_b[v])
    assert int((best[:, :11][v] == 3).sum()) > 0 and not bool((best == 17).any())
    assert not probs[:, :11][~v].any() and not probs[:, 11:].any() and not best[:, 11:].any()
