"""EAGLE-3 reference pipeline: prepare -> vocab -> train -> export -> validate.

``train`` reads extracted shards; ``train_online`` extracts the states while it trains
(``OnlineConfig``; docs/online-training.md).

Each step is a function here and a ``vllm-compat eagle3 <step>`` command (:mod:`.cli`).
Nothing in this package imports vLLM; ``validate`` replays the installed vLLM's loading
through :mod:`vllm_compat.runtime.speculative` when vLLM is present. Needs torch, safetensors,
tqdm (and transformers for ``prepare``; matplotlib for the training plot).
"""

from __future__ import annotations

import typing

__all__ = [
    "CheckpointValidationError", "HiddenStatesDataset", "Manifest", "OnlineConfig", "PrepareReport", "Problem",
    "Report", "ShardWriter", "TrainConfig", "TrainResult", "VocabMapping", "build_mapping",
    "build_vocab", "export", "prepare", "read_manifest", "train", "train_online", "validate",
]

try:
    # Imported eagerly: the step functions share their submodules' names, and a lazily
    # imported submodule would shadow its function on the package.
    from .data import HiddenStatesDataset, Manifest, ShardWriter, read_manifest
    from .export import export
    from .online import OnlineConfig, train_online
    from .prepare import PrepareReport, prepare
    from .training import TrainConfig, TrainResult, train
    from .validate import CheckpointValidationError, Problem, Report, validate
    from .vocab import VocabMapping, build_mapping, build_vocab
except ImportError as exc:  # torch / safetensors missing: keep `eagle3.cli` importable
    _missing = exc

    def __getattr__(name: str) -> typing.Any:
        raise ImportError(
            f"vllm_compat.eagle3.{name} needs torch and the eagle3 extra "
            f"(pip install 'vllm-compat[eagle3]'): {_missing}"
        )
