"""vLLM side of hidden-state extraction (the only extraction module that imports vLLM).

Loaded by :mod:`vllm_compat.extract` through ``vllm_compat.adapters.load("_extract")``.
One module for every release: each branch is chosen by a feature probe, with a comment
naming the release / change behind it (see ``vllm-api-drift.md`` E.1-E.4 and F.1).

Capture modes (layer ids follow :mod:`vllm_compat.extract.layers`: k = state entering
decoder layer k, L = final pre-norm state):

* ``"aux"``: vLLM's own EAGLE-3 aux-hidden-state path. Right after the model is loaded
  (inside the runner's ``load_model``, before the profile run, torch.compile and CUDA-graph
  capture) we call ``model.set_aux_hidden_state_layers(ids)`` and set the runner's
  ``use_aux_hidden_state_outputs``; the compiled graph then returns the aux states, which
  we read from ``runner.execute_model_state.aux_hidden_states`` between ``execute_model``
  and ``sample_tokens``. Works under CUDA graphs.
* ``"hooks"``: forward(-pre) hooks on the decoder layers (``hidden_states + residual`` as
  it enters layer k; the last layer's output for L). Python hooks do not run under CUDA
  graph replay or inside a compiled graph, so this mode forces ``enforce_eager=True``.
  Used when the model has no aux path or its aux path cannot express a requested id.
* ``"native"`` (0.17.1+): ``speculative_config.method="extract_hidden_states"`` with
  ``ExampleHiddenStatesConnector``; refuses MLA verifiers (the hidden-state KV group cannot
  be isolated), so MLA models fall back to ``"aux"``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import vllm
from packaging.version import Version
from vllm import LLM, SamplingParams

from vllm_compat.extract.ordering import BatchLayout, split_batch
from vllm_compat.rpc import collective_rpc, runner_flavour
from vllm_compat.requests import make_request
from vllm_compat.detect import detect
from vllm_compat.step import StepPipeline

from ._serve import free_gpu_memory, shutdown_engine

VLLM_VERSION = Version(Version(vllm.__version__).base_version)

# 0.18.1: EagleModelMixin (index 0 = embeddings, index L = last-layer output) for
# Llama/Qwen2/Qwen3/Qwen3Moe inner models. Absent before.
try:
    from vllm.model_executor.models.interfaces import EagleModelMixin  # type: ignore
except ImportError:  # <= 0.17.1
    EagleModelMixin = None  # type: ignore[assignment,misc]

try:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2Model
except ImportError:  # pragma: no cover - present in every supported release
    DeepseekV2ForCausalLM = DeepseekV2Model = None  # type: ignore[assignment,misc]

# The runner classes whose load_model we wrap while the LLM is being built.
_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")

# What the wrapped load_model should configure (set only while an LLM is being built; a
# forked TP worker inherits it).
_PENDING: dict[str, Any] | None = None
# Spawned TP workers inherit the environment, not _PENDING: the layer ids travel in this
# variable, and AuxWorkerExtension (vLLM's worker_extension_cls, imported by every worker
# before load_model) makes the worker import this module, which wraps load_model.
_ENV_AUX = "VLLM_COMPAT_AUX_LAYERS"


# --------------------------------------------------------------------------- planning


def _model_class(model_path: str, cfg: Mapping[str, Any]) -> type | None:
    from vllm.model_executor.models.registry import ModelRegistry
    for arch in cfg.get("architectures") or ():
        # _try_load_model_cls(arch) exists with this signature 0.10.2-0.33.0.
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is not None:
            return cls
    return None


def native_aux_ids(model_cls: type | None, num_layers: int) -> frozenset[int]:
    """The ids vLLM's own aux path can return for this model class on this release."""
    L = num_layers
    if model_cls is None or not callable(getattr(model_cls, "set_aux_hidden_state_layers", None)):
        return frozenset()
    mod = sys.modules.get(model_cls.__module__)
    if EagleModelMixin is not None and mod is not None and any(
            isinstance(o, type) and issubclass(o, EagleModelMixin) and o is not EagleModelMixin
            and o.__module__ == mod.__name__ for o in vars(mod).values()):
        # 0.18.1+: _maybe_add_hidden_state(aux, 0, ...) before the loop, idx + 1 after
        # each layer: 0..L all work.
        return frozenset(range(0, L + 1))
    if DeepseekV2ForCausalLM is not None and issubclass(model_cls, DeepseekV2ForCausalLM):
        # DeepseekV2Model: `if idx in aux: aux.append(hidden_states + residual)` before
        # layer idx, residual is None at idx 0 (TypeError), so 0 is out. The end_layer
        # capture (index L) came with vllm#46973 in 0.25.1.
        top = L + 1 if VLLM_VERSION >= Version("0.25.1") else L
        return frozenset(range(1, top))
    # Pre-0.18.1 Llama-style loops: before layer idx, `hidden_states + residual` (0 fails,
    # L is never reached). Conservative for any other SupportsEagle3 model.
    return frozenset(range(1, L))


