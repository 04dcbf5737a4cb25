"""Co-located online training: the engine and the trainer in one process on one device.

The engine gets a fixed KV-cache budget (vLLM's ``kv_cache_memory_bytes``) instead of a
share of the device's memory, so the memory left to the trainer is known before either
starts. :func:`memory_plan` adds up what both will hold, :func:`open_colocated` prints it,
refuses (:class:`PlacementError`) when it does not fit, and only then loads the engine, in
this process or (``engine_process``) in a spawned one on the same device.

The plan is an estimate, stated as one: the target's weights are its checkpoint files; the
draft, its gradients and AdamW's moments are counted parameter by parameter; the training
step's activations are counted for the longest of the first records (the draft's logits per
TTT step, forward and backward, and the target's labels once); the engine's own
activations and CUDA graphs are a reserve (``ENGINE_RESERVE``), since vLLM profiles them only
once it starts.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import VllmCompatError
from ..extract import fp8
from ..target import TargetInfo
from .model import TARGET_ROWS_PER_MATMUL

GIB = 1 << 30
ENGINE_RESERVE = 2 * GIB  # vLLM's activations, CUDA graphs, NCCL buffers: profiled at start
DEFAULT_KV_SHARE = 0.10  # a co-located vLLM engine's KV cache when none is given
MEMORY_PLAN = "memory_plan.json"


class PlacementError(VllmCompatError, ValueError):
    """The co-located placement does not fit on the device."""


@dataclass
class MemoryPlan:
    device: str
    limit_bytes: int | None  # what the placement may use (None: not checked)
    weights_bytes: int  # the target's weights as the engine holds them
    kv_cache_bytes: int
    engine_reserve_bytes: int
    draft_bytes: int  # trainable draft parameters (fp32) + frozen embedding and target head
    optimizer_bytes: int  # gradients + AdamW's two moments (fp32)
    activation_bytes: int  # one training step, estimated for the longest sampled record
    tokens_per_step: int

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.engine_reserve_bytes
                + self.draft_bytes + self.optimizer_bytes + self.activation_bytes)

    @property
    def fits(self) -> bool:
        return self.limit_bytes is None or self.total_bytes <= self.limit_bytes

    def report(self) -> str:
        def g(b: int) -> str:
            return f"{b / GIB:8.2f} GiB" if b >= GIB // 10 else f"{b / (1 << 20):8.2f} MiB"

        limit = "not checked" if self.limit_bytes is None else g(self.limit_bytes).strip()
        rows = [("target weights", self.weights_bytes), ("KV cache", self.kv_cache_bytes),
                ("engine reserve", self.engine_reserve_bytes), ("draft", self.draft_bytes),
                ("optimizer + grads", self.optimizer_bytes),
                (f"activations ({self.tokens_per_step} tok/step)", self.activation_bytes)]
        lines = [f"co-located memory plan on {self.device} (estimate; limit {limit}):"]
        lines += [f"  {name:<32}{g(b)}" for name, b in rows]
        lines.append(f"  {'total':<32}{g(self.total_bytes)}")
        return "\n".join(lines)


def _checkpoint_bytes(target: TargetInfo) -> int:
    return sum(p.stat().st_size for p in Path(target.path).glob("*.safetensors"))


def _element_bytes(target: TargetInfo) -> int:
    name = str(target.config.get("torch_dtype") or target.text_config.get("torch_dtype") or "bfloat16")
    return 4 if name.removeprefix("torch.") == "float32" else 2


def device_limit(device: torch.device) -> int | None:
    """The memory of ``device``: a CUDA device's total, else None (host memory: not checked)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return None


def draft_parameter_counts(draft_config: Any) -> tuple[int, int]:
    """``(trainable, frozen)`` parameters of the draft, counted on the meta device."""
    from .model import Eagle3Draft

    with torch.device("meta"):
        draft = Eagle3Draft(draft_config)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in draft.parameters() if not p.requires_grad)
    return trainable, frozen


