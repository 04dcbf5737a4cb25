"""Write a trained draft as a speculators-format EAGLE-3 checkpoint that ``vllm serve`` loads.

``config.json`` carries what vLLM's ``SpeculatorsConfig`` reads (``speculators_model_type``,
``speculators_config.proposal_methods[0].speculative_tokens``,
``speculators_config.verifier.name_or_path``, ``transformer_layer_config``) and what
``update_eagle3`` copies (``draft_vocab_size``, ``norm_before_residual``,
``eagle_aux_hidden_state_layer_ids``, and the norm flags, written explicitly False because
this draft has none of those norms). ``model.safetensors`` holds ``fc``, ``layers.0.*``,
``norm``, ``lm_head`` and, when the draft vocabulary is smaller than the target's,
``d2t`` and ``t2d``: the names ``Eagle3LlamaForCausalLM.load_weights`` maps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import TargetMismatchError
from .model import DraftConfig
from .target import TargetInfo, read_target
from .training import load_final

SPECULATORS_FORMAT_VERSION = "0.9.0"  # the speculators config layout this follows
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def transformer_layer_config(cfg: DraftConfig, target_config: dict[str, Any]) -> dict[str, Any]:
    """The draft's decoder layer as a Llama config (vLLM builds ``Eagle3LlamaForCausalLM`` from it)."""
    tc = target_config.get("text_config") or target_config
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "vocab_size": cfg.target_vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        # both spellings: transformers < 5 reads rope_theta, >= 5 rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": tc.get("bos_token_id"), "eos_token_id": tc.get("eos_token_id"),
    }


def speculators_config(
    cfg: DraftConfig,
    target_config: dict[str, Any],
    *,
    verifier: str,
    speculative_tokens: int,
    dtype: str,
) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{
                "proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1, "accept_tolerance": 0.0,
            }],
            "verifier": {"name_or_path": verifier, "architectures": list(target_config.get("architectures") or [])},
        },
        "transformer_layer_config": transformer_layer_config(cfg, target_config),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "embed_requires_grad": False, "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def check_trained_for(cfg: DraftConfig, target: TargetInfo, trained: Any = "the draft") -> None:
    """Raise :class:`~vllm_compat.errors.TargetMismatchError` unless ``cfg`` was trained on
    states of ``target`` (hidden size, vocabulary, number of decoder layers)."""
    fix = f"export it with the target it was trained on, or train a draft for {target.path}"
    pairs = (("hidden size {}", cfg.hidden_size, target.hidden_size),
             ("a vocabulary of {}", cfg.target_vocab_size, target.vocab_size),
             ("{} decoder layers", cfg.final_layer_id, target.num_hidden_layers))
    for what, ours, theirs in pairs:
        if ours and ours != theirs:
            raise TargetMismatchError(
                f"draft {trained} was trained for a target with {what.format(ours)}, but "
                f"{target.path} has {what.format(theirs)}: {fix}")


def export(
    trained: str | os.PathLike[str],
    target_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    verifier: str | None = None,
    speculative_tokens: int = 3,
    dtype: str = "bfloat16",
) -> Path:
    """``trained``: a ``train`` output directory (or its ``final/``). ``verifier`` is written as
    ``verifier.name_or_path`` (what ``vllm serve <draft>`` loads as the target); default: ``target_dir``."""
    cfg, weights = load_final(trained)
    target = read_target(target_dir)
    check_trained_for(cfg, target, trained)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.draft_vocab_size == cfg.target_vocab_size:
        # a full-vocabulary draft has no mapping: older vLLM keeps its zero (identity) d2t,
        # 0.30+ builds no d2t parameter at all and would reject one
        weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    tensors = {k: (v if v.dtype in (torch.int64, torch.bool) else v.to(DTYPES[dtype])).contiguous()
               for k, v in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = speculators_config(cfg, target.config, verifier=verifier or str(Path(target_dir).resolve()),
                                speculative_tokens=speculative_tokens, dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