def is_mla_config(cfg: Mapping[str, Any]) -> bool:
    tc = cfg.get("text_config") if "kv_lora_rank" not in cfg else cfg
    return bool((tc or {}).get("kv_lora_rank"))


@dataclasses.dataclass(frozen=True)
class Plan:
    mode: str                      # "aux" | "hooks" | "native"
    layer_ids: tuple[int, ...]     # requested order
    native_ids: tuple[int, ...]    # sorted, what the model is configured with (aux/native)
    enforce_eager: bool
    model_cls: str
    note: str = ""


def plan(model_path: str, cfg: Mapping[str, Any], layer_ids: Sequence[int], num_layers: int,
         *, backend: str, enforce_eager: bool) -> Plan:
    cls = _model_class(model_path, cfg)
    name = cls.__name__ if cls is not None else "?"
    ids = tuple(layer_ids)
    srt = tuple(sorted(set(ids) - {0}))
    supported = native_aux_ids(cls, num_layers)
    # 0.10.2: execute_model is the whole step and the runner keeps no execute_model_state
    # (the aux states are dropped inside it): only hooks can see them (drift map E.2).
    if VLLM_VERSION < Version("0.11.2"):
        supported = frozenset()
    if supported:
        # id 0 (embeddings) is never taken from vLLM's aux list: EagleModelMixin's entry 0
        # is the embeddings tensor itself, which the first fused add-RMSNorm then updates
        # in place as the residual (seen on 0.26.0, eager: rel. error 3.0 vs HF). We
        # recompute it with the model's own embed function in _worker_collect instead.
        supported = supported | {0}
    note = ""
    if backend == "native":
        if VLLM_VERSION < Version("0.17.1"):
            raise ValueError(f"backend='native' needs vLLM 0.17.1+ (extract_hidden_states); "
                             f"installed {vllm.__version__}")
        if is_mla_config(cfg):
            note = ("backend='native' refuses MLA models (ExampleHiddenStatesConnector cannot "
                    "isolate the hidden-state KV group: 'MLA verifiers are unsupported'); "
                    "falling back to backend='aux'")
            warnings.warn(note, stacklevel=3)
            backend = "auto"
        elif not set(ids) <= supported:
            raise ValueError(f"backend='native': {name} on vLLM {vllm.__version__} cannot "
                             f"return layer ids {sorted(set(ids) - supported)}")
        elif 0 in ids:
            raise ValueError(
                "backend='native' cannot return layer id 0: vLLM's aux entry 0 is the "
                "embeddings tensor that the first fused add-RMSNorm updates in place as the "
                "residual; use backend='auto' (it recomputes the embeddings)")
        else:
            return Plan("native", ids, srt, enforce_eager, name)
    if backend in ("auto", "aux") and set(ids) <= supported:
        return Plan("aux", ids, srt, enforce_eager, name, note)
    if backend == "aux":
        raise ValueError(
            f"backend='aux': vLLM {vllm.__version__}'s aux path of {name} cannot return layer "
            f"ids {sorted(set(ids) - supported)}; use backend='auto' or 'hooks'")
    if backend not in ("auto", "hooks"):
        raise ValueError(f"unknown backend {backend!r}: auto, aux, hooks or native")
    why = ("backend='hooks'" if backend == "hooks" else
           f"{name}'s aux path on vLLM {vllm.__version__} cannot return "
           f"{sorted(set(ids) - supported)}")
    msg = f"{why}: capturing with forward hooks"
    if not enforce_eager:
        msg += ", which do not run under torch.compile / CUDA graphs, so enforce_eager=True is forced"
        warnings.warn(msg, stacklevel=3)
    if backend == "auto" or not enforce_eager:  # say why auto chose hooks, even when eager anyway
        note = (note + "; " if note else "") + msg
    return Plan("hooks", ids, (), True, name, note)


# --------------------------------------------------------------------------- worker side


def _inner_model(model: Any) -> Any:
    lm = model.get_language_model() if callable(getattr(model, "get_language_model", None)) \
        else getattr(model, "language_model", model)
    return getattr(lm, "model", lm)


