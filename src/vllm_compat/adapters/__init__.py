"""Per-era adapters: the only modules that import vLLM.

Each module exposes the same function set (``ADAPTER_FUNCTIONS``); a test checks it.
Which module is loaded is decided by :func:`vllm_compat.detect`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

ADAPTER_FUNCTIONS: tuple[str, ...] = (
    "version", "probes",
    "hash_function", "hash_function_names", "init_none_hash", "current_none_hash",
    "request_block_hasher", "block_hashes", "attach_block_hasher",
    "new_request",
    "vllm_config", "kv_cache_config", "new_scheduler", "scheduler_hash_block_size",
    "schedule", "update_from_output", "grammar_output", "model_runner_output",
    "run_model_step", "resolve_output", "collective_rpc", "runner_flavour",
    "launch_model_step", "has_unscheduled_tokens",
)


def load(module: str) -> ModuleType:
    """Import ``vllm_compat.adapters.<module>`` (this imports vLLM)."""
    return importlib.import_module(f"{__name__}.{module}")
