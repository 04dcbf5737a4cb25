"""Split placement on one host: the engine in a spawned process on its own GPUs, the
trainer in this one; the states cross through shared memory, never through files.

:class:`SplitEngine` answers ``extract(prompts)`` as
:class:`~vllm_compat.extract.HiddenStatesExtractor` does (samples in input order), so
:class:`~vllm_compat.eagle3.online.OnlineSource` drives either placement the same way. The
engine process is started with ``torch.multiprocessing``'s spawn context (a fresh
interpreter: CUDA and vLLM initialise there, with ``CUDA_VISIBLE_DEVICES`` set to
``engine_devices`` before either is imported). Prompts go to it on one queue; each sample
comes back on a bounded ``torch.multiprocessing`` queue, whose tensors travel as shared
memory (the child writes them once, this process maps them). The bound (``RESULTS_BOUND``
samples) keeps the engine at most that far ahead of the producer thread that reads it; the
producer's own bound is ``queue_depth`` batches.

The engine process exits when :meth:`SplitEngine.close` is called, and with this process
(it is a daemon, and it watches its parent).
"""

from __future__ import annotations

import itertools
import os
import queue
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.multiprocessing as tmp

from ..errors import VllmCompatError
from ..extract import fp8
from ..extract.extractor import ExtractedSample

RESULTS_BOUND = 8  # samples in flight between the engine process and this one
START_TIMEOUT_S = 1800.0  # loading a large target (Kimi-K2.5) takes many minutes


class SplitEngineError(VllmCompatError, RuntimeError):
    """The engine process failed (its traceback is in the message) or died."""


