"""Per-era adapters: only what differs between vLLM eras (these modules import vLLM).

``_common`` is the adapter of the newest eras and the base of the older ones; ``v0_10`` and
``v0_11`` import it and redefine what their releases do differently. Which module an era
uses is a row of :data:`vllm_compat.versions.ERAS`; :func:`vllm_compat.detect` loads it.
Every module satisfies :class:`AdapterAPI`, which the type checker verifies (see the
``TYPE_CHECKING`` block at the end) and the conformance suite checks on each release.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from ._common import LaunchedStep


@runtime_checkable
class AdapterAPI(Protocol):
    """The function set every era module provides; the facades call nothing else."""

    def version(self) -> str: ...
    def probes(self) -> dict[str, bool | None]: ...

    # hashing
    def hash_function(self, name: str) -> Callable[[Any], bytes]: ...
    def hash_function_names(self) -> tuple[str, ...]: ...
    def init_none_hash(self, hash_fn: Callable[[Any], bytes]) -> bytes: ...
    def current_none_hash(self) -> bytes | None: ...
    def request_block_hasher(self, block_size: int, hash_fn: Callable[[Any], bytes],
                             lookahead_tokens: int = 0) -> Callable[[Request], list[Any]]: ...
    def block_hashes(self, request: Request) -> list[bytes]: ...
    def attach_block_hasher(self, request: Request,
                            hasher: Callable[[Request], list[Any]]) -> None: ...

    # requests
    def new_request(self, request_id: str, prompt_token_ids: Sequence[int], *,
                    sampling_params: SamplingParams | None = None, pooling_params: Any = None,
                    eos_token_id: int | None = None,
                    block_hasher: Callable[[Request], list[bytes]] | None = None,
                    **extra: Any) -> Request: ...

    # scheduler
    def vllm_config(self, model: str, *, block_size: int = 16,
                    enable_prefix_caching: bool = True, hash_algo: str = "sha256",
                    num_gpu_blocks: int = 64, max_model_len: int = 1024,
                    max_num_batched_tokens: int = 512, max_num_seqs: int = 8,
                    enable_chunked_prefill: bool = True, async_scheduling: bool = False,
                    device: str = "cpu", dtype: str = "float32") -> VllmConfig: ...
    def kv_cache_config(self, num_blocks: int, block_size: int, *,
                        layer_names: Iterable[str] = ..., num_kv_heads: int = 1,
                        head_size: int = 64, dtype: torch.dtype = ...) -> KVCacheConfig: ...
    def new_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *,
                      log_stats: bool = False, include_finished_set: bool = False) -> Scheduler: ...
    def scheduler_hash_block_size(self, scheduler: Scheduler) -> int: ...
    def schedule(self, scheduler: Scheduler, *, throttle_prefills: bool = False) -> Any: ...
    def update_from_output(self, scheduler: Scheduler, scheduler_output: Any,
                           model_runner_output: Any) -> Any: ...
    def has_unscheduled_tokens(self, scheduler: Scheduler) -> bool: ...

    # model steps and workers
    def grammar_output(self, scheduler: Scheduler, scheduler_output: Any) -> Any: ...
    def model_runner_output(self, req_ids: Sequence[str],
                            sampled_token_ids: Sequence[Sequence[int]]) -> ModelRunnerOutput: ...
    def run_model_step(self, target: Any, scheduler_output: Any,
                       grammar_output: Any = None) -> ModelRunnerOutput: ...
    def launch_model_step(self, target: Any, scheduler_output: Any,
                          grammar_output_fn: Callable[[Any], Any] | None = None,
                          between: Callable[[Any], Any] | None = None) -> LaunchedStep: ...
    def resolve_output(self, out: Any) -> Any: ...
    def collective_rpc(self, target: Any, method: str | Callable[..., Any], *, args: tuple = (),
                       kwargs: dict[str, Any] | None = None, timeout: float | None = None,
                       rank: int | None = None) -> Any: ...
    def runner_flavour(self, obj: Any) -> str: ...
    def check_step_target(self, target: Any) -> None: ...


ADAPTER_FUNCTIONS: tuple[str, ...] = tuple(
    n for n in vars(AdapterAPI) if not n.startswith("_") and callable(vars(AdapterAPI)[n]))


def load(module: str) -> ModuleType:
    """Import ``vllm_compat.adapters.<module>`` (this imports vLLM)."""
    return importlib.import_module(f"{__name__}.{module}")


if TYPE_CHECKING:  # the type checker verifies every era module against the protocol
    from . import _common, v0_10, v0_11

    _COMMON: AdapterAPI = _common
    _V0_10: AdapterAPI = v0_10
    _V0_11: AdapterAPI = v0_11
