"""Adapter for vLLM 0.17 - 0.28: no ``eos_token_id`` on Request, random ``NONE_HASH``.

Changes that define this era:
- 0.17 removed ``Request(eos_token_id=...)``; the stop check reads
  ``sampling_params.eos_token_id`` (set through ``update_from_generation_config``).
- ``NONE_HASH`` is ``os.urandom`` per process unless ``PYTHONHASHSEED`` is set, so hashes
  only match the engine's when both processes share the seed (or share the process).
Inside the era (probed where used): 0.20 ``Scheduler(hash_block_size=)``, 0.22 model
runner V2 default for some architectures, 0.24 ``schedule(throttle_prefills=)`` and the
UniProc sync RPC resolving ``AsyncModelRunnerOutput``, 0.26 IndexError for hasher-less
requests instead of AssertionError.
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

ERA = "v0_17"


def hash_function(name: str) -> Callable[[Any], bytes]:
    return get_hash_fn_by_name(name)
