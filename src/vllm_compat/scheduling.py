"""Scheduler-side helpers: config, KV-cache config, Scheduler, and its step calls."""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .detect import adapter

if TYPE_CHECKING:  # vLLM's classes, for the type checker only
    from .adapters.vllm_types import (
        KVCacheConfig,
        ModelRunnerOutput,
        Scheduler,
        SchedulerOutput,
        VllmConfig,
    )



def make_vllm_config(model: str | None = None, **kwargs: Any) -> VllmConfig:
    """A real ``VllmConfig`` for driving the scheduler without an engine.

    ``model`` is a local directory holding a ``config.json`` (weights and tokenizer are
    not needed); without one, a tiny Llama config is written to a temp dir. Keywords:
    ``block_size``, ``enable_prefix_caching``, ``hash_algo``, ``num_gpu_blocks``,
    ``max_model_len``, ``max_num_batched_tokens``, ``max_num_seqs``,
    ``enable_chunked_prefill``, ``async_scheduling`` (default False), ``device``, ``dtype``.
    """
    if model is None:
        model = write_tiny_llama_config(tempfile.mkdtemp(prefix="vllm-compat-model-"))
    return adapter().vllm_config(model, **kwargs)


def write_tiny_llama_config(directory: str | os.PathLike[str], **overrides: Any) -> str:
    """Only a ``config.json`` for a tiny Llama: enough for a real ``ModelConfig`` and
    scheduler (no weights, no tokenizer)."""
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
        num_hidden_layers=2, vocab_size=1024, max_position_embeddings=2048,
        rms_norm_eps=1e-5, torch_dtype="float32", bos_token_id=1, eos_token_id=2,
    )
    cfg.update(overrides)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(directory)


def make_kv_cache_config(num_blocks: int, block_size: int, *, layer_names: Iterable[str] = (
        "model.layers.0.self_attn.attn",), num_kv_heads: int = 1, head_size: int = 64,
        dtype: Any = None) -> KVCacheConfig:
    """A ``KVCacheConfig`` with one full-attention group of ``num_blocks`` blocks."""
    kw: dict[str, Any] = dict(layer_names=tuple(layer_names), num_kv_heads=num_kv_heads,
                              head_size=head_size)
    if dtype is not None:
        kw["dtype"] = dtype
    return adapter().kv_cache_config(num_blocks, block_size, **kw)


def make_scheduler(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None, *,
                   log_stats: bool = False, include_finished_set: bool = False) -> Scheduler:
    """The Scheduler class vLLM would pick for ``vllm_config``, with this release's arguments.

    Without ``kv_cache_config``, one group of ``cache_config.num_gpu_blocks`` blocks of
    ``cache_config.block_size`` is used.
    """
    if kv_cache_config is None:
        cc = vllm_config.cache_config
        kv_cache_config = make_kv_cache_config(cc.num_gpu_blocks or 64, cc.block_size)
    return adapter().new_scheduler(vllm_config, kv_cache_config, log_stats=log_stats,
                                   include_finished_set=include_finished_set)


def schedule(scheduler: Scheduler, *, throttle_prefills: bool = False) -> SchedulerOutput:
    """``scheduler.schedule()``; ``throttle_prefills`` exists from vLLM 0.24 only."""
    return adapter().schedule(scheduler, throttle_prefills=throttle_prefills)


def update_from_output(scheduler: Scheduler, scheduler_output: SchedulerOutput,
                       model_runner_output: Any) -> Any:
    """``scheduler.update_from_output`` after resolving Futures / async outputs."""
    return adapter().update_from_output(scheduler, scheduler_output, model_runner_output)


def make_model_runner_output(req_ids: Sequence[str],
                             sampled_token_ids: Sequence[Sequence[int]]) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` for ``req_ids``; give ``[]`` for a request still mid-prefill."""
    return adapter().model_runner_output(req_ids, sampled_token_ids)


def grammar_output(scheduler: Scheduler, scheduler_output: SchedulerOutput) -> Any:
    """What ``sample_tokens`` needs: the grammar bitmask, or None (always None on 0.10)."""
    return adapter().grammar_output(scheduler, scheduler_output)
