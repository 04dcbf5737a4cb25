"""Tiny randomly initialised targets for pipeline runs (the same shapes as ``tests/gpu/_models.py``).

``deepseek_v3``: DeepSeek-V3 MLA + MoE shaped like Kimi-K2.5's backbone, scaled down (4 layers,
hidden 256, ``kv_lora_rank=512``, ``q_lora_rank=192``, 8 routed experts top-2 plus 1 shared,
``noaux_tc`` / sigmoid routing with a non-trivial ``e_score_correction_bias``). ``llama``: 4
layers, hidden 128. Saved in bf16 with ``save_pretrained``; a tokenizer directory, when
given, is copied in so ``prepare`` and vLLM find it next to the weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .tokenizer_train import copy_tokenizer

KINDS = ("llama", "deepseek_v3")


def build_tiny(
    kind: str,
    path: str | os.PathLike[str],
    *,
    vocab_size: int,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int | None = None,
    max_position_embeddings: int = 2048,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    seed: int | None = None,
) -> str:
    import transformers as tf

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    torch.manual_seed({"llama": 1, "deepseek_v3": 3}[kind] if seed is None else seed)
    common: dict[str, Any] = dict(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=bos_token_id,
                                  eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if kind == "llama":
        cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, **common)
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.DeepseekV3Config(
            hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=192, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128, topk_method="noaux_tc",
            scoring_func="sigmoid", rope_scaling=None, **common)
        model = tf.DeepseekV3ForCausalLM(cfg)
        with torch.no_grad():  # a non-trivial routing bias, as in real checkpoints
            for name, t in [*model.named_buffers(), *model.named_parameters()]:
                if name.endswith("e_score_correction_bias"):
                    t.uniform_(-0.05, 0.05)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # spread the logits: a random model's are near-uniform
    model = model.to(torch.bfloat16)
    out = Path(path)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg_path = out / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved.setdefault("torch_dtype", "bfloat16")
    if kind == "deepseek_v3":  # vLLM's loader needs these explicit (see shared/gpu/README)
        saved.update(topk_method="noaux_tc", scoring_func="sigmoid")
    cfg_path.write_text(json.dumps(saved, indent=1))
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return str(out)
