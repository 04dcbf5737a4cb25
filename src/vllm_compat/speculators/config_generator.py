"""``data_config.json`` as speculators 0.3/0.4 write it, for data made with vllm_compat.

Name-compatible with ``speculators.data_generation.config_generator``
(``DataGenerationConfig.from_generator(...)``, ``.to_dict()``). The JSON has the same
sections and keys (``version`` "2.0", ``reproducibility``, ``model``, ``data``,
``hidden_states``, ``generation``, ``format``; ``format.data_format_version`` 1 as 0.3.0
wrote it) plus, under ``hidden_states``, the layer numbering (``layer_convention``:
``"speculators"`` or ``"vllm"``) and the vLLM ids of the written tensors (``vllm_layer_ids``),
so nobody has to guess which numbering a data set used. Package versions are read
from installed metadata: nothing here imports vLLM.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

from .layers import SPECULATORS, from_legacy

__all__ = ["DataGenerationConfig", "PackageVersions", "format_schema"]

FILE_PATTERN = "data_{idx}.pt"
DATA_FORMAT_VERSION = 1


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_info() -> str:
    try:
        import torch
    except ImportError:
        return "CPU ONLY"
    if not torch.cuda.is_available():
        return "CPU ONLY"
    n = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    return name if n == 1 else f"{n}x {name}"


@dataclass
class PackageVersions:
    torch: str | None
    vllm: str | None
    transformers: str | None
    speculators: str | None
    vllm_compat: str | None = None

    @classmethod
    def from_environment(cls) -> PackageVersions:
        return cls(torch=_dist_version("torch"), vllm=_dist_version("vllm"),
                   transformers=_dist_version("transformers"),
                   speculators=_dist_version("speculators"),
                   vllm_compat=_dist_version("vllm-compat"))


@dataclass
class ReproducibilityInfo:
    command: str
    package_versions: PackageVersions
    gpu: str = field(default_factory=_gpu_info)


@dataclass
class ModelConfig:
    target_model_path: str
    tensor_parallel_size: int
    gpu_memory_utilization: float
    hidden_size: int
    max_model_len: int | None = None


@dataclass
class DataConfig:
    train_data_path: str
    seq_length: int
    max_samples: int | None
    num_samples: int
    seed: int
    chat_template_note: str = "Uses tokenizer's built-in chat template"


@dataclass
class HiddenStatesConfig:
    layer_ids: list[int]
    description: str = "Layers selected for EAGLE3 fusion and target logits"
    # vllm_compat additions: the numbering layer_ids use ("speculators" | "vllm") and the
    # vLLM/EAGLE-3 id of each written hidden_states tensor
    layer_convention: str = SPECULATORS
    vllm_layer_ids: list[int] | None = None


@dataclass
class GenerationConfig:
    cache_dir: str


def format_schema(num_layers: int, hidden_size: int, dtype: str = "torch.bfloat16") -> dict:
    return {
        "input_ids": {"dtype": "torch.long", "shape": "[seq_len]",
                      "description": "Tokenized input sequence"},
        "hidden_states": {"dtype": f"list[{dtype}]", "shape": f"list of [seq_len, {hidden_size}]",
                          "num_tensors": num_layers,
                          "description": f"Hidden states from {num_layers} layers"},
        "loss_mask": {"dtype": "torch.long", "shape": "[seq_len]",
                      "description": "1 for assistant tokens to train on, 0 elsewhere"},
    }


@dataclass
class FormatConfig:
    file_pattern: str
    schema: dict[str, dict[str, Any]]
    data_format_version: int = DATA_FORMAT_VERSION

    @classmethod
    def create_default(cls, num_layers: int, hidden_size: int,
                       dtype: str = "torch.bfloat16") -> FormatConfig:
        return cls(file_pattern=FILE_PATTERN, schema=format_schema(num_layers, hidden_size, dtype))


def hidden_size_of(config: Any) -> int:
    h = getattr(config, "hidden_size", None)
    if h is None and getattr(config, "text_config", None) is not None:
        h = getattr(config.text_config, "hidden_size", None)
    if h is None:
        raise ValueError("Could not determine hidden size: no 'hidden_size' or "
                         "'text_config.hidden_size' in the model config")
    return int(h)


@dataclass
class DataGenerationConfig:
    VERSION: ClassVar[str] = "2.0"

    version: str
    generated_at: str
    speculators_version: str | None
    reproducibility: ReproducibilityInfo
    model: ModelConfig
    data: DataConfig
    hidden_states: HiddenStatesConfig
    generation: GenerationConfig
    format: FormatConfig

    def to_dict(self) -> dict[str, Any]:
        def plain(obj: Any) -> Any:
            if isinstance(obj, Path):
                return str(obj)
            if isinstance(obj, dict):
                return {k: plain(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return [plain(v) for v in obj]
            return obj

        return plain(asdict(self))

    @classmethod
    def from_generator(cls, generator: Any, train_data_path: str, seq_length: int,
                       cache_dir: str, num_samples: int, max_samples: int | None = None,
                       seed: int = 0, *, hidden_dtype: str = "torch.bfloat16",
                       command: str | None = None) -> DataGenerationConfig:
        """Same arguments as speculators'; ``generator`` is our VllmHiddenStatesGenerator."""
        config = getattr(generator, "config", None)
        if config is None:
            from .vllm_hidden_states_generator import _model_config

            config = _model_config(generator.model_path)
        layer_ids = list(generator.layer_ids)
        convention = getattr(generator, "layer_convention", SPECULATORS)
        slots = getattr(generator, "capture_layer_ids", None)
        if slots is None:  # speculators' own generator: its numbering, its slot order
            slots = from_legacy(sorted(set(layer_ids)))
        return cls.from_settings(
            target_model_path=generator.model_path,
            tensor_parallel_size=generator.tensor_parallel_size,
            gpu_memory_utilization=generator.vllm_config.cache_config.gpu_memory_utilization,
            max_model_len=generator.vllm_config.model_config.max_model_len,
            hidden_size=hidden_size_of(config), layer_ids=layer_ids,
            vllm_layer_ids=list(slots), layer_convention=convention,
            train_data_path=train_data_path, seq_length=seq_length, cache_dir=cache_dir,
            num_samples=num_samples, max_samples=max_samples, seed=seed,
            hidden_dtype=hidden_dtype, command=command)

    @classmethod
    def from_settings(cls, *, target_model_path: str, tensor_parallel_size: int,
                      gpu_memory_utilization: float, max_model_len: int | None, hidden_size: int,
                      layer_ids: list[int], vllm_layer_ids: list[int], layer_convention: str,
                      train_data_path: str, seq_length: int, cache_dir: str, num_samples: int,
                      max_samples: int | None = None, seed: int = 0,
                      hidden_dtype: str = "torch.bfloat16",
                      command: str | None = None) -> DataGenerationConfig:
        versions = PackageVersions.from_environment()
        return cls(
            version=cls.VERSION,
            generated_at=datetime.now(timezone.utc).isoformat(),
            speculators_version=versions.speculators,
            reproducibility=ReproducibilityInfo(
                command=command if command is not None
                else " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                package_versions=versions),
            model=ModelConfig(target_model_path=str(target_model_path),
                              tensor_parallel_size=tensor_parallel_size,
                              gpu_memory_utilization=gpu_memory_utilization,
                              hidden_size=hidden_size, max_model_len=max_model_len),
            data=DataConfig(train_data_path=str(train_data_path), seq_length=seq_length,
                            max_samples=max_samples, num_samples=num_samples, seed=seed),
            hidden_states=HiddenStatesConfig(
                layer_ids=list(layer_ids),
                layer_convention=layer_convention, vllm_layer_ids=list(vllm_layer_ids)),
            generation=GenerationConfig(cache_dir=str(cache_dir)),
            # one tensor per slot (the speculators numbering writes each distinct id once)
            format=FormatConfig.create_default(len(vllm_layer_ids), hidden_size, hidden_dtype),
        )
