"""vLLM side of ``eagle3 evaluate`` and self-distillation: one ``LLM`` per configuration,
greedy generation from token ids, and the engine's metrics snapshot (imports vLLM).

Written against vLLM 0.26.0: ``LLM(..., speculative_config={"method": "eagle3" | "ngram",
...}, disable_log_stats=False)`` (``LLM`` turns stats off unless told otherwise, and
``LLM.get_metrics()`` asserts they are on); ``get_metrics()`` returns the in-process
Prometheus registry as ``vllm.v1.metrics.reader`` ``Counter`` / ``Vector`` / ``Gauge`` /
``Histogram`` objects. The counters are cumulative for the engine, so callers take
differences around each measured ``generate`` (:mod:`vllm_compat.eagle3.evaluate`). The pure
logic lives there; this module only drives the engine.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import vllm

from ..resolve import check_call, get, sym

if TYPE_CHECKING:
    from vllm import LLM


def version() -> str:
    return vllm.__version__


def open_llm(
    model: str,
    *,
    speculative_config: Mapping[str, Any] | None = None,
    enforce_eager: bool = False,
    gpu_memory_utilization: float = 0.25,
    max_model_len: int | None = None,
    seed: int = 0,
    log_stats: bool = True,
    **kwargs: Any,
) -> LLM:
    """An ``LLM`` on ``model`` (a local directory); ``speculative_config`` as vLLM takes it, e.g.
    ``{"method": "eagle3", "model": draft_dir, "num_speculative_tokens": 3}`` or
    ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}``."""
    args: dict[str, Any] = {"model": model, "enforce_eager": enforce_eager,
                            "gpu_memory_utilization": gpu_memory_utilization, "seed": seed,
                            "disable_log_stats": not log_stats}
    if max_model_len is not None:
        args["max_model_len"] = max_model_len
    if speculative_config is not None:
        args["speculative_config"] = dict(speculative_config)
    args.update(kwargs)
    llm_cls = sym("LLM")  # vLLM's LLM, resolved through vllm_compat.surface
    check_call("LLM", llm_cls, 0, args)
    return llm_cls(**args)


def generate(
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    seeds: Sequence[int] | None = None,
    top_p: float = 1.0,
) -> list[list[int]]:
    """Continuations (token ids) of token-id prompts, in input order: greedy, or sampled at
    ``temperature`` (within the ``top_p`` nucleus) with one seed per prompt (``seeds``), so a
    run can be repeated."""
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("sampling needs one seed per prompt")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")

    def params(seed: int | None) -> Any:
        return sym("SamplingParams")(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                                     detokenize=False, seed=seed, top_p=top_p if temperature > 0 else 1.0)

    sp = [params(s) for s in seeds] if temperature > 0 and seeds is not None else params(None)
    tokens_prompt = sym("TokensPrompt")
    outs = llm.generate([tokens_prompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def timed_generate(llm: LLM, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                   ignore_eos: bool = True, temperature: float = 0.0,
                   seeds: Sequence[int] | None = None, top_p: float = 1.0) -> tuple[list[list[int]], float]:
    """:func:`generate` and its wall time. ``generate`` returns once the outputs are on the host,
    so no device synchronisation is needed (and none is done: touching CUDA in this process
    would force vLLM to spawn rather than fork its engine processes)."""
    t0 = time.perf_counter()
    out = generate(llm, prompts, max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=temperature, seeds=seeds,
                   top_p=top_p)
    return out, time.perf_counter() - t0


def prompt_logprobs(llm: LLM, sequences: Sequence[Sequence[int]], *,
                    k: int) -> list[list[dict[int, float] | None]]:
    """The target's top-``k`` logprobs (raw, at temperature 1) at every position of each
    token-id sequence: ``[i][t]`` is token -> logprob for the token at position ``t`` given
    the ones before it (None at position 0). vLLM adds the sequence's own token where it is
    not among the top ``k``; it is left out, so every row holds exactly the top ``k``."""
    params = sym("SamplingParams")(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    tokens_prompt = sym("TokensPrompt")
    outs = llm.generate([tokens_prompt(prompt_token_ids=list(s)) for s in sequences], params,
                        use_tqdm=False)

    def top(row: Any) -> dict[int, float] | None:
        if not row:  # the first position: None in a list, {} in vLLM's FlatLogprobs
            return None
        ranked = sorted(((float(lp.logprob), int(t)) for t, lp in row.items()), reverse=True)[:k]
        return {t: lp for lp, t in ranked}

    missing = [i for i, o in enumerate(outs) if o.prompt_logprobs is None]
    if missing:  # asked for above: an engine that drops them must not pass for an empty row
        raise RuntimeError(f"vLLM returned no prompt logprobs for sequences {missing[:8]}")
    return [[top(row) for row in o.prompt_logprobs or ()] for o in outs]


def metrics(llm: LLM) -> list[Any]:
    """``LLM.get_metrics()``: a snapshot of the engine's (cumulative) Prometheus metrics."""
    return list(llm.get_metrics())


