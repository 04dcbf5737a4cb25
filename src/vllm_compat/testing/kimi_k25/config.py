"""``config.json`` of a Kimi-K2.5 test checkpoint: the real file's keys and nesting, scaled down.

Kept from the real model: every key, the architectures and model types (``kimi_k25`` on top,
``kimi_k2`` for the DeepSeek-V3 text backbone), ``kv_lora_rank`` 512 and
``qk_rope_head_dim`` 64 (an MLA cache entry of 576 per token), the routing (``noaux_tc``,
sigmoid, scaling 2.827), YaRN factor 64 on 4096 positions, the 163840-id vocabulary and the
compressed-tensors INT4 expert quantization. Scaled: layer counts and widths (:class:`KimiK25Shape`).

The real vision config spells the tower sizes ``vt_*``; vLLM reads the plain names
(``hidden_size`` ...) and falls back to the full 27-layer tower without them, so both are
written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .tokenizer import SPECIAL_TOKENS, VOCAB_SIZE

BOS_ID, EOS_ID, PAD_ID = SPECIAL_TOKENS["[BOS]"], SPECIAL_TOKENS["[EOS]"], SPECIAL_TOKENS["[PAD]"]
MEDIA_PAD_ID = SPECIAL_TOKENS["<|media_pad|>"]
IM_END_ID = SPECIAL_TOKENS["<|im_end|>"]
INT4_GROUP_SIZE = 32


@dataclasses.dataclass(frozen=True)
class KimiK25Shape:
    """Sizes of the test model; the defaults fit one GPU and keep vLLM's Marlin INT4 MoE path
    (``hidden_size % 128 == 0``, ``moe_intermediate_size % 64 == 0``). 8 attention heads and
    ``moe_intermediate_size`` 256 are the real model's per-GPU slices at tensor parallel 8."""

    num_layers: int = 8  # >= 7 keeps vLLM's default EAGLE-3 aux layers (2, L//2, L-3) distinct
    hidden_size: int = 256
    intermediate_size: int = 512  # the dense layer(s) before the MoE layers
    num_attention_heads: int = 8
    q_lora_rank: int = 128
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 256
    first_k_dense_replace: int = 1
    vision_num_layers: int = 2
    vision_hidden_size: int = 144  # head dim 72, as the real 1152 / 16
    vision_num_heads: int = 2
    vision_intermediate_size: int = 288

    def __post_init__(self) -> None:
        if not 0 <= self.first_k_dense_replace < self.num_layers:
            raise ValueError("first_k_dense_replace must leave at least one MoE layer")
        if self.vision_hidden_size % self.vision_num_heads or (
                self.vision_hidden_size // self.vision_num_heads) % 4:
            raise ValueError("the vision head dim must be a multiple of 4 (2-D rotary embedding)")


def quantization_config() -> dict[str, Any]:
    """Kimi-K2.5's ``quantization_config``: INT4 routed experts, everything else unquantized."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": INT4_GROUP_SIZE, "dynamic": False, "actorder": None,
               "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "output_activations": None, "weights": weights}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    }


def text_config(shape: KimiK25Shape, *, int4: bool = False) -> dict[str, Any]:
    s = shape
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                     "AutoModel": "modeling_deepseek.DeepseekV3Model",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
        "model_type": "kimi_k2",
        "vocab_size": VOCAB_SIZE, "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size, "moe_intermediate_size": s.moe_intermediate_size,
        "num_hidden_layers": s.num_layers, "num_nextn_predict_layers": 0,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_attention_heads,
        "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
        "v_head_dim": s.v_head_dim,
        "n_routed_experts": s.n_routed_experts, "n_shared_experts": s.n_shared_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "first_k_dense_replace": s.first_k_dense_replace, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.827,
        "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
        "hidden_act": "silu", "rms_norm_eps": 1e-05,
        "max_position_embeddings": 262144, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "torch_dtype": "bfloat16",
    }
    if int4:
        cfg["quantization_config"] = quantization_config()
    return cfg


def vision_config(shape: KimiK25Shape) -> dict[str, Any]:
    s = shape
    sizes = {"hidden_size": s.vision_hidden_size, "intermediate_size": s.vision_intermediate_size,
             "num_attention_heads": s.vision_num_heads, "num_hidden_layers": s.vision_num_layers}
    return {
        "patch_size": 14,
        "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal",
        **{f"vt_{k}": v for k, v in sizes.items()},
        **sizes,
        "mm_projector_type": "patchmerger",
        # equal to the tower width, so vLLM sets it to the text width (as 1152 -> 7168)
        "mm_hidden_size": s.vision_hidden_size,
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "text_hidden_size": s.hidden_size,
    }


def kimi_k25_config(shape: KimiK25Shape | None = None, *, int4: bool = False) -> dict[str, Any]:
    """The whole ``config.json`` as a dict."""
    shape = shape or KimiK25Shape()
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "model_type": "kimi_k25",
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "ignore_index": -100,
        "media_placeholder_token_id": MEDIA_PAD_ID,
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": text_config(shape, int4=int4),
        "vision_config": vision_config(shape),
    }


def generation_config() -> dict[str, Any]:
    # <|im_end|> closes an assistant turn (the text config's eos is [EOS]).
    return {"bos_token_id": BOS_ID, "eos_token_id": IM_END_ID, "pad_token_id": PAD_ID}