def _enable_aux(runner: Any, ids: tuple[int, ...]) -> None:
    model = runner.model
    inner = _inner_model(model)
    L = len(getattr(inner, "layers", ()))
    is_mixin = EagleModelMixin is not None and isinstance(inner, EagleModelMixin)
    # Cross-check of plan(): the class-level guess must match the loaded inner model.
    ds_final = (DeepseekV2Model is not None and isinstance(inner, DeepseekV2Model)
                and VLLM_VERSION >= Version("0.25.1"))
    if L in ids and not (is_mixin or ds_final):
        raise RuntimeError(f"{type(inner).__name__}'s aux path cannot return id {L} (final)")
    model.set_aux_hidden_state_layers(tuple(ids))
    runner.use_aux_hidden_state_outputs = True
    runner._vllm_compat_aux = tuple(ids)


def _wrap_load_model(orig: Any) -> Any:
    @functools.wraps(orig)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        ids = (_PENDING or {}).get("aux")
        if not ids and os.environ.get(_ENV_AUX):
            ids = tuple(int(x) for x in os.environ[_ENV_AUX].split(","))
        if ids:
            _enable_aux(self, tuple(ids))
        return out
    load_model._vllm_compat_orig = orig  # type: ignore[attr-defined]
    return load_model


def _patch_runners() -> list[tuple[type, Any]]:
    patched: list[tuple[type, Any]] = []
    import importlib
    for modname in _RUNNER_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:  # V2 runner: 0.12.0+
            continue
        cls = getattr(mod, "GPUModelRunner", None)
        if cls is None or "load_model" not in vars(cls):
            continue
        orig = vars(cls)["load_model"]
        if getattr(orig, "_vllm_compat_orig", None) is not None:
            continue  # already wrapped (worker process)
        setattr(cls, "load_model", _wrap_load_model(orig))
        patched.append((cls, orig))
    return patched


class AuxWorkerExtension:
    """Empty ``worker_extension_cls``: importing it in a worker wraps load_model (see below)."""


if os.environ.get(_ENV_AUX):  # a worker process of an extraction engine (TP > 1, spawn)
    _patch_runners()


@contextlib.contextmanager
def _aux_configured(ids: tuple[int, ...] | None) -> Iterator[None]:
    """Wrap the runners' load_model so aux layers are set before warm-up / compile."""
    global _PENDING
    patched = _patch_runners()
    _PENDING = {"aux": ids} if ids else None
    try:
        yield
    finally:
        _PENDING = None
        for cls, orig in patched:
            setattr(cls, "load_model", orig)


