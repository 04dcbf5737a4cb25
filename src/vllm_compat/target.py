"""A target checkpoint's facts, read once from its ``config.json`` and passed along.

Multimodal wrappers (Kimi-K2.5, Qwen-VL, ...) keep the language model's sizes under
``text_config``; every property here reads the backbone's. Which layer ids vLLM's own aux
path can return depends on the installed vLLM and is decided by
:mod:`vllm_compat.runtime.capture_plan` from these facts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


def read_model_config(model_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict (a local directory only)."""
    path = os.path.join(os.fspath(model_path), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: model_path must be a local checkpoint "
                                "directory")
    with open(path) as f:
        return json.load(f)


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder backbone's config: multimodal wrappers (Kimi-K2.5, Qwen-VL, ...) keep it
    in ``text_config``."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), Mapping):
        return cfg["text_config"]
    return cfg


def num_layers_from_config(cfg: Mapping[str, Any]) -> int:
    """``num_hidden_layers`` of the decoder backbone (``text_config`` for wrappers)."""
    tc = text_config(cfg)
    if "num_hidden_layers" not in tc:
        raise ValueError("config has no num_hidden_layers (nor text_config.num_hidden_layers)")
    return _as_int(tc["num_hidden_layers"], "num_hidden_layers")


def hidden_size_from_config(cfg: Mapping[str, Any]) -> int:
    tc = text_config(cfg)
    return _as_int(tc["hidden_size"], "hidden_size")


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value.__index__())


@dataclass(frozen=True)
class TargetInfo:
    """``path`` (a local checkpoint directory) and its parsed ``config.json``."""

    path: str
    config: dict[str, Any]

    @property
    def text_config(self) -> dict[str, Any]:
        return dict(text_config(self.config))

    @property
    def hidden_size(self) -> int:
        return hidden_size_from_config(self.config)

    @property
    def num_hidden_layers(self) -> int:
        return num_layers_from_config(self.config)

    @property
    def vocab_size(self) -> int:
        v = self.text_config.get("vocab_size") or self.config.get("vocab_size")
        if v is None:
            raise ValueError(f"{self.path}: config has no vocab_size (nor text_config.vocab_size)")
        return int(v)

    @property
    def rms_norm_eps(self) -> float:
        return float(self.text_config.get("rms_norm_eps", 1e-6))

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    @property
    def is_multimodal_wrapper(self) -> bool:
        """A vision-language wrapper around a text backbone (Kimi-K2.5, Qwen-VL, ...)."""
        return isinstance(self.config.get("vision_config"), Mapping)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3, Kimi): ``kv_lora_rank`` is set."""
        return bool(self.text_config.get("kv_lora_rank"))

    def default_aux_layer_ids(self) -> list[int]:
        """vLLM's default EAGLE-3 layers: ``(2, L // 2, L - 3)``."""
        n = self.num_hidden_layers
        return [2, n // 2, n - 3]

    def manifest_entry(self) -> dict[str, Any]:
        """What a dataset records about the target it was extracted from."""
        return {"name_or_path": str(Path(self.path).resolve()), "vocab_size": self.vocab_size,
                "num_hidden_layers": self.num_hidden_layers}


def read_target(path: str | os.PathLike[str] | TargetInfo) -> TargetInfo:
    """The facts of the checkpoint at ``path`` (returned as is when already read)."""
    if isinstance(path, TargetInfo):
        return path
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a local target checkpoint directory)")
    return TargetInfo(str(path), json.loads(cfg.read_text()))
