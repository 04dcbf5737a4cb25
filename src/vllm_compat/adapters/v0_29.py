"""Adapter for vLLM 0.29 and later: model runner V2 by default, deterministic ``NONE_HASH``.

Changes that define this era:
- 0.29 seeds ``NONE_HASH`` from the fixed ``"vllm-none-hash"`` for sha256 / sha256_cbor
  when ``PYTHONHASHSEED`` is unset, so hashes match across processes.
- 0.29 made Model Runner V2 the default for every model (no "State error" guard there:
  skipping ``sample_tokens`` silently corrupts state, so the two-phase step matters more).
Inside the era (probed where used): 0.30 absolute, sorted aux-hidden-state indices;
0.33 ``get_request_block_hasher(num_hash_lookahead_tokens=)`` and hasher-less requests
silently never cached instead of crashing.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm.utils.hashing import get_hash_fn_by_name

from ._shared import (  # noqa: F401  (re-exported: part of the adapter function set)
    attach_block_hasher, block_hashes, collective_rpc, current_none_hash, grammar_output,
    hash_function_names, init_none_hash, kv_cache_config, model_runner_output, new_request,
    new_scheduler, probes, request_block_hasher, resolve_output, runner_flavour, schedule,
    scheduler_hash_block_size, update_from_output, version, vllm_config,
    has_unscheduled_tokens,
)
from ._shared import launch_two_phase_step as launch_model_step
from ._shared import two_phase_step as run_model_step

ERA = "v0_29"


def hash_function(name: str) -> Callable[[Any], bytes]:
    return get_hash_fn_by_name(name)
