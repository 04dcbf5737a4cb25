"""A faithful, small Kimi-K2.5 checkpoint, written offline.

``write_kimi_k25_checkpoint(path)`` writes the real checkpoint's ``config.json`` layout
(``KimiK25ForConditionalGeneration``: a ``kimi_k2`` DeepSeek-V3 text model and a MoonViT
vision tower), its tensor names, bf16 or INT4 routed experts (compressed-tensors
``pack-quantized``, as Kimi-K2.5 ships), and its own tokenizer and image processor in Kimi's
layout (remote code: load them with ``trust_remote_code=True``), so that vLLM starts it the
full multimodal way. ``kimi_k25_text_model_for_reference(path)`` gives the text model in
transformers, for checking vLLM's output.

    from vllm_compat.testing.kimi_k25 import write_kimi_k25_checkpoint
    path = write_kimi_k25_checkpoint("/tmp/kimi-tiny", variant="int4")
    # vllm.LLM(str(path), trust_remote_code=True, max_model_len=4096)
"""

from .checkpoint import VARIANTS, write_kimi_k25_checkpoint
from .config import KimiK25Shape, kimi_k25_config
from .reference import hf_text_config, kimi_k25_text_model_for_reference
from .tokenizer import SPECIAL_TOKENS

__all__ = [
    "SPECIAL_TOKENS",
    "VARIANTS",
    "KimiK25Shape",
    "hf_text_config",
    "kimi_k25_config",
    "kimi_k25_text_model_for_reference",
    "write_kimi_k25_checkpoint",
]
