"""Write a Kimi-K2.5 test checkpoint directory."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from .config import KimiK25Shape, generation_config, kimi_k25_config
from .processor import write_image_processor
from .tokenizer import write_tokenizer
from .weights import kimi_text_tensors, random_tensors, text_shapes, vision_shapes

VARIANTS = ("bf16", "int4")


def write_kimi_k25_checkpoint(
    path: str | os.PathLike[str],
    *,
    variant: Literal["bf16", "int4"] = "bf16",
    seed: int = 0,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    tokenizer: bool = True,
    image_processor: bool = True,
    merges_from: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    **sizes: Any,
) -> Path:
    """Write a small Kimi-K2.5 checkpoint that vLLM loads as ``KimiK25ForConditionalGeneration``.

    ``variant="int4"`` stores the routed experts as compressed-tensors ``pack-quantized``
    INT4 (group 32, symmetric) and declares Kimi-K2.5's ``quantization_config``; ``"bf16"``
    stores them in bf16 with no quantization config. ``sizes`` are :class:`KimiK25Shape`
    fields (``num_layers=8``, ``hidden_size=256``, ...). ``state_dict``: text weights of a
    transformers ``DeepseekV3ForCausalLM`` built from the same sizes (``model.*``,
    ``lm_head.weight``; fused or per-expert experts), e.g. a model trained with
    :func:`hf_text_config`; otherwise the text weights are random (seeded by ``seed``).
    ``tokenizer`` writes Kimi's tokenizer layout (remote code, no ``tokenizer.json``), with
    BPE merges learned from ``merges_from`` when given; ``image_processor`` writes
    ``preprocessor_config.json`` and its remote processor. ``device``: where the random
    weights are drawn (``"cuda"`` draws a wide shape's billions of values in seconds, not
    minutes; the same seed then gives other weights than on the CPU). Returns the directory.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if merges_from is not None and not tokenizer:
        raise ValueError("merges_from needs tokenizer=True")
    shape = KimiK25Shape(**sizes)
    int4 = variant == "int4"
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = torch.bfloat16
    if state_dict is None:
        state_dict = random_tensors(text_shapes(shape), gen, dtype=bf16)
    tensors = kimi_text_tensors(state_dict, shape, quantize_experts=int4)
    tensors.update(random_tensors(vision_shapes(shape), gen, dtype=bf16))
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", kimi_k25_config(shape, int4=int4))
    _write_json(out / "generation_config.json", generation_config())
    if tokenizer:
        write_tokenizer(out, merges_from=merges_from)
    if image_processor:
        write_image_processor(out)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
