"""Tiny random checkpoints (built with transformers, saved locally) and HF references."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

VOCAB = 1024
MAX_LEN = 1024
# 12 prompts of distinct lengths (one of 1 token, several far above the chunk size 32).
LENGTHS = [37, 300, 5, 129, 1, 64, 211, 18, 97, 250, 2, 161]


def engine_kwargs() -> dict[str, Any]:
    """``VLLM_COMPAT_GPU_TEST_KV_BYTES=N``: every test engine gets a fixed N-byte KV cache, so
    vLLM skips its memory profiling. Needed when the tests share the GPU with another job:
    the profiler counts other processes' allocations as its own and asserts when they free
    memory mid-profile ("Error in memory profiling ... other processes ...")."""
    n = os.environ.get("VLLM_COMPAT_GPU_TEST_KV_BYTES")
    return {"kv_cache_memory_bytes": int(n)} if n else {}


# Ids tokenizers keep for themselves: pad/bos/eos (0-2 in these checkpoints) and the top of
# the vocabulary, where added and reserved tokens live (Llama-3 from 128000, Kimi from 163584).
SPECIAL_IDS = (0, 1, 2, *range(VOCAB - 8, VOCAB))


def prompts(seed: int = 0, *, vocab: int = VOCAB,
            special_ids: tuple[int, ...] = SPECIAL_IDS) -> list[list[int]]:
    """``LENGTHS`` prompts shaped like chat data: a special id opens each one and recurs every
    16 tokens, ordinary ids (3 .. ``vocab``) between them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ordinary = torch.randint(3, vocab, (n,), generator=g)
        special = torch.tensor(special_ids)[torch.randint(0, len(special_ids), (n,), generator=g)]
        out.append(torch.where(torch.arange(n) % 16 == 0, special, ordinary).tolist())
    return out


def build(kind: str, path: str) -> str:
    """Save a tiny random ``kind`` (llama | qwen3 | deepseek_v3) checkpoint in bf16, with
    logits spread so prompt logprobs are sensitive to the final state."""
    from vllm_compat.testing.models import build_model
    return build_model(kind, path, vocab_size=VOCAB, max_position_embeddings=MAX_LEN,
                       seed={"llama": 1, "qwen3": 2, "deepseek_v3": 3}[kind], logit_scale=10.0)


class HFReference:
    """HF transformers states in our convention: [seq, L+1, hidden] fp32 (k=L pre-norm)."""

    def __init__(self, path: str | None, dtype: torch.dtype = torch.float32, *,
                 model: Any = None) -> None:
        if model is None:
            import transformers as tf
            model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        self.model = model.cuda().eval()
        self.L = self.model.config.num_hidden_layers

    @classmethod
    def from_model(cls, model: Any) -> "HFReference":
        """A reference over a transformers model built elsewhere (e.g. Kimi-K2.5's text model)."""
        return cls(None, model=model)

    @torch.no_grad()
    def states(self, ids: list[int]) -> torch.Tensor:
        layers = self.model.model.layers
        cap: dict[str, torch.Tensor] = {}
        h = layers[-1].register_forward_hook(
            lambda m, a, o: cap.__setitem__("last", o[0] if isinstance(o, tuple) else o))
        try:
            out = self.model(torch.tensor([ids], device="cuda"), output_hidden_states=True)
        finally:
            h.remove()
        hs = out.hidden_states  # HF: [L] is AFTER the final norm -> replaced by the hook
        assert len(hs) == self.L + 1
        per = [hs[i][0] for i in range(self.L)] + [cap["last"][0]]
        post = hs[self.L][0]
        # The note in layers.py: HF's last entry is the normed state, not the pre-norm one.
        assert not torch.allclose(post, per[-1]), "HF hidden_states[L] is expected post-norm"
        return torch.stack(per, dim=1).float().cpu()

    @torch.no_grad()
    def logprobs_from_final(self, final: torch.Tensor) -> torch.Tensor:
        """log_softmax(lm_head(norm(final))) in fp32, [seq, vocab]."""
        m = self.model
        x = final.to("cuda", torch.float32)
        w = m.model.norm.weight.float()
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + m.config.rms_norm_eps) * w
        return torch.log_softmax(x @ m.lm_head.weight.float().T, dim=-1).cpu()

    def close(self) -> None:
        del self.model
        torch.cuda.empty_cache()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    g, r = got.float(), ref.float()
    tok_rel = (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)
    return {"rel": rel_err(g, r), "max_abs": float((g - r).abs().max()),
            "ref_max_abs": float(r.abs().max()), "worst_token_rel": float(tok_rel.max()),
            "frac_tokens_rel_gt_5pct": float((tok_rel > 0.05).float().mean())}


def record(test: str, **fields: Any) -> None:
    path = os.environ.get("VLLM_COMPAT_GPU_RESULTS")
    if not path:
        return
    import vllm
    fields = dict(test=test, vllm=vllm.__version__, time=time.strftime("%H:%M:%S"), **fields)
    with open(path, "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")
