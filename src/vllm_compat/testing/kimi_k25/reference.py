"""The text model of a Kimi-K2.5 test checkpoint in transformers: a reference for vLLM's output.

INT4 experts are dequantized exactly (``q * scale``), so the reference computes what the
INT4 kernels should, up to their own rounding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .weights import fuse_experts, text_state_dict_from_checkpoint

# Keys of Kimi's text_config that transformers' DeepseekV3Config does not take as such.
_NOT_FOR_TRANSFORMERS = ("model_type", "auto_map", "architectures", "quantization_config")


def hf_text_config(text_config: dict[str, Any]) -> Any:
    """transformers' ``DeepseekV3Config`` for a Kimi ``text_config`` (``kimi_k2`` is DeepSeek-V3)."""
    from transformers import DeepseekV3Config

    kwargs = {k: v for k, v in text_config.items() if k not in _NOT_FOR_TRANSFORMERS}
    return DeepseekV3Config(**kwargs)


def kimi_k25_text_model_for_reference(path: str | os.PathLike[str],
                                      dtype: torch.dtype = torch.float32) -> Any:
    """transformers ``DeepseekV3ForCausalLM`` with the checkpoint's text weights, in eval mode."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    d = Path(path)
    config = hf_text_config(json.loads((d / "config.json").read_text())["text_config"])
    state = text_state_dict_from_checkpoint(load_file(str(d / "model.safetensors")))
    model: Any = DeepseekV3ForCausalLM(config)
    # transformers 5 keeps a layer's experts in two 3-D tensors, 4.x one module per expert.
    if any(k.endswith("mlp.experts.gate_up_proj") for k in model.state_dict()):
        state = fuse_experts(state, config.n_routed_experts)
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()
