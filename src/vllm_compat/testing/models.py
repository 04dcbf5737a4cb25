"""Random-weight checkpoints of named shapes, built locally (nothing is downloaded).

One builder for every test, example and benchmark::

    from vllm_compat.testing.models import build_model
    build_model("llama", "/tmp/tiny-llama")                  # 4 layers, hidden 128, bf16
    build_model("llama-8b", "/tmp/llama-8b", device="cuda")  # Llama-3.1-8B's shapes

Shapes (:data:`SHAPES`): ``llama``, ``qwen3`` and ``deepseek_v3`` (MLA + MoE shaped like
Kimi-K2.5's backbone, scaled down) for correctness tests; ``llama-tiny`` for CPU tests;
``llama-1b``, ``llama-8b`` and ``deepseek-tiny`` for benchmarks. Any config field can be
overridden by keyword. For the faithful Kimi-K2.5 wrapper (tokenizer, image processor, INT4
experts) see :mod:`vllm_compat.testing.kimi_k25`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..scheduling import write_tiny_llama_config

__all__ = ["SHAPES", "build_model", "copy_tokenizer", "model_config", "write_tiny_llama_config"]

_COMMON: dict[str, Any] = dict(max_position_embeddings=2048, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                               initializer_range=0.02)
_DEEPSEEK_V3: dict[str, Any] = dict(
    kind="deepseek_v3", vocab_size=1024, hidden_size=256, intermediate_size=512,
    moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=192, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid",
    rope_scaling=None)

SHAPES: dict[str, dict[str, Any]] = {
    "llama": dict(kind="llama", vocab_size=1024, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(kind="qwen3", vocab_size=1024, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "deepseek_v3": _DEEPSEEK_V3,
    "llama-tiny": dict(kind="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2),
    "llama-1b": dict(kind="llama", vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=4096, rms_norm_eps=1e-5),
    # meta-llama/Llama-3.1-8B's dimensions (its llama3 rope scaling changes no cost).
    "llama-8b": dict(kind="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     rope_theta=500000.0, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "deepseek-tiny": dict(_DEEPSEEK_V3, max_position_embeddings=4096, rms_norm_eps=1e-5),
}

_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


def model_config(shape: str, **overrides: Any) -> Any:
    """The transformers config of ``shape`` (a :data:`SHAPES` key) with ``overrides`` applied."""
    import transformers as tf

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    spec = {**_COMMON, **SHAPES[shape], **overrides}
    cfg_cls, _ = _CLASSES[spec.pop("kind")]
    return getattr(tf, cfg_cls)(**spec)


def build_model(shape: str, directory: str | os.PathLike[str], *, seed: int = 0,
                device: str = "cpu", dtype: Any = None, logit_scale: float | None = None,
                tokenizer_dir: str | os.PathLike[str] | None = None, **overrides: Any) -> str:
    """Save a random checkpoint of ``shape`` in ``directory`` (safetensors); returns the path.

    Weights are initialised on ``device`` directly in ``dtype`` (default bf16) with
    transformers' own init. ``logit_scale`` multiplies ``lm_head`` (a random model's logits
    are near-uniform; spreading them makes prompt logprobs sensitive to the final state).
    MoE routing gets a non-trivial ``e_score_correction_bias``, as real checkpoints have.
    ``tokenizer_dir``: tokenizer files copied next to the weights.
    """
    import torch
    import transformers as tf

    dtype = torch.bfloat16 if dtype is None else dtype
    cfg = model_config(shape, **overrides)
    kind = {**SHAPES[shape], **overrides}["kind"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(tf, _CLASSES[kind][1])._from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.uniform_(-0.05, 0.05)
        if logit_scale is not None:
            model.lm_head.weight.mul_(logit_scale)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    cfg_path = out / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    if kind == "deepseek_v3":
        # vLLM's DeepSeek loader decides which routing weights to expect from these two
        # fields; transformers leaves them out of config.json when they equal its defaults.
        saved.update(topk_method="noaux_tc", scoring_func="sigmoid")
    cfg_path.write_text(json.dumps(saved, indent=1))
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return str(out)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy a saved tokenizer's files into a checkpoint directory."""
    Path(dst).mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        p = Path(src) / name
        if p.exists():
            shutil.copy2(p, Path(dst) / name)