class _Hooks:
    """Forward hooks on decoder layers: state entering layer k, last layer's output for L."""

    def __init__(self, layers: Sequence[Any], ids: Iterable[int]) -> None:
        L = len(layers)
        self.buf: dict[int, torch.Tensor] = {}
        self.handles = []
        for k in ids:
            if k < L:
                h = layers[k].register_forward_pre_hook(self._pre(k), with_kwargs=True)
            else:
                h = layers[L - 1].register_forward_hook(self._post(k), with_kwargs=True)
            self.handles.append(h)

    def _pre(self, k: int) -> Any:
        def hook(mod: Any, args: tuple, kwargs: dict) -> None:
            # (positions, hidden_states, residual[, llama_4_scaling 0.12.0+ DeepseekV2])
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
            r = kwargs.get("residual", args[2] if len(args) > 2 else None)
            # vLLM's fused add-RMSNorm works in place: take a copy now.
            self.buf[k] = h + r if r is not None else h.clone()
        return hook

    def _post(self, k: int) -> Any:
        def hook(mod: Any, args: tuple, kwargs: dict, out: Any) -> None:
            h, r = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
            self.buf[k] = h + r if r is not None else h.clone()
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _worker_install_hooks(worker: Any, ids: tuple[int, ...]) -> int:
    runner = worker.model_runner
    inner = _inner_model(runner.model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise RuntimeError(f"{type(inner).__name__} has no .layers to hook")
    if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(layers):
        raise RuntimeError("pipeline parallelism is not supported by the hook capture")
    old = getattr(worker, "_vllm_compat_hooks", None)
    if old is not None:
        old.remove()
    worker._vllm_compat_hooks = _Hooks(list(layers), ids)
    return len(layers)


def _worker_describe(worker: Any) -> dict[str, Any]:
    runner = worker.model_runner
    return {
        "runner": runner_flavour(worker),
        "aux": getattr(runner, "_vllm_compat_aux", None),
        "use_aux": bool(getattr(runner, "use_aux_hidden_state_outputs", False)),
        "model": type(runner.model).__name__,
        "hooks": sorted(getattr(getattr(worker, "_vllm_compat_hooks", None), "buf", {}) or []),
        "rank": getattr(worker, "rank", 0),
    }


def _layout(runner: Any, num_scheduled: Mapping[str, int]) -> BatchLayout:
    st = getattr(runner, "execute_model_state", None)
    ib = getattr(st, "input_batch", None)
    # Model Runner V2 (0.18.1+ ExecuteModelState.input_batch): requests sorted
    # decode -> short -> prefill (sort_batch_req_ids), offsets in query_start_loc.
    if ib is not None and hasattr(ib, "query_start_loc_np"):
        qsl = [int(x) for x in ib.query_start_loc_np[: len(ib.req_ids) + 1]]
        lay = BatchLayout(tuple(ib.req_ids), tuple(qsl[:-1]), tuple(qsl[1:]))
        for r, s, e in zip(lay.req_ids, lay.starts, lay.ends):
            if num_scheduled.get(r) != e - s:
                raise RuntimeError(f"V2 batch layout disagrees with the scheduler for {r}: "
                                   f"{e - s} vs {num_scheduled.get(r)}")
        return lay
    # V1 runner: tokens laid out in the persistent input_batch order (after any
    # attention-backend reorder, e.g. MLA decode-first).
    return split_batch(list(runner.input_batch.req_ids), num_scheduled)


def _embed(model: Any, flat_ids: list[int]) -> torch.Tensor:
    # F.2: embed_input_ids from 0.11.2; get_input_embeddings on 0.10.2.
    fn = getattr(model, "embed_input_ids", None) or model.get_input_embeddings
    dev = next(model.parameters()).device
    with torch.inference_mode():
        return fn(torch.tensor(flat_ids, dtype=torch.long, device=dev))


class StagedCopy:
    """One step's ``[tokens, layers, hidden]`` block on its way into a pinned host buffer."""

    def __init__(self, pool: "HostStaging", lay: BatchLayout, host: torch.Tensor,
                 buf: torch.Tensor, done: Any) -> None:
        self._pool, self._lay, self._host, self._buf, self._done = pool, lay, host, buf, done

    def finish(self) -> dict[str, torch.Tensor]:
        """Wait for the copy; the states as views of one pageable tensor, per request."""
        self._done.synchronize()
        out = torch.empty(self._host.shape, dtype=self._host.dtype)
        out.copy_(self._host)  # parallel host memcpy; the pinned buffer goes back to the pool
        self._release()
        lay = self._lay
        return {r: out[s:e] for r, s, e in zip(lay.req_ids, lay.starts, lay.ends)}

    def discard(self) -> None:
        self._done.synchronize()
        self._release()

    def _release(self) -> None:
        if self._buf is not None:
            self._pool._free.append(self._buf)
            self._buf = self._host = None  # type: ignore[assignment]


class HostStaging:
    """The device->host hand-off of each step's states without stalling the GPU.

    ``start`` queues the copy of a step's ``[tokens, layers, hidden]`` block into a pinned
    buffer on a side stream (the copy engine runs it while the GPU goes on) and returns a
    :class:`StagedCopy`; its ``finish``, called later, waits for that copy and makes the
    pageable tensor the caller keeps (a parallel host memcpy that overlaps the next
    forward). Pinned buffers are reused, one per copy not yet finished (two when steps are
    pipelined). Why: H200, 1.1B Llama, 16k-token steps -- a blocking ``.to("cpu")`` into
    fresh pageable memory kept the GPU idle for the whole copy every step (b/a 0.37).
    In-process (TP=1) workers only: its results are views of one host tensor."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._stream: Any = None

    def _buffer(self, n: int, dtype: torch.dtype, capacity: int) -> torch.Tensor:
        for i, b in enumerate(self._free):
            if b.numel() >= n and b.dtype == dtype:
                return self._free.pop(i)
        self._free = [b for b in self._free if b.dtype == dtype]  # drop unusable ones first
        if self._free:  # all too small: replace the smallest rather than pin one more
            self._free.remove(min(self._free, key=torch.Tensor.numel))
        return torch.empty(max(n, capacity), dtype=dtype, pin_memory=True)

    def start(self, stacked: torch.Tensor, lay: BatchLayout, capacity_tokens: int) -> StagedCopy:
        n = stacked.numel()
        per_token = n // max(1, stacked.shape[0])
        buf = self._buffer(n, stacked.dtype, capacity_tokens * per_token)
        host = buf[:n].view(stacked.shape)
        dev = stacked.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self._stream):
            host.copy_(stacked, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        # the compute stream may reuse ``stacked``'s memory only after the copy has read it
        stacked.record_stream(self._stream)
        return StagedCopy(self, lay, host, buf, done)


def _worker_collect(worker: Any, num_scheduled: dict[str, int], mode: str,
                    want: tuple[int, ...],
                    chunk_ids: dict[str, list[int]] | None = None,
                    views: bool = False, staged: bool = False
                    ) -> dict[str, torch.Tensor] | StagedCopy | None:
    """Per-request ``[n_tokens, len(want), hidden]`` CPU tensors of this step (rank 0 only).

    ``views``: hand out slices of the step's one host buffer instead of a copy per request.
    Only for an in-process worker: a pickled view carries its whole buffer (H200, 1.1B Llama:
    the copies were about half of the ~100 ms of host work per 16k-token step).
    ``staged`` (in-process, CUDA): queue the copy into the worker's :class:`HostStaging` and
    return the :class:`StagedCopy`; the states come from its ``finish()``, later."""
    runner = worker.model_runner
    emb = None
    if chunk_ids is not None:
        # Every rank: the vocab-parallel embedding all-reduces under TP.
        lay = _layout(runner, num_scheduled)
        emb = _embed(runner.model, [t for r in lay.req_ids for t in chunk_ids[r]])
    if getattr(worker, "rank", 0) != 0:
        return None
    if mode == "aux":
        st = getattr(runner, "execute_model_state", None)
        aux = getattr(st, "aux_hidden_states", None)
        native = getattr(runner, "_vllm_compat_aux", ())
        if native:
            if aux is None:
                raise RuntimeError("no aux hidden states in execute_model_state (was the aux "
                                   "path configured before load?)")
            if len(aux) != len(native):
                raise RuntimeError(f"model returned {len(aux)} aux states for ids {native}")
        by_id = dict(zip(native or (), aux or ()))  # vLLM returns them in ascending order
        if emb is not None:
            by_id[0] = emb
    else:
        by_id = worker._vllm_compat_hooks.buf
    lay = _layout(runner, num_scheduled)
    if not lay.req_ids:
        return {}
    total = lay.total
    stacked = torch.stack([by_id[k][:total] for k in want], dim=1)
    if staged and stacked.is_cuda:
        st = worker.__dict__.get("_vllm_compat_staging")
        if st is None:
            st = worker._vllm_compat_staging = HostStaging()
        cap = getattr(getattr(runner, "scheduler_config", None), "max_num_batched_tokens", 0)
        return st.start(stacked, lay, int(cap or 0))
    stacked = stacked.to("cpu")
    if views:
        return {r: stacked[s:e] for r, s, e in zip(lay.req_ids, lay.starts, lay.ends)}
    return {r: stacked[s:e].clone() for r, s, e in zip(lay.req_ids, lay.starts, lay.ends)}


# --------------------------------------------------------------------------- engine side


def _engine_args_fields() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs
    return {f.name for f in dataclasses.fields(EngineArgs)}


def _set_env(**values: str) -> dict[str, str | None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    return old


def _restore_env(old: Mapping[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _reset_envs_cache() -> None:
    # 0.2x: EngineCore.__init__ calls envs.enable_envs_cache(), freezing env reads for the
    # rest of the process; a second LLM must see our variables again.
    import vllm.envs as envs
    fn = getattr(envs, "disable_envs_cache", None)
    if fn is not None:
        fn()


class Session:
    """An in-process ``LLM`` driven step by step; ``add`` prompts, ``step`` collects chunks."""

    def __init__(self, model_path: str, cfg: Mapping[str, Any], layer_ids: Sequence[int],
                 num_layers: int, *, backend: str = "auto", tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.5,
                 overlap_copy: bool | None = None, launch_ahead: bool | None = None,
                 llm_kwargs: Mapping[str, Any] | None = None) -> None:
        kw = dict(llm_kwargs or {})
        if kw.get("enable_prefix_caching"):
            raise ValueError("enable_prefix_caching=True: cached prompt tokens are not recomputed, "
                             "so their hidden states would be missing; leave it off")
        if kw.get("pipeline_parallel_size", 1) != 1:
            raise ValueError("pipeline_parallel_size > 1 is not supported")
        self.plan = plan(model_path, cfg, layer_ids, num_layers, backend=backend,
                         enforce_eager=enforce_eager)
        self.num_layers = num_layers
        self.layer_ids = tuple(layer_ids)
        self._tmpdir: str | None = None
        fields = _engine_args_fields()
        args: dict[str, Any] = dict(
            model=model_path, skip_tokenizer_init=True, enable_prefix_caching=False,
            tensor_parallel_size=tensor_parallel_size, enforce_eager=self.plan.enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, seed=0,
        )
        # Pipelined steps (StepPipeline, depth 2) schedule step N+1 before step N's output is
        # in, as vLLM's async scheduling does: the engine is built for it (AsyncScheduler's
        # output placeholders; the V1 runner then hands its sampled tokens back without a
        # sync). In-process (TP=1) and 0.11.2+ (two-phase step) only; native runs generate().
        self._pipelined_engine = (tensor_parallel_size == 1 and self.plan.mode != "native"
                                  and detect().probes["two_phase_step"])
        if "async_scheduling" in fields:  # 0.11+
            args["async_scheduling"] = kw.pop("async_scheduling", self._pipelined_engine)
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        if max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = max_num_batched_tokens
            args["enable_chunked_prefill"] = True
            if "max_num_seqs" not in kw:
                args["max_num_seqs"] = max(1, min(256, max_num_batched_tokens))
        if self.plan.mode == "native":
            self._tmpdir = tempfile.mkdtemp(prefix="vllm-compat-hs-")
            ids = list(self.plan.native_ids)
            args["speculative_config"] = {
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
            }
            args["kv_transfer_config"] = {
                "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._tmpdir},
            }
        args.update(kw)
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        keep = {"VLLM_ENABLE_V1_MULTIPROCESSING"}
        if not args["enforce_eager"]:
            # The aux layers live on the model object, not in the config hash: a compile
            # cache from a run with other layers would be reused silently. Recompile.
            env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
            # 0.26 (torch >= 2.10): VLLM_USE_AOT_COMPILE defaults to on unless the compile
            # cache is disabled, and the compiled forward asserts it is off at *run* time
            # (seen on the H200: AssertionError in compilation/decorators.py). Both must
            # stay set while this engine runs, not only while it is built.
            env["VLLM_USE_AOT_COMPILE"] = "0"
            keep |= {"VLLM_DISABLE_COMPILE_CACHE", "VLLM_USE_AOT_COMPILE"}
        if tensor_parallel_size > 1 and self.plan.mode == "aux" and self.plan.native_ids:
            # Worker processes: vLLM forces spawn once CUDA is initialised here, and a
            # spawned worker does not inherit our class patch (seen on 0.26.0, 2x H200:
            # "aux capture was not configured on the worker"). The ids go by environment
            # and the worker imports this module through worker_extension_cls.
            env[_ENV_AUX] = ",".join(map(str, self.plan.native_ids))
            if kw.get("worker_extension_cls"):
                raise ValueError("worker_extension_cls is used by the extractor for TP > 1")
            args["worker_extension_cls"] = f"{__name__}.AuxWorkerExtension"
        old = _set_env(**env)
        _reset_envs_cache()
        try:
            with _aux_configured(self.plan.native_ids if self.plan.mode == "aux" else None):
                self.llm = LLM(**args)
        finally:
            _restore_env({k: v for k, v in old.items() if k not in keep})
            _reset_envs_cache()
        engine = self.llm.llm_engine
        client = engine.engine_core
        self.core = getattr(client, "engine_core", None)
        if self.plan.mode != "native" and self.core is None:
            raise RuntimeError(f"expected an in-process engine core, got {type(client).__name__} "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0 was ignored?)")
        self.executor = self.core.model_executor if self.core is not None else None
        if self.plan.mode == "hooks":
            collective_rpc(self.executor, _worker_install_hooks, args=(self.layer_ids,))
        self.info = collective_rpc(self.executor, _worker_describe, rank=0) \
            if self.executor is not None else {}
        if self.plan.mode == "aux" and self.plan.native_ids and not self.info.get("use_aux"):
            raise RuntimeError(f"aux capture was not configured on the worker: {self.info}")
        self.info = dict(self.info, mode=self.plan.mode, note=self.plan.note,
                         vllm=vllm.__version__, tp=tensor_parallel_size,
                         enforce_eager=self.plan.enforce_eager)
        self._block_hasher = getattr(self.core, "request_block_hasher", None)
        self._sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        # TP=1 runs the worker in this process (UniProcExecutor): its tensors need no pickling
        self._in_process_worker = tensor_parallel_size == 1
        # Overlap each step's device->host copy with the next forward (HostStaging); in-process
        # only. VLLM_COMPAT_EXTRACT_OVERLAP=0 (or overlap_copy=False) restores the blocking copy.
        if overlap_copy is None:
            overlap_copy = os.environ.get("VLLM_COMPAT_EXTRACT_OVERLAP", "1") != "0"
        self.overlap_copy = bool(overlap_copy) and self._in_process_worker
        self.info["overlap_copy"] = self.overlap_copy
        self.info["async_scheduling"] = bool(args.get("async_scheduling", False))
        self._tickets: collections.deque[StagedCopy] = collections.deque()  # finished steps'
        self._pipe = StepPipeline(self.core.scheduler, self.executor, depth=1,
                                  between=self._collect) if self.core is not None else None
        self._collect_s = 0.0
        self._handoff_s = 0.0
        self._empty_steps = 0  # consecutive steps that scheduled nothing
        # Pipelined steps (launch_ahead): step N+1 is scheduled and launched before step N's
        # sampled tokens are waited for (StepPipeline, depth 2), so the GPU never idles
        # between two forwards. On by default where the engine was built for it (TP=1,
        # 0.11.2+); VLLM_COMPAT_EXTRACT_LAUNCH_AHEAD=0/1 (or launch_ahead=) decides. Until
        # the sixth session, launch_ahead launched N+1 only once N's sampled tokens were in:
        # 1.09-1.10x the lockstep loop on the H200 (1.1B Llama, eager) with ~12 ms of GPU
        # idle left per ~74 ms step (results/2026-11-29-h200-5).
        if launch_ahead is None:
            env = os.environ.get("VLLM_COMPAT_EXTRACT_LAUNCH_AHEAD")
            launch_ahead = self._pipelined_engine if env is None else env == "1"
        self.launch_ahead = bool(launch_ahead)
        self._emb0 = self.plan.mode == "aux" and 0 in self.layer_ids
        self._pending: dict[str, tuple[list[int], int]] = {}  # req -> (prompt, offset)

    @property
    def launch_ahead(self) -> bool:
        return self._pipe is not None and self._pipe.depth > 1

    @launch_ahead.setter
    def launch_ahead(self, on: bool) -> None:
        self.info["launch_ahead"] = bool(on) and self._pipe is not None
        if self._pipe is None:
            return
        if self._pipe.in_flight or self._tickets:
            raise RuntimeError("launch_ahead changed while an extraction was running")
        self._pipe.depth = 2 if on else 1

    @property
    def num_steps(self) -> int:
        return self._pipe.num_steps if self._pipe is not None else 0

    @property
    def max_step_tokens(self) -> int:
        return self._pipe.max_step_tokens if self._pipe is not None else 0

    @property
    def phase_s(self) -> dict[str, float]:
        """Wall seconds per phase of step(), summed: where a slow extraction spends its time.
        ``execute``: execute_model and the sample_tokens call; ``collect``: queueing (or, with
        the blocking copy, making) the host copy; ``wait``: waiting for a step's output (the
        forward, when the GPU is the bottleneck); ``handoff``: the pageable copy."""
        ph = self._pipe.phase_s if self._pipe is not None else {}
        return {"schedule": ph.get("schedule", 0.0),
                "execute": ph.get("launch", 0.0) - self._collect_s,
                "collect": self._collect_s, "wait": ph.get("wait", 0.0),
                "update": ph.get("update", 0.0), "handoff": self._handoff_s}

    # ---- aux / hooks: we drive the engine core

    def add(self, req_id: str, token_ids: Sequence[int]) -> None:
        req = make_request(req_id, token_ids, sampling_params=self._sp,
                           block_hasher=self._block_hasher)
        self.core.scheduler.add_request(req)
        if self._emb0:
            self._pending[req_id] = (list(token_ids), 0)

    def abort(self, req_ids: Iterable[str]) -> None:
        from vllm.v1.request import RequestStatus
        for fs in self._pipe.drain():  # steps in flight: finish them, drop their states
            if isinstance(fs.value, StagedCopy):
                fs.value.discard()
        self.core.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)
        while self._tickets:  # their states belong to the aborted extraction
            self._tickets.popleft().discard()

    def has_unfinished(self) -> bool:
        """Requests in the scheduler, steps in flight, or states not handed out yet."""
        return self._has_work() or bool(self._tickets)

    def _has_work(self) -> bool:
        return bool(self._pipe.in_flight) or bool(self.core.scheduler.has_unfinished_requests())

    def kv_blocks(self) -> tuple[int, int]:
        """``(free, total)`` KV-cache blocks of the scheduler's pool (same attributes
        0.10.2-0.33.0). The null block is never free, so an idle pool shows total - 1."""
        pool = self.core.scheduler.kv_cache_manager.block_pool
        return int(pool.get_num_free_blocks()), int(pool.num_gpu_blocks)

    def step(self) -> dict[str, torch.Tensor]:
        """One engine step; returns the chunks that are ready, per request.

        Blocking copy: the finished step's own chunks. ``overlap_copy``: pipelined, the
        finished step's (their copy ran during the next forward); lockstep, the previous
        step's, so the last call may schedule nothing. At most one step's chunks per call.
        """
        pipe, sched = self._pipe, self.core.scheduler
        if self._has_work():
            pipe.fill()
            fs = pipe.finish()
            # an empty step carries finished-request ids; a run of them means nothing fits
            self._empty_steps = 0 if fs.scheduler_output.total_num_scheduled_tokens else \
                self._empty_steps + 1
            if self._empty_steps > pipe.depth and sched.has_unfinished_requests():
                raise RuntimeError("the scheduler scheduled nothing while requests are pending "
                                   "(KV cache too small for one prompt?)")
            if isinstance(fs.value, StagedCopy):
                self._tickets.append(fs.value)
            elif fs.value:
                if self._tickets:  # overlap_copy was switched off in the middle of a run
                    raise RuntimeError("overlap_copy changed while an extraction was running; "
                                       "change it only between extract() calls")
                return fs.value
        # lockstep + overlap: keep the newest step's states back one step, so that their copy
        # runs during the next forward; pipelined: the next forward is already running
        lag = 1 if pipe.depth == 1 and self._has_work() else 0
        if len(self._tickets) <= lag:
            return {}
        t0 = time.perf_counter()
        ready = self._tickets.popleft().finish()
        self._handoff_s += time.perf_counter() - t0
        return ready

    def _collect(self, so: Any) -> dict[str, torch.Tensor] | StagedCopy | None:
        """StepPipeline's ``between``: after execute_model, before sample_tokens."""
        t0 = time.perf_counter()
        chunk_ids = None
        if self._emb0:
            chunk_ids = {}
            for rid, n in so.num_scheduled_tokens.items():
                ids, off = self._pending[rid]
                chunk_ids[rid] = ids[off: off + n]
                if off + n >= len(ids):
                    del self._pending[rid]
                else:
                    self._pending[rid] = (ids, off + n)
        chunks = collective_rpc(self.executor, _worker_collect, args=(
            dict(so.num_scheduled_tokens), self.plan.mode, self.layer_ids, chunk_ids,
            self._in_process_worker, self.overlap_copy), rank=0)
        self._collect_s += time.perf_counter() - t0
        return chunks

    # ---- native: vLLM's own extract_hidden_states + connector

    def run_native(self, batch: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        from vllm.inputs import TokensPrompt
        conn_mod = sys.modules.get(
            "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector")
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for _, ids in batch]
        outs = self.llm.generate(prompts, self._sp, use_tqdm=False)
        order = self.plan.native_ids
        pos = [order.index(k) for k in self.layer_ids]
        res = []
        for o, (_, ids) in zip(outs, batch):
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError("no hidden_states_path in kv_transfer_params")
            self._wait_saved(path)
            from safetensors.torch import load_file
            data = load_file(path, device="cpu")
            hs = data["hidden_states"][: len(ids)]
            res.append(hs[:, pos].clone())
            for p in (path, path + ".lock"):
                with contextlib.suppress(OSError):
                    os.remove(p)
        return res

    def _wait_saved(self, path: str, timeout: float = 120.0) -> None:
        """Step the engine until the connector has written ``path``.

        0.24.0+ saves in the worker's ``get_finished`` (PendingSave) and holds a LOCK_EX on
        ``<path>.lock`` until then; ``LLM.generate`` returns as soon as the request's output
        is out, before that step runs. ``load_hidden_states`` (0.22.1+) then blocks on
        LOCK_SH for ever in an in-process engine (seen on 0.26.0, H200). We take the lock
        non-blocking and step the engine core meanwhile, with a deadline.
        """
        import fcntl
        import time
        lock = path + ".lock"
        deadline = time.monotonic() + timeout
        while True:
            if not os.path.exists(lock):  # 0.17.1-0.21.0: synchronous save, no lock file
                if os.path.exists(path):
                    return
            else:
                with open(lock) as lf:
                    try:
                        fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        fcntl.flock(lf, fcntl.LOCK_UN)
                        return
                    except BlockingIOError:
                        pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's hidden-states connector did not write {path} within "
                                   f"{timeout:.0f} s")
            if self.core is not None and self.core.scheduler.has_requests():
                self.core.step()
            else:
                time.sleep(0.01)

    # ---- helpers for tests / callers

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float | None]]:
        """vLLM's own prompt logprobs of the actual prompt tokens (``llm.generate``)."""
        from vllm.inputs import TokensPrompt
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                                 use_tqdm=False)
        res = []
        for o, p in zip(outs, prompts):
            row: list[float | None] = []
            for t, d in zip(p, o.prompt_logprobs):
                row.append(None if d is None else float(d[t].logprob))
            res.append(row)
        return res

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        shutdown_engine(llm)
        self.llm = None  # type: ignore[assignment]
        self.core = self.executor = None
        del llm  # the in-process engine's model is freed only with the last reference
        free_gpu_memory()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
