"""The fused TTT attention and the once-per-batch target distribution equal the explicit
forms they replaced (fp32: loss, per-position statistics and every gradient)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_compat.eagle3 import model as M


def _explicit_attention(self, x, positions, cache):
    """The explicit form (before 2026-11-29): fp32 scores against step 0's keys,
    causal, plus one diagonal score per earlier TTT step, softmax over their concatenation."""
    b, t, _ = x.shape
    q = self.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2)
    k = self.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
    v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
    q, k = M.rotary(q, positions, self.theta), M.rotary(k, positions, self.theta)
    cache.append((k, v))
    rep = self.nh // self.nkv
    keys = [c[0].repeat_interleave(rep, dim=1) for c in cache]
    vals = [c[1].repeat_interleave(rep, dim=1) for c in cache]
    scale = 1.0 / math.sqrt(self.d)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    s0 = (q @ keys[0].transpose(-1, -2) * scale).float().masked_fill(~causal, float("-inf"))
    diag = [((q * kj).sum(-1, keepdim=True) * scale).float() for kj in keys[1:]]
    p = torch.cat([s0, *diag], dim=-1).softmax(-1).to(q.dtype)
    out = p[..., :t] @ vals[0]
    for j, vj in enumerate(vals[1:]):
        out = out + p[..., t + j: t + j + 1] * vj
    return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.d))


def _explicit_ttt(draft, target, batch, steps, decay):
    """The loss as computed before: the target's softmax and argmax redone at every step."""
    ids, hs = batch["input_ids"], batch["hidden_states"]
    b, t = ids.shape
    n = t - 1
    aux = hs[:, :, :-1, :].flatten(2)
    with torch.no_grad():
        tgt = target(hs[:, :, -1, :]).float()
        tgt = torch.cat([tgt, tgt.new_zeros(b, steps + 1, tgt.shape[-1])], dim=1)
    masks = M.ttt_masks(batch["loss_mask"], batch["valid"], steps)
    vocab = torch.arange(draft.config.draft_vocab_size) + draft.d2t
    hidden, tokens = draft.fc(aux[:, :n]), ids[:, 1:]
    positions = torch.arange(n).expand(b, n)
    cache, total, stats, chain = [], torch.zeros(()), [], None
    for k in range(steps):
        logits, hidden = draft.step(tokens, hidden, positions + k, cache)
        logp = logits.float().log_softmax(-1)
        tk = tgt[:, 1 + k: 1 + k + n]
        p = tk[..., vocab].softmax(-1)
        m = masks[k].float()
        loss_k = (-(p * logp).sum(-1) * m).sum() / m.sum().clamp_min(1.0)
        total = total + decay ** k * loss_k
        am = logits.argmax(-1)
        right = vocab[am] == tk.argmax(-1)
        chain = right if chain is None else chain & right
        stats.append((loss_k.item(), (right.float() * m).sum().item(), m.sum().item(), (chain.float() * m).sum().item()))
        tokens = vocab[am]
    return total, stats


def _setup(reduced: bool, seed: int = 0):
    torch.manual_seed(seed)
    H, V = 32, 64
    dv = 24 if reduced else V
    cfg = M.DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                        target_vocab_size=V, draft_vocab_size=dv, aux_layer_ids=[1, 2, 3], final_layer_id=4)
    draft = M.Eagle3Draft(cfg)
    if reduced:  # every other id from 3 on: a non-zero d2t
        ids = torch.arange(3, 3 + 2 * dv, 2)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        draft.set_vocab(ids - torch.arange(dv), t2d)
    target = M.TargetHead(torch.rand(H) + 0.5, torch.randn(V, H), 1e-6)
    lens = [17, 9, 13]
    b, t = len(lens), max(lens)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, n in enumerate(lens):
        valid[i, :n] = True
    loss_mask = valid.clone()
    loss_mask[0, :4] = False  # a prompt part that is not trained on
    batch = {"input_ids": torch.randint(0, V, (b, t)), "loss_mask": loss_mask, "valid": valid,
             "hidden_states": torch.randn(b, t, 4, H)}
    return draft, target, batch


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_fused_ttt_equals_the_explicit_form(reduced, monkeypatch):
    steps, decay = 4, 0.8
    draft, target, batch = _setup(reduced)
    new = M.ttt_forward(draft, target, batch, steps, decay)
    new.loss.backward()
    g_new = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
    draft.zero_grad(set_to_none=True)
    monkeypatch.setattr(M.Attention, "forward", _explicit_attention)
    ref_loss, ref_stats = _explicit_ttt(draft, target, batch, steps, decay)
    ref_loss.backward()
    g_ref = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
    assert torch.allclose(new.loss, ref_loss, rtol=1e-5, atol=1e-6), (new.loss, ref_loss)
    for k, (loss_k, correct, counted, chained) in enumerate(ref_stats):
        assert new.step_loss[k].item() == pytest.approx(loss_k, rel=1e-5)
        assert (new.correct[k].item(), new.counted[k].item(), new.chained[k].item()) == (correct, counted, chained)
    assert g_new.keys() == g_ref.keys() and len(g_new) >= 10
    for k in g_ref:
        assert torch.allclose(g_new[k], g_ref[k], rtol=1e-4, atol=1e-6), k


def test_mask_sees_context_causally_and_only_its_own_speculated_tokens():
    m = M.ttt_attention_mask(3, 3, torch.device("cpu")).int().tolist()
    assert m == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0, 0, 1, 0],
                 [1, 1, 1, 0, 0, 1, 0, 0, 1]]
