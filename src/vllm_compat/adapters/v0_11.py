"""Adapter for vLLM 0.11 - 0.16: two-phase step, ``Request(eos_token_id=...)`` still required.

Changes against 0.10.2 that define this era:
- 0.11 split the model step: ``execute_model`` returns None and keeps its state until
  ``sample_tokens(grammar_output)`` is called (the V1 runner raises "State error" otherwise).
- 0.11 moved the hash helpers to ``vllm.utils.hashing`` and derived
  ``structured_output_request`` inside ``Request``.
Inside the era: 0.16.0 replaced ``get_hash_new_full_blocks`` by ``update_block_hashes``
(probed in ``attach_block_hasher``); 0.12 made prefix caching default on.
What ends the era: 0.17 removed ``Request(eos_token_id=...)``, which is all this module redefines.
"""

from __future__ import annotations

# The common adapter's functions that this era keeps; what differs is redefined below.
from ._common import (  # noqa: F401  (re-exported: vllm_compat.adapters.AdapterAPI)
    attach_block_hasher, block_hashes, check_step_target, collective_rpc, current_none_hash, grammar_output,
    has_unscheduled_tokens, hash_function, hash_function_names, init_none_hash,
    kv_cache_config, launch_model_step, model_runner_output, new_scheduler, probes,
    request_block_hasher, resolve_output, run_model_step, runner_flavour, schedule,
    scheduler_hash_block_size, update_from_output, version, vllm_config,
)
from ._common import eos_in_request, request_factory

new_request = request_factory(eos_in_request)  # Request(eos_token_id=...) through 0.16
