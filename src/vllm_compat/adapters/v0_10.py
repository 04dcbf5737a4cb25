"""Adapter for vLLM 0.10.2: single-phase model step, hashing helpers in ``vllm.utils``.

What sets this era apart (all changed in 0.11):
- ``execute_model`` returns the final ``ModelRunnerOutput``; there is no ``sample_tokens``.
- ``get_hash_fn_by_name`` / ``sha256`` live in ``vllm.utils`` (moved to ``vllm.utils.hashing``).
- ``Request`` takes ``structured_output_request`` explicitly and requires ``eos_token_id``.
- The grammar bitmask travels inside ``SchedulerOutput``, so there is no GrammarOutput.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm.utils import get_hash_fn_by_name
from vllm.v1.structured_output.request import StructuredOutputRequest

from ..errors import VllmCompatError
from .. import resolve as _resolve

# The common adapter's functions that this era keeps; what differs is redefined below.
from ._common import (  # noqa: F401  (re-exported: vllm_compat.adapters.AdapterAPI)
    attach_block_hasher, block_hashes, collective_rpc, current_none_hash,
    has_unscheduled_tokens, hash_function_names, init_none_hash, kv_cache_config,
    model_runner_output, new_scheduler, probes, request_block_hasher, resolve_output,
    runner_flavour, schedule, scheduler_hash_block_size, update_from_output, version,
    vllm_config,
)
from ._common import LaunchedStep, call_step, eos_in_request, request_factory


def hash_function(name: str) -> Callable[[Any], bytes]:
    # imported from vllm.utils above: the module fails to load on 0.11+, where forcing this
    # era (VLLM_COMPAT_ADAPTER=v0_10) must fail clearly instead of half-working
    return _resolve.check_hash_fn(name, get_hash_fn_by_name(name))


def _v0_10_request_kwargs(kw: dict[str, Any], eos_token_id: int | None) -> None:
    eos_in_request(kw, eos_token_id)
    sp = kw["sampling_params"]
    # 0.10.2 builds the structured-output request in from_engine_core_request; 0.11
    # moved that into Request itself.
    kw["structured_output_request"] = StructuredOutputRequest(sampling_params=sp) if sp else None


new_request = request_factory(_v0_10_request_kwargs)


def grammar_output(scheduler: Any, scheduler_output: Any) -> None:
    # 0.10.2 puts the bitmask in SchedulerOutput; there is no second phase to feed.
    return None


def check_step_target(target: Any) -> None:
    _resolve.method(target, "Executor.execute_model")  # the whole step on 0.10.2


def run_model_step(target: Any, scheduler_output: Any, grammar_output: Any = None) -> Any:
    """0.10.2: ``execute_model`` already samples and returns the final output."""
    out = resolve_output(call_step(target, "execute_model", scheduler_output))
    if out is None:
        raise VllmCompatError("execute_model returned no output")
    return out


def launch_model_step(target: Any, scheduler_output: Any,
                      grammar_output_fn: Callable[[Any], Any] | None = None,
                      between: Callable[[Any], Any] | None = None) -> LaunchedStep:
    """0.10.2: ``execute_model`` is the whole step (it has sampled when it returns), so
    nothing is left in flight; ``between`` runs after it (hooks still hold the states)."""
    out = resolve_output(call_step(target, "execute_model", scheduler_output))
    value = between(scheduler_output) if between is not None else None
    return LaunchedStep(scheduler_output, value, out)
