"""The EAGLE-3 draft as vLLM's ``Eagle3LlamaForCausalLM`` computes it, in plain PyTorch.

Parameter names are the checkpoint names vLLM's loader expects (``fc``, ``layers.0.*``,
``norm``, ``lm_head``, ``d2t``, ``t2d``), so export is a filtered ``state_dict``.
``embed_tokens`` is the target's embedding, frozen and not exported (vLLM shares the
target's when the checkpoint has none).

Forward of one draft step (``llama_eagle3.LlamaDecoderLayer`` / ``LlamaModel``)::

    e = input_layernorm(embed(token));  h = hidden_norm(h)   (residual = h or the pre-norm h)
    x = self_attn(cat[e, h])  (q/k/v take 2H inputs);  x, res = post_attention_layernorm(x + residual)
    x = mlp(x);  prenorm = x + res;  out = norm(prenorm);  logits = lm_head(out)

``prenorm`` is the hidden state fed to the next speculative step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    final_layer_id: int = 0  # the target's num_hidden_layers (L)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    norm_before_residual: bool = True

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm (``forward_native``): fp32 statistics, optional fused residual add."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        dtype = x.dtype
        x = x.float()
        if residual is not None:
            x = x + residual.float()
            residual = x.to(dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x.to(dtype) * self.weight.to(dtype)
        return x if residual is None else (x, residual)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (vLLM's default for Llama) on ``[B, heads, T, d]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.to(torch.float32)[..., None] * inv  # [B, T, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    nh: int  # query heads
    nkv: int  # key/value heads
    d: int  # head dim
    theta: float  # rope base

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        assert d is not None  # DraftConfig.__post_init__ sets it
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(2 * h, self.nh * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]):
        """Attend as training-time test does: causally to step 0's keys, and to this
        position's own keys of steps 1..k (the draft tokens speculated so far)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        q, k = rotary(q, positions, self.theta), rotary(k, positions, self.theta)
        cache.append((k, v))
        rep = self.nh // self.nkv
        # One fused attention over [step 0's keys | steps 1..k's keys], masked to causal on the
        # first block and to the diagonal on the others. It equals softmax over the
        # concatenated scores, without the fp32 [B, heads, T, T] score matrices the explicit
        # form kept for every TTT step (H200, batch 32: 113 ms per training step).
        keys = torch.cat([c[0] for c in cache], dim=2).repeat_interleave(rep, dim=1)
        vals = torch.cat([c[1] for c in cache], dim=2).repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=ttt_attention_mask(t, len(cache), x.device))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.d))


def ttt_attention_mask(t: int, blocks: int, device: torch.device) -> torch.Tensor:
    """``[t, blocks * t]`` bool: query ``i`` sees keys ``0..i`` of block 0 (the verified
    context) and key ``i`` of blocks ``1..blocks-1`` (its own speculated tokens)."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal, *([eye] * (blocks - 1))], dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, positions, cache):
        embeds = self.input_layernorm(embeds)
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        x = self.self_attn(torch.cat([embeds, hidden], dim=-1), positions, cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Draft(nn.Module):
    d2t: torch.Tensor  # buffers (draft id -> target id offset, target ids kept)
    t2d: torch.Tensor

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.target_vocab_size, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def step(self, token_ids, hidden, positions, cache):
        """One speculative step: ``(logits [B,T,draft_vocab], prenorm hidden [B,T,H])``."""
        x, residual = self.layers[0](self.embed_tokens(token_ids), hidden, positions, cache)
        out, prenorm = self.norm(x, residual)
        return self.lm_head(out), prenorm

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors a speculators checkpoint carries (the frozen embedding is shared at serve time)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}


class TargetHead(nn.Module):
    """The target's final norm + lm_head (frozen): soft labels from its last hidden state."""

    def __init__(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(norm_weight.shape[0], eps)
        self.norm.weight.data.copy_(norm_weight)
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        self.lm_head.weight.data.copy_(lm_head_weight)
        self.requires_grad_(False)

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(last_hidden))


TARGET_ROWS_PER_MATMUL = 32768  # rows of the target's lm_head per product: bounds the logits held