def memory_plan(*, device: torch.device, target: TargetInfo, backend: str, draft_config: Any,
                batch_size: int, longest_record: int, ttt_steps: int,
                kv_cache_bytes: int | None, limit_bytes: int | None) -> MemoryPlan:
    on_gpu = device.type == "cuda"
    files = _checkpoint_bytes(target)
    # the transformers backend computes in float32; vLLM holds the checkpoint's dtype
    weights = files if backend == "vllm" else files * 4 // _element_bytes(target)
    if backend == "vllm":
        kv = kv_cache_bytes if kv_cache_bytes is not None else int(DEFAULT_KV_SHARE * (limit_bytes or 0))
    else:
        kv = 0  # one prompt per forward, its cache freed after it
    trainable, frozen = draft_parameter_counts(draft_config)
    head = target.vocab_size * target.hidden_size + target.hidden_size  # TargetHead, fp32
    tokens = batch_size * longest_record
    dc = draft_config
    # per TTT step: the draft's logits and float32 log-softmax kept for backward, and the
    # layer's activations; once per batch: the target's labels over the draft vocabulary and
    # one piece of its whole-vocabulary logits (model.target_labels; never all 163,840 ids of
    # Kimi-K2.5 at once, as this estimate counted them per step before)
    per_token = ttt_steps * (2 * dc.draft_vocab_size * 4 * 2 + 24 * dc.hidden_size * 4)
    per_token += (dc.draft_vocab_size + min(TARGET_ROWS_PER_MATMUL, dc.target_vocab_size)) * 4
    per_token += (len(dc.aux_layer_ids) + 1) * dc.hidden_size * 4 * 2  # the states, fp32 copies
    return MemoryPlan(
        device=str(device), limit_bytes=limit_bytes, weights_bytes=weights, kv_cache_bytes=kv,
        engine_reserve_bytes=ENGINE_RESERVE if (backend == "vllm" and on_gpu) else 0,
        draft_bytes=4 * (trainable + frozen + head), optimizer_bytes=4 * 3 * trainable,
        activation_bytes=tokens * per_token, tokens_per_step=tokens)


def _longest_of_first(records: Any, n: int = 256) -> int:
    return max((int(records[i][0].shape[0]) for i in range(min(n, len(records)))), default=1)


def open_colocated(cfg: Any, online: Any, target: TargetInfo, aux: tuple[int, ...],
                   device: torch.device, records: Any) -> Any:
    """Print the memory plan (and write it to ``memory_plan.json`` in the output directory),
    refuse when it does not fit, then start the extractor in this process."""
    from ..extract import HiddenStatesExtractor
    from .data import Manifest
    from .training import draft_config_for
    from .vocab import VocabMapping

    class _Shape:  # what draft_config_for reads of a dataset
        manifest = Manifest(target.hidden_size, list(aux), target.num_hidden_layers,
                            online.states_dtype, target=target.manifest_entry())
        dir = cfg.dataset

    dcfg = draft_config_for(cfg.target, _Shape(), VocabMapping.load(cfg.vocab),
                            norm_before_residual=cfg.norm_before_residual, **cfg.draft_overrides)
    limit = online.memory_limit_bytes if online.memory_limit_bytes is not None else device_limit(device)
    plan = memory_plan(device=device, target=target, backend=online.backend, draft_config=dcfg,
                       batch_size=cfg.batch_size, longest_record=_longest_of_first(records),
                       ttt_steps=cfg.ttt_steps, kv_cache_bytes=online.kv_cache_memory_bytes,
                       limit_bytes=limit)
    print(plan.report(), file=sys.stderr)
    out = Path(cfg.output_dir)
    (out / MEMORY_PLAN).write_text(json.dumps(dict(asdict(plan), total_bytes=plan.total_bytes), indent=1))
    if not plan.fits:
        assert plan.limit_bytes is not None
        raise PlacementError(
            f"the co-located placement needs about {plan.total_bytes / GIB:.1f} GiB on {device} "
            f"(target weights {plan.weights_bytes / GIB:.1f}, KV cache {plan.kv_cache_bytes / GIB:.1f}, "
            f"draft + optimizer {(plan.draft_bytes + plan.optimizer_bytes) / GIB:.1f}, activations "
            f"{plan.activation_bytes / GIB:.1f}); {plan.limit_bytes / GIB:.1f} GiB are available. Use the "
            "split placement (--engine-devices 1: the engine on other GPUs of this host, the "
            "trainer here), or a smaller KV budget (--kv-cache-memory-bytes), batch size or draft")
    if online.engine_process:
        from .split_engine import SplitEngine

        return SplitEngine(target.path, [*aux, target.num_hidden_layers], online,
                           kv_cache_bytes=plan.kv_cache_bytes, device=device)
    kw: dict[str, Any] = dict(online.extractor_kwargs)
    if fp8.is_fp8(online.states_dtype):
        kw["states_dtype"] = fp8.FP8_DTYPE  # encoded where the states are (the GPU)
    if online.backend == "transformers":
        kw.setdefault("device", str(device))
        return HiddenStatesExtractor(target, layer_ids=[*aux, target.num_hidden_layers],
                                     backend="transformers", **kw)
    if plan.kv_cache_bytes:
        kw.setdefault("kv_cache_memory_bytes", plan.kv_cache_bytes)
    if online.gpu_memory_utilization is not None:
        kw.setdefault("gpu_memory_utilization", online.gpu_memory_utilization)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the trainer's CUDA context exists
    return HiddenStatesExtractor(target, layer_ids=[*aux, target.num_hidden_layers], **kw)
