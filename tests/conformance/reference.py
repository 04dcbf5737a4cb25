"""The conformance tests' one door to vLLM: every raw vLLM name a test reads goes through here.

A test compares vllm_compat with vLLM itself. What it reads of vLLM directly (a class to build a
raw Request with, a module-level global, the executor class the stand-in worker sits in) is
the test's reference, not the library under test: each function below runs under
:func:`~tests.conformance.oracle.oracle_fn`, so on a drifted build whose change the library
absorbs (a moved module, a renamed class) the reference breaking is reported as "oracle needs
updating for this build" instead of failing the suite. Test modules import vLLM nowhere else
(``tests/unit/test_boundaries.py`` checks it). Test-side code: it may import vLLM.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, Callable, Iterator

from .oracle import oracle, oracle_fn


@oracle_fn("vLLM's SamplingParams (reference.sampling_params)")
def sampling_params(**kw: Any) -> Any:
    """The user's own SamplingParams, as a caller of vLLM builds it."""
    from vllm import SamplingParams

    return SamplingParams(**kw)


@oracle_fn("vLLM's Request (reference.request_class)")
def request_class() -> type:
    from vllm.v1.request import Request

    return Request


def raw_request(**kw: Any) -> Any:
    """What fork code does: vLLM's Request constructor, no checks of its own; the keywords a
    release requires that the caller did not give are filled as fork code did (eos through
    0.16, ``structured_output_request`` on 0.10.2)."""
    cls = request_class()
    with oracle("a raw vLLM Request (reference.raw_request)"):
        params = inspect.signature(cls.__init__).parameters
        if "eos_token_id" in params:  # required through 0.16
            kw.setdefault("eos_token_id", 2)
        if "structured_output_request" in params:  # 0.10.2
            kw.setdefault("structured_output_request", None)
        return cls(**kw)


@oracle_fn("vLLM's RequestStatus (reference.request_status)")
def request_status(name: str) -> Any:
    from vllm.v1.request import RequestStatus

    return getattr(RequestStatus, name)


@oracle_fn("vLLM's kv_cache_utils (reference.kv_cache_utils)")
def kv_cache_utils() -> Any:
    return importlib.import_module("vllm.v1.core.kv_cache_utils")


@oracle_fn("reading vLLM's NONE_HASH from kv_cache_utils")
def none_hash() -> Any:
    return kv_cache_utils().NONE_HASH


@contextlib.contextmanager
def engine_none_hash(root: bytes) -> Iterator[None]:
    """vLLM's NONE_HASH set to ``root`` (what an in-process EngineCore's init_none_hash does),
    restored after."""
    before = none_hash()
    kcu = kv_cache_utils()
    kcu.NONE_HASH = root
    try:
        yield
    finally:
        kcu.NONE_HASH = before


@oracle_fn("vLLM's hash_block_tokens")
def hash_block_tokens(fn: Callable[[Any], bytes], parent: Any, tokens: list[int],
                      extra_keys: Any = None) -> bytes:
    return kv_cache_utils().hash_block_tokens(fn, parent, tokens, extra_keys)


@oracle_fn("vLLM's get_request_block_hasher")
def request_block_hasher(block_size: int, fn: Callable[[Any], bytes]) -> Callable[..., Any]:
    return kv_cache_utils().get_request_block_hasher(block_size, fn)


@oracle_fn("wrapping vLLM's init_none_hash in kv_cache_utils")
def wrap_init_none_hash(wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace vLLM's init_none_hash by ``wrapper(original)`` (the concurrency probe counts its
    calls)."""
    kcu = kv_cache_utils()
    kcu.init_none_hash = wrapper(kcu.init_none_hash)


@oracle_fn("vLLM's PrefixCachingHashAlgo (reference.offered_hash_algorithms)")
def offered_hash_algorithms() -> list[str]:
    from typing import get_args

    from vllm.config.cache import PrefixCachingHashAlgo

    return list(get_args(PrefixCachingHashAlgo))


@oracle_fn("vLLM's CacheConfig (reference.cache_config)")
def cache_config(**kw: Any) -> Any:
    from vllm.config import CacheConfig

    return CacheConfig(**kw)


def vllm_version() -> str:
    import vllm

    return vllm.__version__


@oracle_fn("vLLM's UniProcExecutor (reference.uniproc_executor_class)")
def uniproc_executor_class() -> type:
    try:  # 0.11+: the V1 UniProcExecutor
        from vllm.v1.executor.uniproc_executor import UniProcExecutor
    except ImportError:  # 0.10.2: v1.executor.abstract re-exports the V0 one
        from vllm.v1.executor.abstract import UniProcExecutor
    return UniProcExecutor


@oracle_fn("vLLM's AsyncModelRunnerOutput (reference.async_model_runner_output_class)")
def async_model_runner_output_class() -> type:
    from vllm.v1.outputs import AsyncModelRunnerOutput

    return AsyncModelRunnerOutput


@oracle_fn("vLLM's V1 GPUModelRunner (reference.v1_runner_class)")
def v1_runner_class() -> type:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def v2_runner_class() -> type:
    """Model Runner V2 (0.12+); its CUDA-only imports may fail on CPU (the caller skips)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return GPUModelRunner


@oracle_fn("vLLM's Executor and Worker (reference.executor_and_worker_classes)")
def executor_and_worker_classes() -> tuple[type, type]:
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.gpu_worker import Worker

    return Executor, Worker


def attr(module: str, name: str) -> Any:
    """``module.name`` of vLLM, for a test's one-off reference (a config loader, a registry)."""
    with oracle(f"vLLM's {module}:{name}"):
        return getattr(importlib.import_module(module), name)


def module(name: str) -> Any:
    with oracle(f"vLLM's module {name}"):
        return importlib.import_module(name)


def has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@oracle_fn("vLLM's prompt-logprobs containers (reference.prompt_logprobs_container)")
def prompt_logprobs_container(flat: bool, positions: list[tuple[list[int], list[float], int]],
                              k: int) -> Any:
    """Prompt logprobs as this release's output processor fills them: nothing at the first
    position, then per position (token ids, logprobs, rank of the first) the sequence's own
    token at its rank and the top ``k``. None where the release has no flat container."""
    try:
        from vllm.logprobs import append_logprobs_for_next_position, create_prompt_logprobs
    except ImportError:  # before vllm.logprobs had them: a list of {token: Logprob}, None first
        if flat:
            return None
        try:
            from vllm.logprobs import Logprob
        except ImportError:
            from vllm.sequence import Logprob
        return [None] + [{t: Logprob(logprob=lp, rank=rank if i == 0 else i) for i, (t, lp) in
                          enumerate(zip(ids, lps))} for ids, lps, rank in positions]
    out = create_prompt_logprobs(flat)
    for ids, lps, rank in positions:
        append_logprobs_for_next_position(out, ids, lps, [None] * len(ids), rank, k)
    return out
