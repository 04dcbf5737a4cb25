"""The adapter of the newest eras (``v0_17``: 0.17-0.28, ``v0_29``: 0.29+), and the base of the others.

Every vLLM symbol used here is declared in :mod:`vllm_compat.surface` and resolved through
:mod:`vllm_compat.resolve` (``sym("Request")``): at its known location, or where a newer vLLM moved it
(used, and reported by ``vllm-compat doctor --drift``); a symbol found nowhere, or a call
whose signature drifted, raises a :class:`~vllm_compat.errors.VllmDriftError` naming the
capability instead of vLLM's AttributeError / TypeError. Each function only touches symbols
that exist, with the same meaning, in every supported release (0.10.2 onward), except where
a function names the release it needs. An older era's module (``v0_10``, ``v0_11``) imports everything from here and
redefines what differs in its releases; the per-release drift that is too small for an
era of its own is handled here with a probe, commented with the vLLM change behind it.

What separates ``v0_17`` from ``v0_29`` is not code but behaviour the probes report: 0.29
seeds ``NONE_HASH`` from a fixed value for sha256 and makes Model Runner V2 the default.
"""

from __future__ import annotations

import dataclasses
import inspect
from concurrent.futures import Future
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
import vllm

from ..errors import ReturnTypeDriftError, UnsupportedFeatureError, VllmCompatError
from .. import resolve as _resolve
from ..resolve import check_call, module_of, sym

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

# The adapter function set (vllm_compat.adapters.AdapterAPI); an era module imports by name
# the ones its releases keep and redefines the rest.
__all__ = [
    "version", "probes", "hash_function", "hash_function_names", "init_none_hash",
    "current_none_hash", "request_block_hasher", "block_hashes", "attach_block_hasher",
    "new_request", "vllm_config", "kv_cache_config", "new_scheduler",
    "scheduler_hash_block_size", "schedule", "update_from_output", "has_unscheduled_tokens",
    "grammar_output", "model_runner_output", "run_model_step", "launch_model_step",
    "resolve_output", "collective_rpc", "runner_flavour", "check_step_target",
]

