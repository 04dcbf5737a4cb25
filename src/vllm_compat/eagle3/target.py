"""What the draft needs from the target model: its config and three tensors.

Read from a local Hugging Face checkpoint directory (``config.json`` + safetensors,
sharded or not): ``model.embed_tokens.weight``, ``model.norm.weight`` and ``lm_head.weight``
(the embedding when ``tie_word_embeddings``). Only these tensors are read, so a large
target costs one embedding and one head in memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass
class TargetInfo:
    path: str
    config: dict[str, Any]

    @property
    def text_config(self) -> dict[str, Any]:
        # multimodal targets keep the language model's sizes under text_config
        return self.config.get("text_config") or self.config

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def rms_norm_eps(self) -> float:
        return float(self.text_config.get("rms_norm_eps", 1e-6))

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    def default_aux_layer_ids(self) -> list[int]:
        """vLLM's default EAGLE-3 layers for Llama-like targets: ``(2, L // 2, L - 3)``."""
        n = self.num_hidden_layers
        return [2, n // 2, n - 3]


def read_target(path: str | os.PathLike[str]) -> TargetInfo:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a local target checkpoint directory)")
    return TargetInfo(str(path), json.loads(cfg.read_text()))


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


def load_target_tensors(target: TargetInfo) -> dict[str, torch.Tensor]:
    """``{"embed_tokens", "norm", "lm_head"}`` weights of the target, as float32."""
    where = _weight_files(Path(target.path))
    names = {"embed_tokens": EMBED, "norm": NORM, "lm_head": LM_HEAD}
    tied = target.config.get("tie_word_embeddings", False) or LM_HEAD not in where
    if tied:
        names["lm_head"] = EMBED
    out = {}
    for key, name in names.items():
        if name not in where:
            raise KeyError(f"{target.path}: tensor {name!r} not found in the checkpoint")
        with safe_open(str(where[name]), framework="pt") as h:
            out[key] = h.get_tensor(name).float()
    return out
