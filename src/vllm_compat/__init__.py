"""vllm_compat: one stable API over vLLM's internals, 0.10.2 through 0.34.x.

``import vllm_compat`` never imports vLLM; the adapter for the installed release is
loaded on first use (see :func:`detect`).
"""

from __future__ import annotations

from .detect import VllmInfo, adapter, alias, check_drift, detect, installed_vllm_version
from .drift import DriftItem, DriftReport
from .errors import (
    EngineHashMismatchError,
    InvalidLayerIdError,
    InvalidVllmVersionError,
    MissingSymbolError,
    RejectedAliasError,
    ReturnTypeDriftError,
    SignatureDriftError,
    StaleBlockHasherError,
    TargetMismatchError,
    TrainingCheckpointError,
    UnknownAdapterError,
    UnsupportedFeatureError,
    UnsupportedVllmVersionError,
    VllmCompatError,
    VllmDriftError,
    VllmNotInstalledError,
)
from .hashing import BlockHasher, attach_block_hasher, block_hasher_for, make_block_hasher
from .requests import AUTO, InvalidPromptError, make_request
from .rpc import collective_rpc, runner_flavour
from .scheduling import (
    grammar_output,
    make_kv_cache_config,
    make_model_runner_output,
    make_scheduler,
    make_vllm_config,
    schedule,
    update_from_output,
)
from .step import FinishedStep, StepPipeline, resolve_output, run_model_step
from .versions import parse_vllm_version, route

__version__ = "0.1.0"


def _register_checks() -> None:
    # VLLM_COMPAT_STRICT=drift accepts an untested build only when its engine hashes blocks as
    # vllm_compat does (the check sits above detect, which cannot import it)
    from .detect import add_untested_build_check
    from .hash_check import strict_drift_line

    add_untested_build_check(strict_drift_line)


_register_checks()

__all__ = [
    "AUTO", "BlockHasher", "DriftItem", "DriftReport", "EngineHashMismatchError", "FinishedStep", "InvalidLayerIdError",
    "InvalidPromptError", "InvalidVllmVersionError", "MissingSymbolError", "RejectedAliasError",
    "ReturnTypeDriftError",
    "SignatureDriftError", "StaleBlockHasherError", "StepPipeline", "TargetMismatchError",
    "TrainingCheckpointError", "UnknownAdapterError", "UnsupportedFeatureError",
    "UnsupportedVllmVersionError", "VllmCompatError", "VllmDriftError", "VllmInfo",
    "VllmNotInstalledError", "adapter", "alias", "attach_block_hasher",
    "block_hasher_for", "check_drift", "collective_rpc", "detect", "grammar_output", "installed_vllm_version",
    "make_block_hasher", "make_kv_cache_config", "make_model_runner_output", "make_request",
    "make_scheduler", "make_vllm_config", "parse_vllm_version", "resolve_output", "route",
    "run_model_step", "runner_flavour", "schedule", "update_from_output",
]