def engine_visible_devices(engine_devices: str, parent_visible: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of the engine process: ``engine_devices`` are indices as
    this process sees its GPUs, mapped through its own ``CUDA_VISIBLE_DEVICES``."""
    wanted = [d.strip() for d in engine_devices.split(",") if d.strip()]
    if not wanted or not all(d.isdigit() for d in wanted):
        raise ValueError(f"engine devices must be GPU indices like '1' or '1,2', got {engine_devices!r}")
    if not parent_visible:
        return ",".join(wanted)
    mine = [d.strip() for d in parent_visible.split(",") if d.strip()]
    bad = [d for d in wanted if int(d) >= len(mine)]
    if bad:
        raise ValueError(f"engine devices {bad} are not among this process's "
                         f"{len(mine)} visible GPUs (CUDA_VISIBLE_DEVICES={parent_visible})")
    return ",".join(mine[int(d)] for d in wanted)


def _owns_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` alone in its storage: a view of a larger buffer (the engine's per-step host
    buffer) would move that whole buffer into shared memory."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


class _ParentGone(Exception):
    pass


def _put(results: Any, msg: tuple[Any, ...], parent: int) -> None:
    """``results.put(msg)``, giving up when the trainer is gone (a SIGKILLed trainer cannot
    stop its engine; the engine must not wait on a full queue forever, holding its GPUs)."""
    while True:
        try:
            results.put(msg, timeout=1.0)
            return
        except queue.Full:
            if os.getppid() != parent:
                raise _ParentGone from None


def _engine_main(devices: str | None, target: str, layer_ids: list[int], kwargs: dict[str, Any],
                 requests: Any, results: Any, parent: int) -> None:
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        from ..extract import HiddenStatesExtractor

        ex = HiddenStatesExtractor(target, layer_ids=layer_ids, **kwargs)
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put(("error", -1, traceback.format_exc()))
        return
    results.put(("ready", -1, ex.info))
    try:
        while True:
            try:
                msg = requests.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the trainer is gone
                    return
                continue
            if msg is None:
                return
            job, prompts = msg
            try:
                for s in ex.extract(prompts):
                    scale = None if s.hidden_states_scale is None else _owns_storage(s.hidden_states_scale)
                    _put(results, ("sample", job, s.index, s.token_ids,
                                   _owns_storage(s.hidden_states), scale), parent)
                _put(results, ("done", job, None), parent)
            except _ParentGone:
                return
            except BaseException:  # noqa: BLE001 - reported to the parent
                _put(results, ("error", job, traceback.format_exc()), parent)
    except _ParentGone:
        return
    finally:
        ex.close()


def engine_kwargs(online: Any) -> dict[str, Any]:
    """The :class:`~vllm_compat.extract.HiddenStatesExtractor` keywords of an engine outside
    the trainer's process (split, or a Ray replica): backend, FP8 states, KV budget."""
    kw: dict[str, Any] = dict(online.extractor_kwargs)
    kw["backend"] = "transformers" if online.backend == "transformers" else kw.get("backend", "auto")
    if fp8.is_fp8(online.states_dtype):
        kw["states_dtype"] = fp8.FP8_DTYPE  # encoded where the states are (the GPU)
    if online.backend == "vllm":
        if online.kv_cache_memory_bytes is not None:
            kw.setdefault("kv_cache_memory_bytes", online.kv_cache_memory_bytes)
        if online.gpu_memory_utilization is not None:
            kw.setdefault("gpu_memory_utilization", online.gpu_memory_utilization)
    return kw


class SplitEngine:
    """A :class:`~vllm_compat.extract.HiddenStatesExtractor` in a spawned process.

    ``online``: an :class:`~vllm_compat.eagle3.online.OnlineConfig` (backend,
    ``engine_devices``, states dtype, ``extractor_kwargs``)."""

    def __init__(self, target: str, layer_ids: Sequence[int], online: Any, *,
                 kv_cache_bytes: int | None = None, device: torch.device | None = None) -> None:
        """``kv_cache_bytes`` and ``device``: the co-located memory plan's KV budget and the
        trainer's device, when the engine shares it (``online.engine_process``)."""
        self.layer_ids = tuple(layer_ids)
        kw = engine_kwargs(online)
        if kv_cache_bytes and online.backend == "vllm":
            kw.setdefault("kv_cache_memory_bytes", kv_cache_bytes)
        if device is not None and online.backend == "transformers":
            kw.setdefault("device", str(device))
        devices = None
        if online.engine_devices:
            devices = engine_visible_devices(online.engine_devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if torch.cuda.is_available() and "0" in [d.strip() for d in online.engine_devices.split(",")]:
                raise ValueError("the trainer runs on GPU 0: give the engine other GPUs "
                                 f"(engine devices {online.engine_devices!r})")
            if online.backend == "transformers":
                kw.setdefault("device", "cuda")
        ctx = tmp.get_context("spawn")
        self._requests = ctx.Queue()
        self._results = ctx.Queue(maxsize=RESULTS_BOUND)
        self._proc = ctx.Process(target=_engine_main, name="online-engine", daemon=True,
                                 args=(devices, str(target), list(self.layer_ids), kw,
                                       self._requests, self._results, os.getpid()))
        self._proc.start()
        self._jobs = itertools.count()
        kind, _, info = self._get(START_TIMEOUT_S)
        if kind != "ready":
            self.close()
            raise SplitEngineError(f"the engine process failed to start:\n{info}")
        self.info = info

    def _get(self, timeout_s: float | None = None) -> tuple[Any, ...]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                msg: tuple[Any, ...] = self._results.get(timeout=1.0)
                return msg
            except queue.Empty:
                if not self._proc.is_alive():
                    raise SplitEngineError(
                        f"the engine process died (exit code {self._proc.exitcode})") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise SplitEngineError(f"no answer from the engine process in {timeout_s:.0f} s") from None

    def extract(self, prompts: Iterable[Sequence[int]]) -> Iterator[ExtractedSample]:
        job = next(self._jobs)
        self._requests.put((job, [list(p) for p in prompts]))
        while True:
            msg = self._get()
            if msg[1] != job:  # what an abandoned earlier job still sends
                continue
            if msg[0] == "done":
                return
            if msg[0] == "error":
                raise SplitEngineError(f"the engine process failed:\n{msg[2]}")
            _, _, index, token_ids, hs, scale = msg
            yield ExtractedSample(index, token_ids, hs, self.layer_ids, scale)

    def close(self) -> None:
        if self._proc.is_alive():
            self._requests.put(None)
            deadline = time.monotonic() + 30
            while self._proc.is_alive() and time.monotonic() < deadline:
                try:  # a child blocked on a full results queue
                    self._results.get(timeout=0.1)
                except queue.Empty:
                    pass
            if self._proc.is_alive():
                self._proc.kill()
        self._proc.join(5)