def target_labels(target: TargetHead, last_hidden: torch.Tensor, valid: torch.Tensor, vocab: torch.Tensor,
                  d2t: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocabulary ``[B, T + pad, Vd]`` (float32) and
    its argmax over its whole vocabulary ``[B, T + pad]``, computed at the ``valid`` positions
    only; the rest are 0. The whole-vocabulary logits are never held at once: with Kimi-K2.5's
    163,840 ids they took 43 GB in float32 for a batch of 32 x 2,048 positions, padding included."""
    b, t = valid.shape
    w = target.lm_head.weight
    h = target.norm(last_hidden[valid].to(w.dtype))  # [N, H]
    full = vocab.numel() == w.shape[0] and not bool(d2t.any())
    draft_probs = F.linear(h, w if full else w[vocab]).float().softmax(-1)
    best_val = torch.full((h.shape[0],), float("-inf"), device=h.device)
    best_idx = torch.zeros(h.shape[0], dtype=torch.int64, device=h.device)
    for start in range(0, w.shape[0], TARGET_ROWS_PER_MATMUL):
        val, idx = F.linear(h, w[start:start + TARGET_ROWS_PER_MATMUL]).float().max(-1)
        better = val > best_val  # strict: ties keep the lower id, as argmax does
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, idx + start, best_idx)
    probs = draft_probs.new_zeros(b, t + pad, draft_probs.shape[-1])
    probs[:, :t][valid] = draft_probs
    best = best_idx.new_zeros(b, t + pad)
    best[:, :t][valid] = best_idx
    return probs, best


@dataclass
class TTTOutput:
    loss: torch.Tensor  # sum over steps of decay**k * mean loss of step k
    step_loss: list[torch.Tensor]  # per TTT position, detached
    correct: list[torch.Tensor]  # per position: draft argmax == target argmax, summed over the mask
    counted: list[torch.Tensor]  # per position: number of positions in the mask
    # per position k: positions where steps 0..k were all right (summed over step k's mask).
    # chained[k] / counted[k] is what vLLM reports as per-position acceptance (the chain
    # stops at the first wrong draft token); correct[k] / counted[k] is not conditional.
    chained: list[torch.Tensor] = field(default_factory=list)


def ttt_masks(loss_mask: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Mask of step ``k`` at draft position ``t``: the token it predicts, ``t + 2 + k``, exists
    (inside the sample) and is trained on (``loss_mask``)."""
    b, t = loss_mask.shape
    keep = loss_mask.bool() & valid.bool()
    pad = torch.zeros(b, steps + 2, dtype=torch.bool, device=keep.device)
    keep = torch.cat([keep, pad], dim=1)
    return [keep[:, 2 + k : 2 + k + t - 1] for k in range(steps)]


def ttt_forward(
    draft: Eagle3Draft,
    target: TargetHead,
    batch: dict[str, torch.Tensor],
    steps: int = 3,
    decay: float = 1.0,
) -> TTTOutput:
    """Training-time test unrolled ``steps`` times over a padded batch.

    ``batch``: ``input_ids [B,T]``, ``loss_mask [B,T]``, ``valid [B,T]`` (False on padding),
    ``hidden_states [B,T,n_aux+1,H]``. Draft position ``t`` pairs token ``x[t+1]`` with the
    fused aux state of ``t`` (vLLM shifts the draft's input ids by one the same way); step ``k``
    is scored against the target distribution at ``t+1+k`` (predicting ``x[t+2+k]``), the
    next step's input token is this step's argmax mapped to a target id, its hidden state this
    step's pre-norm output, its position ``+1``.
    """
    ids, hs = batch["input_ids"], batch["hidden_states"]
    b, t = ids.shape
    n = t - 1
    aux = hs[:, :, :-1, :].flatten(2)  # [B,T,n_aux*H]
    vocab = torch.arange(draft.config.draft_vocab_size, device=ids.device) + draft.d2t
    with torch.no_grad():
        # the target's distribution over the draft vocabulary and its argmax, once per batch
        # (every TTT step reads a shifted view); padding and positions past the end stay 0
        # (masked out)
        probs, best = target_labels(target, hs[:, :, -1, :], batch["valid"].bool(), vocab,
                                    draft.d2t, steps + 1)
    masks = ttt_masks(batch["loss_mask"], batch["valid"], steps)
    hidden = draft.fc(aux[:, :n].to(draft.fc.weight.dtype))
    tokens = ids[:, 1:]
    positions = torch.arange(n, device=ids.device).expand(b, n)
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = torch.zeros((), device=ids.device)
    out = TTTOutput(total, [], [], [])
    chain = None
    for k in range(steps):
        logits, hidden = draft.step(tokens, hidden, positions + k, cache)
        logp = logits.float().log_softmax(-1)
        p = probs[:, 1 + k : 1 + k + n]  # target distribution restricted to the draft vocab
        m = masks[k].float()
        denom = m.sum().clamp_min(1.0)
        loss_k = (-(p * logp).sum(-1) * m).sum() / denom
        total = total + (decay ** k) * loss_k
        draft_argmax = logits.argmax(-1)
        right = (vocab[draft_argmax] == best[:, 1 + k : 1 + k + n]).detach()
        chain = right if chain is None else chain & right
        out.step_loss.append(loss_k.detach())
        out.correct.append((right.float() * m).sum().detach())
        out.counted.append(m.sum().detach())
        out.chained.append((chain.float() * m).sum().detach())
        tokens = vocab[draft_argmax].detach()
    out.loss = total
    return out