def _params(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def version() -> str:
    return vllm.__version__


# --------------------------------------------------------------------------- probes


def probes() -> dict[str, bool | None]:
    """Feature probes read from the installed vLLM, never from its version: True, False, or
    None when the probe cannot tell (what it reads is missing); see ``surface.PROBES``."""
    return _resolve.probe_values()


# --------------------------------------------------------------------------- hashing


def hash_function(name: str) -> Callable[[Any], bytes]:
    # 0.11 moved the hash helpers from vllm.utils to vllm.utils.hashing (the surface lists
    # both; v0_10 imports its own). The function must return bytes, as the hasher hashes them.
    return _resolve.check_hash_fn(name, sym("get_hash_fn_by_name")(name))


def hash_function_names() -> tuple[str, ...]:
    """The algorithm names ``get_hash_fn_by_name`` accepts in this release."""
    from typing import get_args

    return tuple(get_args(sym("PrefixCachingHashAlgo")))


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> bytes:
    """Run vLLM's ``init_none_hash`` and return the ``NONE_HASH`` it set, read from the module
    that holds it (beside ``init_none_hash``, wherever vLLM keeps the two)."""
    sym("init_none_hash")(hash_fn)
    root = current_none_hash()
    if not isinstance(root, bytes):
        raise ReturnTypeDriftError(
            capability="hashing", vllm_version=vllm.__version__, symbol="NONE_HASH",
            expected=f"init_none_hash to set {_none_hash_module().__name__}.NONE_HASH to bytes",
            found=f"{type(root).__name__}")
    return root


def _none_hash_module() -> Any:
    # the module of the NONE_HASH entry (beside init_none_hash) once resolved
    found = _resolve.lookup("NONE_HASH")
    return module_of("NONE_HASH") if found is not None else module_of("init_none_hash")


def current_none_hash() -> bytes | None:
    # NONE_HASH is only an annotation until init_none_hash runs (every release).
    return getattr(_none_hash_module(), "NONE_HASH", None)


def request_block_hasher(
    block_size: int, hash_fn: Callable[[Any], bytes], lookahead_tokens: int = 0
) -> Callable[[Request], list[Any]]:
    """vLLM's own per-request hasher, built exactly as ``EngineCore.__init__`` builds it."""
    get_request_block_hasher = sym("get_request_block_hasher")
    # 0.33.0 added num_hash_lookahead_tokens (EAGLE block-drop drafters); before it the
    # engine had no lookahead, so 0 is the only value that matches the engine there.
    if "num_hash_lookahead_tokens" in _params(get_request_block_hasher):
        check_call("get_request_block_hasher", get_request_block_hasher, 3, {})
        return get_request_block_hasher(block_size, hash_fn, lookahead_tokens)
    if lookahead_tokens:
        raise UnsupportedFeatureError(
            f"vLLM {vllm.__version__} has no num_hash_lookahead_tokens (added in 0.33.0)"
        )
    # 0.24.0 renamed the first parameter block_size -> hash_block_size: pass it positionally.
    check_call("get_request_block_hasher", get_request_block_hasher, 2, {})
    return get_request_block_hasher(block_size, hash_fn)


def block_hashes(request: Request) -> list[bytes]:
    return list(request.block_hashes)


def attach_block_hasher(request: Request, hasher: Callable[[Request], list[Any]]) -> None:
    """Bind a hasher to a Request built without one and hash its full blocks now."""
    # 0.16.0: Request stores `_block_hasher` and calls update_block_hashes() (vLLM
    # dropped the functools.partial to avoid a reference cycle); before, see else.
    if _resolve.get("Request.update_block_hashes") is not None:
        request._block_hasher = hasher
        request.block_hashes.clear()
        request.update_block_hashes()
    else:
        # 0.10.2-0.15.1: Request keeps partial(hasher, request) as get_hash_new_full_blocks.
        from functools import partial

        request.get_hash_new_full_blocks = partial(hasher, request)
        request.block_hashes = request.get_hash_new_full_blocks()


# --------------------------------------------------------------------------- requests

# Request parameters we set ourselves; anything else the caller passes must exist in
# this release's Request signature, or we say so instead of dropping it.
_OWN_REQUEST_PARAMS = {"request_id", "prompt_token_ids", "sampling_params", "pooling_params",
                       "eos_token_id", "block_hasher", "structured_output_request"}


def prepare_sampling_params(
    sampling_params: SamplingParams | None, eos_token_id: int | None
) -> SamplingParams:
    """Apply the eos token as the engine would, on a copy: the caller's params are never mutated."""
    if sampling_params is None:
        sp = sym("SamplingParams")(max_tokens=1)
    elif eos_token_id is not None:
        sp = sampling_params.clone()
    else:
        sp = sampling_params  # used as is, like the raw constructor (Request does not mutate it)
    if sp.max_tokens is None:
        # Request asserts max_tokens is set (every release); the engine fills it from
        # max_model_len, which a bare Request does not know.
        raise VllmCompatError("sampling_params.max_tokens must be set for a Request")
    if eos_token_id is not None:
        # What the engine's input processor does for every request: from 0.17 this is
        # also where the stop check reads eos from (sampling_params.eos_token_id).
        sp.update_from_generation_config({}, eos_token_id)
    return sp


@lru_cache(maxsize=None)
def _request_params() -> frozenset[str]:
    return frozenset(_resolve.params(sym("Request")) or ())


def _check_extra(extra: dict[str, Any]) -> None:
    accepted = _request_params()
    unknown = sorted(k for k in extra if k not in accepted or k in _OWN_REQUEST_PARAMS)
    if unknown:
        raise VllmCompatError(
            f"Request of vLLM {vllm.__version__} takes no parameter(s) {unknown}"
        )


def request_kwargs(
    request_id: str,
    prompt_token_ids: Sequence[int],
    sampling_params: SamplingParams | None,
    pooling_params: Any,
    eos_token_id: int | None,
    block_hasher: Callable[[Request], list[bytes]] | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Keywords every release's Request takes (per request: keep it lean, see bench/)."""
    if extra:
        _check_extra(extra)
    if pooling_params is None:
        sampling_params = prepare_sampling_params(sampling_params, eos_token_id)
    return {
        "request_id": request_id if type(request_id) is str else str(request_id),
        # A list is used as given: make_request passes its own validated copy.
        "prompt_token_ids": (prompt_token_ids if type(prompt_token_ids) is list
                             else list(prompt_token_ids)),
        "sampling_params": sampling_params,
        "pooling_params": pooling_params,
        "block_hasher": block_hasher,
        **extra,
    }


RequestKwargsHook = Callable[[dict[str, Any], "int | None"], None]


def request_factory(era_kwargs: RequestKwargsHook | None = None) -> Callable[..., Request]:
    """Build an era's ``new_request``; ``era_kwargs`` adds what only that era's Request takes."""

    def new_request(
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        sampling_params: SamplingParams | None = None,
        pooling_params: Any = None,
        eos_token_id: int | None = None,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        **extra: Any,
    ) -> Request:
        kw = request_kwargs(request_id, prompt_token_ids, sampling_params, pooling_params,
                            eos_token_id, block_hasher, extra)
        if era_kwargs is not None:
            era_kwargs(kw, eos_token_id)
        cls = sym("Request")
        # a new required parameter (or one we pass that is gone) is named, with the
        # workaround, before vLLM's TypeError (one cached set comparison per request)
        check_call("Request", cls, 0, kw)
        return cls(**kw)

    return new_request


def eos_in_request(kw: dict[str, Any], eos_token_id: int | None) -> None:
    # Request(eos_token_id=...) was required through 0.16: the stop check compared
    # against request.eos_token_id (0.17 moved it to sampling_params).
    kw["eos_token_id"] = eos_token_id


# 0.17+: no eos on Request; prepare_sampling_params put it in the sampling params.
new_request = request_factory()


# --------------------------------------------------------------------------- scheduler


def kv_cache_config(
    num_blocks: int,
    block_size: int,
    *,
    layer_names: Iterable[str] = ("model.layers.0.self_attn.attn",),
    num_kv_heads: int = 1,
    head_size: int = 64,
    dtype: torch.dtype = torch.float32,
) -> KVCacheConfig:
    """One full-attention KV group, as a dense decoder's engine would report it."""
    spec_kw: dict[str, Any] = dict(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    full_attention_spec = sym("FullAttentionSpec")
    # 0.10.2 had a required `use_mla` field on AttentionSpec (removed in 0.11).
    if "use_mla" in {f.name for f in dataclasses.fields(full_attention_spec)}:
        spec_kw["use_mla"] = False
    # Keywords only: AttentionSpec became kw_only in 0.14 and its fields keep moving.
    check_call("FullAttentionSpec", full_attention_spec, 0, spec_kw)
    spec = full_attention_spec(**spec_kw)
    group = sym("KVCacheGroupSpec")
    check_call("KVCacheGroupSpec", group, 2, {})
    # kv_cache_tensors stays empty: KVCacheTensor changed shape in 0.29 and the
    # scheduler never reads it.
    kw = dict(num_blocks=num_blocks, kv_cache_tensors=[],
              kv_cache_groups=[group(list(layer_names), spec)])
    kv_cache_config_cls = sym("KVCacheConfig")
    check_call("KVCacheConfig", kv_cache_config_cls, 0, kw)
    return kv_cache_config_cls(**kw)


def scheduler_class(vllm_config: VllmConfig) -> type:
    sc = vllm_config.scheduler_config
    # 0.11 added SchedulerConfig.get_scheduler_cls(); 0.10.2 had the `scheduler_cls`
    # qualname string (defaulting to the V0 scheduler path).
    if hasattr(sc, "get_scheduler_cls"):
        return sc.get_scheduler_cls()
    cls = getattr(sc, "scheduler_cls", None)
    if isinstance(cls, str) and cls.startswith("vllm.v1."):
        return sym("resolve_obj_by_qualname")(cls)
    if isinstance(cls, type):
        return cls
    if getattr(sc, "async_scheduling", False):
        return sym("AsyncScheduler")
    return sym("Scheduler")


def new_scheduler(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    *,
    log_stats: bool = False,
    include_finished_set: bool = False,
) -> Scheduler:
    """The Scheduler class the engine would pick, built with this release's arguments."""
    cache = vllm_config.cache_config
    if not cache.num_gpu_blocks:
        # Scheduler asserts num_gpu_blocks > 0 (an init=False field the engine fills).
        cache.num_gpu_blocks = kv_cache_config.num_blocks
    cls = scheduler_class(vllm_config)
    params = _resolve.params(cls) or {}
    block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    structured_output_manager = sym("StructuredOutputManager")
    check_call("StructuredOutputManager", structured_output_manager, 1, {})
    kw: dict[str, Any] = dict(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=structured_output_manager(vllm_config),
        include_finished_set=include_finished_set,
        log_stats=log_stats,
    )
    # 0.11 made `block_size` a required Scheduler argument (0.10.2 read cache_config).
    if "block_size" in params:
        kw["block_size"] = block_size
    # 0.20 added optional `hash_block_size` (None = block_size); the engine passes the
    # value from resolve_kv_cache_block_sizes, which equals block_size for one group.
    if "hash_block_size" in params:
        kw["hash_block_size"] = _hash_block_size(kv_cache_config, vllm_config, block_size)
    check_call("Scheduler", cls, 0, kw)
    return cls(**kw)


def _hash_block_size(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig, default: int) -> int:
    resolve = _resolve.get("resolve_kv_cache_block_sizes")
    # 0.20 added resolve_kv_cache_block_sizes (context parallelism scales the hash
    # block size); before it the hash block size was always the KV block size.
    if resolve is not None:
        return resolve(kv_cache_config, vllm_config)[1]
    return default


def scheduler_hash_block_size(scheduler: Scheduler) -> int:
    """The block size the scheduler's prefix cache hashes with."""
    pool = scheduler.kv_cache_manager.block_pool
    # BlockPool.hash_block_size exists from 0.12; before it hashing used block_size.
    return int(getattr(pool, "hash_block_size", None) or scheduler.block_size)


def schedule(scheduler: Scheduler, *, throttle_prefills: bool = False):
    # 0.24 added schedule(throttle_prefills=False); earlier releases take no argument.
    if "throttle_prefills" in _schedule_params(type(scheduler)):
        return scheduler.schedule(throttle_prefills=throttle_prefills)
    if throttle_prefills:
        raise UnsupportedFeatureError(
            f"Scheduler.schedule of vLLM {vllm.__version__} has no throttle_prefills (0.24+)"
        )
    return scheduler.schedule()


@lru_cache(maxsize=None)
def _schedule_params(cls: type) -> frozenset[str]:
    ps = _resolve.params(cls.schedule)
    if ps is not None and any(req for n, req in ps.items() if not n.startswith("*")):
        raise _resolve.signature_error(
            "Scheduler.schedule", new_required=[n for n, r in ps.items() if r and n[0] != "*"])
    return frozenset(ps or ())


def resolve_output(out: Any) -> Any:
    """A concrete ModelRunnerOutput from a Future / AsyncModelRunnerOutput / value."""
    if isinstance(out, Future):
        out = out.result()
    if isinstance(out, sym("AsyncModelRunnerOutput")):
        out = out.get_output()
    return out


def update_from_output(scheduler: Scheduler, scheduler_output: Any, model_runner_output: Any):
    out = resolve_output(model_runner_output)
    if not isinstance(out, sym("ModelRunnerOutput")):
        raise VllmCompatError(
            "update_from_output needs a ModelRunnerOutput, got "
            f"{type(out).__name__} (did execute_model return None without sample_tokens?)"
        )
    return scheduler.update_from_output(scheduler_output, out)


def grammar_output(scheduler: Scheduler, scheduler_output: Any) -> Any:
    """What EngineCore passes to sample_tokens: the grammar bitmask or None (0.11+)."""
    return scheduler.get_grammar_bitmask(scheduler_output)


def model_runner_output(
    req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]]
) -> ModelRunnerOutput:
    """A ModelRunnerOutput for a fabricated step (what vLLM's own scheduler tests do)."""
    model_runner_output_cls = sym("ModelRunnerOutput")
    fields = {f.name: f for f in dataclasses.fields(model_runner_output_cls)}
    kw: dict[str, Any] = dict(
        req_ids=list(req_ids),
        sampled_token_ids=_sampled_token_ids(fields["sampled_token_ids"], sampled_token_ids),
    )
    # 0.34 dropped req_id_to_index: its scheduler reads an output's requests by their place
    # in req_ids (vllm#23481 stopped reading the map in update_from_output)
    if "req_id_to_index" in fields:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    # 0.10-0.13: logprobs / prompt_logprobs_dict / pooler_output had no defaults (0.14
    # gave every field but the request maps one).
    required = {
        n for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    fillers: dict[str, Any] = {"logprobs": None, "prompt_logprobs_dict": {}, "pooler_output": []}
    for name in required - kw.keys():
        if name in fillers:
            kw[name] = fillers[name]
    check_call("ModelRunnerOutput", model_runner_output_cls, 0, kw)
    return model_runner_output_cls(**kw)


def _sampled_token_ids(field: dataclasses.Field, ids: Sequence[Sequence[int]]) -> list:
    # 0.11.x typed sampled_token_ids as list[np.ndarray] and the scheduler called
    # .tolist() on each entry; 0.12 went back to list[list[int]].
    if "ndarray" in str(field.type):
        import numpy as np

        return [np.asarray(list(t), dtype=np.int32) for t in ids]
    return [list(t) for t in ids]


# --------------------------------------------------------------------------- config


def _init_names(cls: type) -> set[str]:
    # vLLM configs are (pydantic) dataclasses whose __init__ signature can read as
    # (*args, **kwargs); __dataclass_fields__ also lists InitVars (SchedulerConfig 0.12+).
    fields = getattr(cls, "__dataclass_fields__", None)
    if fields:
        return {n for n, f in fields.items() if f.init}
    return set(_params(getattr(cls, "__init__")))


def _filtered(key: str, kw: dict[str, Any]) -> Any:
    cls = sym(key)
    accepted = _init_names(cls)
    kw = {k: v for k, v in kw.items() if k in accepted}
    check_call(key, cls, 0, kw)
    return cls(**kw)


def vllm_config(
    model: str,
    *,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    hash_algo: str = "sha256",
    num_gpu_blocks: int = 64,
    max_model_len: int = 1024,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 8,
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
) -> VllmConfig:
    """A real VllmConfig for driving the scheduler without an engine (CPU is fine).

    ``model`` is a local directory with a ``config.json``. No tokenizer is loaded and no
    hub is contacted.
    """
    mc_kw: dict[str, Any] = dict(
        model=model, tokenizer=model, skip_tokenizer_init=True, dtype=dtype,
        enforce_eager=True, max_model_len=max_model_len, seed=0,
        # 0.10.2: verify_async_output_proc asks the platform, and the CPU-side
        # UnspecifiedPlatform raises NotImplementedError unless this is off.
        use_async_output_proc=False,
    )
    model_config = _filtered("ModelConfig", mc_kw)
    cache_config = _filtered("CacheConfig", dict(
        block_size=block_size, enable_prefix_caching=enable_prefix_caching,
        prefix_caching_hash_algo=hash_algo,
    ))
    sc_kw: dict[str, Any] = dict(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
        async_scheduling=async_scheduling,
        # 0.12 made max_model_len and is_encoder_decoder InitVars of SchedulerConfig.
        is_encoder_decoder=False,
    )
    scheduler_config = _filtered("SchedulerConfig", sc_kw)
    # The PyPI wheel is a CUDA build: on a GPU-less box current_platform is
    # UnspecifiedPlatform and DeviceConfig("auto") cannot infer a device.
    device_config = sym("DeviceConfig")(device=device)
    cfg_kw = dict(model_config=model_config, cache_config=cache_config,
                  scheduler_config=scheduler_config, device_config=device_config)
    check_call("VllmConfig", sym("VllmConfig"), 0, cfg_kw)
    cfg = sym("VllmConfig")(**cfg_kw)
    cfg.cache_config.num_gpu_blocks = num_gpu_blocks
    return cfg


# --------------------------------------------------------------------------- workers


def runner_flavour(obj: Any) -> str:
    """'v1' or 'v2' for a worker / runner / executor / LLM, '' when it cannot be told."""
    runner = _find_runner(obj)
    if runner is None:
        return ""
    # Model Runner V2 lives in vllm.v1.worker.gpu.* (0.12+); V1 in gpu_model_runner.
    return "v2" if type(runner).__module__.startswith("vllm.v1.worker.gpu.") else "v1"


def _find_runner(obj: Any) -> Any:
    for path in ("model_runner", "worker.model_runner", "driver_worker.worker.model_runner",
                 "driver_worker.model_runner"):
        cur = obj
        for part in path.split("."):
            cur = getattr(cur, part, None)
            if cur is None:
                break
        if cur is not None:
            return cur
    is_runner = getattr(obj, "execute_model", None) is not None and getattr(obj, "model", None) is not None
    return obj if is_runner else None


def collective_rpc(
    target: Any,
    method: str | Callable[..., Any],
    *,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
    rank: int | None = None,
) -> Any:
    """Call ``method`` on every worker; a list (one entry per rank), or rank ``rank``'s value.

    ``target`` is an ``LLM``, ``LLMEngine``, engine-core client, ``EngineCore`` or an
    ``Executor``. Replies differ by executor and release (UniProc ``[x]`` vs
    ``single_value``, MP ``unique_reply_rank``, unresolved ``AsyncModelRunnerOutput``
    on the UniProc sync path before 0.24); this always gives plain values.
    """
    kw = dict(timeout=timeout, args=tuple(args), kwargs=dict(kwargs or {}))
    replies = target.collective_rpc(method, **kw)
    replies = resolve_output(replies)  # a Future when an executor hands one back
    if not isinstance(replies, list):
        # UniProc with single_value / MP with unique_reply_rank return a bare value.
        replies = [replies]
    replies = [resolve_output(r) for r in replies]
    if rank is None:
        return replies
    if not 0 <= rank < len(replies):
        raise VllmCompatError(f"rank {rank} out of range: {len(replies)} worker(s) replied")
    return replies[rank]


def step_methods(target: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``target``'s ``execute_model`` and ``sample_tokens`` (0.11+ split the step), both
    resolved before either is called: a target without the second phase (a vLLM that renamed
    it) is a MissingSymbolError naming the candidates, and no step is left half done."""
    return (_resolve.method(target, "Executor.execute_model"),
            _resolve.method(target, "Executor.sample_tokens"))


def check_step_target(target: Any) -> None:
    step_methods(target)


def run_model_step(target: Any, scheduler_output: Any, grammar_output: Any = None) -> ModelRunnerOutput:
    """``execute_model`` then, when it returns None, ``sample_tokens`` (vLLM 0.11+)."""
    execute_model, sample_tokens = step_methods(target)
    out = resolve_output(execute_model(scheduler_output))
    if out is None:
        out = sample_tokens(grammar_output)
    return _final_output(out)


def _final_output(out: Any) -> ModelRunnerOutput:
    out = resolve_output(out)
    if out is None:
        # The V2 runner returns None from sample_tokens when execute_model failed.
        raise VllmCompatError("model step produced no output (execute_model failed?)")
    if not isinstance(out, sym("ModelRunnerOutput")):
        raise VllmCompatError(f"model step returned {type(out).__name__}, not ModelRunnerOutput")
    return out


class LaunchedStep:
    """A model step whose forward has been launched and whose output may still be on its way.

    ``value`` is what the caller's ``between`` hook returned (called after ``execute_model``,
    while the runner still holds the step's state, e.g. the aux hidden states);
    :meth:`result` waits for and returns the final ``ModelRunnerOutput``."""

    __slots__ = ("scheduler_output", "value", "_out")

    def __init__(self, scheduler_output: Any, value: Any, out: Any) -> None:
        self.scheduler_output = scheduler_output
        self.value = value
        self._out = out

    def result(self) -> ModelRunnerOutput:
        return _final_output(self._out)


def launch_model_step(target: Any, scheduler_output: Any,
                      grammar_output_fn: Callable[[Any], Any] | None = None,
                      between: Callable[[Any], Any] | None = None) -> LaunchedStep:
    """0.11+: ``execute_model`` (launches the forward, returns None), ``between``, then
    ``sample_tokens`` without waiting for its output where the target can (an Executor's
    ``non_block=True``, 0.11.2+: a Future, resolved by ``LaunchedStep.result``)."""
    execute_model, fn = step_methods(target)
    out = resolve_output(execute_model(scheduler_output))
    value = between(scheduler_output) if between is not None else None
    if out is None:  # a step with tokens: the output comes from sample_tokens
        grammar = grammar_output_fn(scheduler_output) if grammar_output_fn is not None else None
        out = fn(grammar, non_block=True) if "non_block" in _params(fn) else fn(grammar)
    return LaunchedStep(scheduler_output, value, out)


def has_unscheduled_tokens(scheduler: Scheduler) -> bool:
    """Whether ``schedule()`` would find prompt tokens left: a running request whose computed
    tokens (advanced when scheduled) have not reached its length, or a waiting one with room
    to start (``max_num_seqs``). False is exact; True can still meet a full KV cache."""
    if any(r.num_computed_tokens < r.num_tokens for r in scheduler.running):
        return True
    # Waiting = unfinished minus running: the waiting queues differ by release (0.18.1 added
    # `skipped_waiting` beside `waiting`, 0.31 replaced it with `kv_holding_waiting`), the
    # count covers them all.
    running = len(scheduler.running)
    return (scheduler.get_num_unfinished_requests() > running
            and running < scheduler.max_num_running_reqs)


def call_step(target: Any, name: str, arg: Any) -> Any:
    return _resolve.method(target, f"Executor.{name}")(arg)
