"""Adapter for vLLM 0.11 - 0.16: two-phase step, ``Request(eos_token_id=...)`` still required.

Changes against 0.10.2 that define this era:
- 0.11 split the model step: ``execute_model`` returns None and keeps its state until
  ``sample_tokens(grammar_output)`` is called (the V1 runner raises "State error" otherwise).
- 0.11 moved the hash helpers to ``vllm.utils.hashing`` and derived
  ``structured_output_request`` inside ``Request``.
Inside the era: 0.16.0 replaced ``get_hash_new_full_blocks`` by ``update_block_hashes``
(probed in ``attach_block_hasher``); 0.12 made prefix caching default on.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm.utils.hashing import get_hash_fn_by_name

from ._shared import (  # noqa: F401  (re-exported: part of the adapter function set)
    attach_block_hasher, block_hashes, collective_rpc, current_none_hash, grammar_output,
    hash_function_names, init_none_hash, kv_cache_config, model_runner_output, new_scheduler,
    probes, request_block_hasher, resolve_output, runner_flavour, schedule,
    scheduler_hash_block_size, update_from_output, version, vllm_config,
    has_unscheduled_tokens,
)
from ._shared import eos_in_request as _eos_in_request
from ._shared import request_factory as _request_factory
from ._shared import launch_two_phase_step as launch_model_step
from ._shared import two_phase_step as run_model_step

ERA = "v0_11"


def hash_function(name: str) -> Callable[[Any], bytes]:
    return get_hash_fn_by_name(name)


new_request = _request_factory(_eos_in_request)  # Request(eos_token_id=...) through 0.16
