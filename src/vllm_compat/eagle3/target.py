"""What the draft needs from the target model: its config and three tensors.

Read from a local Hugging Face checkpoint directory (``config.json`` + safetensors,
sharded or not): ``model.embed_tokens.weight``, ``model.norm.weight`` and ``lm_head.weight``
(the embedding when ``tie_word_embeddings``; under ``language_model.`` for multimodal
wrappers such as Kimi-K2.5). Only these tensors are read, so a large
target costs one embedding and one head in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..target import TargetInfo, read_target

__all__ = ["TargetInfo", "load_target_tensors", "read_target"]

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def _weight_files(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


# Multimodal wrappers (Kimi-K2.5) keep the language model's tensors under "language_model.".
PREFIXES = ("", "language_model.")


def load_target_tensors(target: TargetInfo) -> dict[str, torch.Tensor]:
    """``{"embed_tokens", "norm", "lm_head"}`` weights of the target, as float32."""
    where = _weight_files(Path(target.path))
    prefix = next((p for p in PREFIXES if p + EMBED in where), "")
    names = {"embed_tokens": prefix + EMBED, "norm": prefix + NORM, "lm_head": prefix + LM_HEAD}
    tied = target.config.get("tie_word_embeddings", False) or names["lm_head"] not in where
    if tied:
        names["lm_head"] = names["embed_tokens"]
    out = {}
    for key, name in names.items():
        if name not in where:
            raise KeyError(f"{target.path}: tensor {name!r} not found in the checkpoint")
        with safe_open(str(where[name]), framework="pt") as h:
            out[key] = h.get_tensor(name).float()
    return out
