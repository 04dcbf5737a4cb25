"""The worker side of extraction: runs inside vLLM's worker (in-process at TP=1, in each
worker process at TP > 1), through ``collective_rpc``.

* aux mode: right after the model is loaded (inside the runner's ``load_model``, before the
  profile run, torch.compile and CUDA-graph capture) :func:`aux_configured`'s wrapper calls
  ``model.set_aux_hidden_state_layers(ids)`` and sets the runner's
  ``use_aux_hidden_state_outputs``; the compiled graph then returns the aux states, which
  :func:`collect` reads from ``runner.execute_model_state.aux_hidden_states`` between
  ``execute_model`` and ``sample_tokens``.
* hooks mode: :func:`install_hooks` puts forward(-pre) hooks on the decoder layers.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from ..extract import fp8
from ..extract.ordering import BatchLayout, split_batch
from ..extract.staging import HostStaging, StagedCopy, per_request, to_host
from ..rpc import runner_flavour
from . import final_state_tap
from .capture_plan import DeepseekV2Model, EagleModelMixin, deepseek_final_aux

# The runner classes whose load_model we wrap while the LLM is being built.
_RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")

# What the wrapped load_model should configure (set only while an LLM is being built; a
# forked TP worker inherits it).
_PENDING: dict[str, Any] | None = None
# Spawned TP workers inherit the environment, not _PENDING: the layer ids travel in this
# variable, and AuxWorkerExtension (vLLM's worker_extension_cls, imported by every worker
# before load_model) makes the worker import this module, which wraps load_model.
ENV_AUX = "VLLM_COMPAT_AUX_LAYERS"
ENV_TAP = "VLLM_COMPAT_TAP_FINAL"  # "1": tap the final state (final_state_tap)


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
                and deepseek_final_aux())
    if L in ids and not (is_mixin or ds_final):
        raise RuntimeError(f"{type(inner).__name__}'s aux path cannot return id {L} (final)")
    model.set_aux_hidden_state_layers(tuple(ids))
    runner.use_aux_hidden_state_outputs = True
    runner._vllm_compat_aux = tuple(ids)


def _tap_final_state(runner: Any) -> None:
    """Install the final-state tap on the backbone's final norm (before compile/capture)."""
    inner = _inner_model(runner.model)
    norm = getattr(inner, "norm", None)
    if norm is None or getattr(inner, "end_layer", len(inner.layers)) != len(inner.layers):
        raise RuntimeError(f"{type(inner).__name__}: no final norm to tap on this rank "
                           "(pipeline parallelism is not supported)")
    rows = int(runner.scheduler_config.max_num_batched_tokens)
    cc = getattr(runner, "compilation_config", None)
    # CUDA graphs pad a step to a captured size, which can exceed the token budget
    rows = max(rows, int(getattr(cc, "max_cudagraph_capture_size", 0) or 0))
    w = norm.weight
    runner._vllm_compat_tap = (len(inner.layers),
                               final_state_tap.install(norm, rows, w.shape[0], w.dtype, w.device))


def release_tap(worker: Any) -> None:
    """Give the final-state buffer back (the engine is closing)."""
    tap = worker.model_runner.__dict__.pop("_vllm_compat_tap", None)
    if tap is not None:
        final_state_tap.release(tap[1])


def _wrap_load_model(orig: Any) -> Any:
    @functools.wraps(orig)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        pending = _PENDING or {}
        ids = pending.get("aux")
        if not ids and os.environ.get(ENV_AUX):
            ids = tuple(int(x) for x in os.environ[ENV_AUX].split(","))
        if ids:
            _enable_aux(self, tuple(ids))
        if pending.get("tap") or os.environ.get(ENV_TAP) == "1":
            _tap_final_state(self)
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


if os.environ.get(ENV_AUX) or os.environ.get(ENV_TAP):  # a worker of an engine at TP > 1
    _patch_runners()


@contextlib.contextmanager
def aux_configured(ids: tuple[int, ...] | None, tap_final: bool = False) -> Iterator[None]:
    """Wrap the runners' load_model so aux layers (and the final-state tap) are set before
    warm-up / compile."""
    global _PENDING
    patched = _patch_runners()
    _PENDING = {"aux": ids, "tap": tap_final} if ids or tap_final else None
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


def install_hooks(worker: Any, ids: tuple[int, ...]) -> int:
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


def _unwrapped(model: Any) -> Any:
    # 0.21+: under CUDA graphs the runner's model is a CUDAGraphWrapper around the model
    return model.unwrap() if callable(getattr(model, "unwrap", None)) else model


def describe(worker: Any) -> dict[str, Any]:
    runner = worker.model_runner
    return {
        "runner": runner_flavour(worker),
        "aux": getattr(runner, "_vllm_compat_aux", None),
        "tap_final": getattr(runner, "_vllm_compat_tap", None) is not None,
        "use_aux": bool(getattr(runner, "use_aux_hidden_state_outputs", False)),
        "model": type(_unwrapped(runner.model)).__name__,
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


def collect(worker: Any, num_scheduled: dict[str, int], mode: str,
                    want: tuple[int, ...],
                    chunk_ids: dict[str, list[int]] | None = None,
                    views: bool = False, staged: bool = False, encode: str | None = None
                    ) -> dict[str, Any] | StagedCopy | None:
    """Per-request ``[n_tokens, len(want), hidden]`` CPU tensors of this step (rank 0 only).

    ``views``: hand out slices of the step's one host buffer instead of a copy per request.
    Only for an in-process worker: a pickled view carries its whole buffer (H200, 1.1B Llama:
    the copies were about half of the ~100 ms of host work per 16k-token step).
    ``staged`` (in-process, CUDA): queue the copy into the worker's :class:`HostStaging` and
    return the :class:`StagedCopy`; the states come from its ``finish()``, later.
    ``encode="fp8"``: each request gets ``(states, scales)``, encoded here on the GPU
    (:mod:`vllm_compat.extract.fp8`), so half the bytes cross to the host."""
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
        tap = getattr(runner, "_vllm_compat_tap", None)
        if tap is not None:
            by_id[tap[0]] = tap[1]  # the final state, copied by final_state_tap
        if emb is not None:
            by_id[0] = emb
    else:
        by_id = worker._vllm_compat_hooks.buf
    lay = _layout(runner, num_scheduled)
    if not lay.req_ids:
        return {}
    total = lay.total
    stacked = torch.stack([by_id[k][:total] for k in want], dim=1)
    parts = fp8.encode(stacked) if encode == "fp8" else stacked
    if staged and stacked.is_cuda:
        st = worker.__dict__.get("_vllm_compat_staging")
        if st is None:
            st = worker._vllm_compat_staging = HostStaging()
        cap = getattr(getattr(runner, "scheduler_config", None), "max_num_batched_tokens", 0)
        return st.start(parts, lay, int(cap or 0))
    return per_request(to_host(parts), lay, copy=not views)