def speculative_summary(llm: LLM) -> dict[str, Any] | None:
    """What the engine built for speculation (method, K, draft model), for the record."""
    sc = getattr(llm.llm_engine.vllm_config, "speculative_config", None)
    if sc is None:
        return None
    out = {"method": getattr(sc, "method", None), "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None)}
    dmc = getattr(sc, "draft_model_config", None)
    if dmc is not None:
        out["draft_model"] = getattr(dmc, "model", None)
        out["draft_architectures"] = list(getattr(dmc.hf_config, "architectures", None) or [])
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        out[key] = getattr(sc, key, None)
    return out


def engine_in_process(llm: LLM) -> bool:
    """Whether the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    the extractor's engine) rather than in a process of its own (vLLM's default for ``LLM``)."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None) is not None


def in_process_model(llm: LLM) -> Any | None:
    """The rank-0 model of an in-process engine core (None when the core runs elsewhere)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    worker = getattr(getattr(core, "model_executor", None), "driver_worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return None
    get = getattr(runner, "get_model", None)  # unwraps a CUDA-graph wrapper
    with contextlib.suppress(Exception):
        return get() if callable(get) else runner.model
    return getattr(runner, "model", None)


def unpin_compiled_model(model: Any) -> int:
    """Remove the dynamo bytecode hooks that vLLM's compiled modules registered: each holds
    its module, so the model (weights, CUDA graphs) outlives its engine in this process.
    Returns how many were removed."""
    modules = list(model.modules()) if callable(getattr(model, "modules", None)) else []
    removed = 0
    for m in modules:
        # 0.25.1+: TorchCompileWithNoGuardsWrapper keeps the hook's handle (its cleanup())
        handle = vars(m).get("_bytecode_hook_handle")
        if handle is not None:
            handle.remove()
            m._bytecode_hook_handle = None
            removed += 1
    # before 0.25.1 the wrapper dropped the handle: find its hooks in dynamo's registry
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    hooks = getattr(convert_frame, "_bytecode_hooks", None)
    if isinstance(hooks, dict) and modules:
        ids = {id(m) for m in modules}
        for key, hook in list(hooks.items()):
            if id(getattr(hook, "__self__", None)) in ids:
                del hooks[key]
                removed += 1
    return removed


def reset_cuda_graph_pool() -> None:
    """Forget vLLM's process-wide CUDA-graph pool handle (``Platform._global_graph_pool``,
    0.10.2-0.34: created once, kept on the platform class). Once the graphs of an engine that
    captured into it are gone, PyTorch releases the pool; the next engine of the process would
    capture into the released pool and fail in the caching allocator (``use_count > 0
    INTERNAL ASSERT FAILED``). After this, the next engine gets a pool of its own."""
    current_platform = get("current_platform")
    if current_platform is None:
        return
    for klass in type(current_platform).__mro__:
        if "_global_graph_pool" in vars(klass):
            klass._global_graph_pool = None


def shutdown_engine(llm: LLM) -> None:
    """Stop the engine core (its process, or the in-process executor's workers)."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def free_gpu_memory() -> None:
    """Once the caller holds no reference to the ``LLM``: what vLLM's own tests run between
    LLMs. ``cleanup_dist_env_and_memory`` undoes the ``gc.freeze()`` of an in-process engine
    core (0.16+) before it collects, so the frozen engine objects are freed too."""
    gc.collect()
    cleanup = get("cleanup_dist_env_and_memory")
    with contextlib.suppress(Exception):
        if cleanup is not None:
            cleanup()
    gc.collect()
    with contextlib.suppress(Exception):
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            # PyTorch keeps a cuBLAS workspace (32 MiB on Hopper) per stream that ran a matmul,
            # for the life of the process: each compiled engine captures on streams of its own
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()


def release_llm(llm: LLM) -> None:
    """Shut ``llm`` down and detach what keeps an in-process engine's GPU memory alive beyond
    the caller's last reference (compiled-module hooks, the CUDA-graph pool handle). The
    memory itself is freed by :func:`free_gpu_memory` once that reference is dropped."""
    model = in_process_model(llm)
    shutdown_engine(llm)
    if model is not None:
        unpin_compiled_model(model)
        del model
        reset_cuda_graph_pool()


def close_llm(llm: LLM | None) -> None:
    """Shut the engine down and give its GPU memory back. An engine core in its own process
    (vLLM's default) gives it back when that process exits; an in-process one once the
    caller's last reference to ``llm`` is gone (call :func:`free_gpu_memory` after dropping
    it). One engine per process is the safe use: tear-down leaves compile and allocator state
    behind, so several engines in a row belong in processes of their own
    (:func:`vllm_compat.isolation.run_isolated`)."""
    if llm is None:
        return
    release_llm(llm)
    del llm
    free_gpu_memory()
