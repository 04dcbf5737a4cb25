"""Many-hosts placement: engine replicas as Ray actors feeding the trainer through Ray's
object store (``eagle3 train --online --engine-replicas N``).

Each replica (:class:`EngineReplica`) is a Ray actor running the extractor the other
placements run (:class:`~vllm_compat.extract.HiddenStatesExtractor`, keywords from
:func:`.split_engine.engine_kwargs`), placed by Ray like the replicas of
``eagle3 extract --replicas`` (``num_gpus`` = the tensor-parallel size with vLLM, none with
the transformers backend). :class:`ReplicaSource` is :class:`.online.OnlineSource` with
another producer: it walks the same online-unit plan (:func:`.online.online_units`), sends
each unit's prompts to a replica in one ``extract_unit`` call (round robin over the units),
and hands the trainer the units' steps in plan order, whatever order the replicas finish
in. So the trainer sees the samples, order and layer ids of the other placements, and of
offline training, and a rerun after a kill resumes the same way.

Back-pressure: a unit is in flight from its submission to a replica until the trainer has
taken its last step; at most ``queue_depth`` units are in flight per trainer (a semaphore
the trainer releases), so the replicas never run further ahead, and the object store holds
at most that many units' states for this trainer. Under torchrun each rank starts its own
``engine_replicas`` replicas and extracts only the samples it trains on (its share of the
epoch order, as :class:`~vllm_compat.eagle3.training.StepBatches` gives it).

A replica that dies is restarted by Ray and its unit retried (``max_restarts``,
``max_task_retries``): extraction of a unit is a pure function of its prompts. Actors are
owned by the trainer process: when it dies (SIGKILL included), Ray ends them.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .online import OnlineSource, _Failed, online_units
from .split_engine import _owns_storage, engine_kwargs

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
Event = Callable[[dict[str, Any]], None]


def ray_module() -> Any:
    """``ray``, imported on use: it is optional."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("the many-hosts placement (--engine-replicas) runs its engines as Ray "
                          "actors: pip install 'vllm-compat[ray]'") from e
    return ray


class EngineReplica:
    """One engine replica (a Ray actor): ``extract_unit(prompts)`` returns every prompt's
    ``(index, token_ids, hidden_states, scale)`` in input order, from one ``extract`` call
    (idle engine to idle engine, as in the other placements)."""

    def __init__(self, target: str, layer_ids: list[int], kwargs: dict[str, Any]) -> None:
        from ..extract import HiddenStatesExtractor

        kw = dict(kwargs)
        if kw.get("tensor_parallel_size", 1) > 1:  # worker processes on the GPUs Ray gave us
            kw.setdefault("distributed_executor_backend", "mp")
        t0 = time.perf_counter()
        self.extractor = HiddenStatesExtractor(target, layer_ids=layer_ids, **kw)
        self.startup_s = round(time.perf_counter() - t0, 2)

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "startup_s": self.startup_s,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def extract_unit(self, prompts: list[list[int]]) -> dict[str, Any]:
        started = time.time()
        samples = []
        for s in self.extractor.extract(prompts):
            scale = None if s.hidden_states_scale is None else _owns_storage(s.hidden_states_scale)
            # alone in its storage: a view would pickle the engine's whole step buffer
            samples.append((s.index, s.token_ids, _owns_storage(s.hidden_states), scale))
        return {"samples": samples, "started": started, "finished": time.time(), "pid": os.getpid()}

    def close(self) -> None:
        self.extractor.close()


class _Got:
    """An ``ExtractedSample``'s fields, as a replica returned them."""

    __slots__ = ("hidden_states", "hidden_states_scale", "index", "token_ids")

    def __init__(self, index: int, token_ids: Any, hidden_states: Any, scale: Any) -> None:
        self.index, self.token_ids, self.hidden_states, self.hidden_states_scale = (
            index, token_ids, hidden_states, scale)


class ReplicaSource(OnlineSource):
    """:class:`.online.OnlineSource` fed by :class:`EngineReplica` actors (module doc).
    ``on_event``: called with ``unit_submitted``, ``unit_extracted`` (the replica's own
    start and finish times) and ``unit_taken`` (the trainer took its last step) events."""

    def __init__(self, records_dir: Any, target: Any, aux_layer_ids: Sequence[int], online: Any, *,
                 layer_ids: Sequence[int], on_event: Event | None = None, **kwargs: Any) -> None:
        super().__init__(records_dir, target, None, aux_layer_ids, online, owns_extractor=False, **kwargs)
        import queue

        self._queue = queue.Queue()  # bounded by the units in flight, not by batches
        self._slots = threading.Semaphore(self.online.queue_depth)
        self._emit = on_event or (lambda e: None)
        ray = ray_module()
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=self.online.ray_address)
        kw = engine_kwargs(self.online)
        gpus = float(kw.get("tensor_parallel_size", 1)) if self.online.backend == "vllm" else 0.0
        actor = ray.remote(EngineReplica).options(num_gpus=gpus, max_restarts=MAX_RESTARTS,
                                                  max_task_retries=MAX_RESTARTS)
        assert self.online.engine_replicas is not None
        self.replicas = [actor.remote(str(self.target.path), list(layer_ids), kw)
                         for _ in range(self.online.engine_replicas)]
        try:
            self.replica_info = ray.get([r.info.remote() for r in self.replicas])
        except BaseException:
            self._kill_replicas()
            raise
        for r, info in enumerate(self.replica_info):
            self._emit({"event": "replica_ready", "replica": r, **info})

    # ---- the trainer's side: taking a unit's last step frees its slot

    def _consume(self, sampler: Any) -> Any:
        for _ in range(len(sampler)):
            t = time.monotonic()
            item = self._queue.get()
            waited = time.monotonic() - t
            self.trainer_wait_s += waited
            if isinstance(item, _Failed):
                raise item.exc
            batch, tokens, ext_rate, last_of = item
            if last_of is not None:
                self._emit({"event": "unit_taken", "unit": last_of, "time": time.time()})
                self._slots.release()
            self.trained_tokens += tokens
            self._last = {"online/trainer_wait_s": waited, "online/extract_tokens_per_s": ext_rate}
            yield batch

    # ---- the producer thread: submit ahead (bounded), hand over in plan order

    def _acquire(self, blocking: bool) -> bool:
        t = time.monotonic()
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.1 if blocking else 0):
                self.extractor_wait_s += time.monotonic() - t
                return True
            if not blocking:
                return False
        return False

    def _produce(self, sampler: Any, make_batch: Any) -> None:
        ray = ray_module()
        try:
            spe = self._steps_per_epoch(len(self))
            plan = iter(enumerate(online_units(spe, self.online.unit_steps, sampler.start, sampler.stop)))
            window: collections.deque[Any] = collections.deque()
            nxt = next(plan, None)
            while nxt is not None or window:
                # submit while the trainer has slots free (block only with nothing in flight)
                while nxt is not None and self._acquire(blocking=not window):
                    window.append(self._submit(sampler, *nxt))
                    nxt = next(plan, None)
                if self._stop.is_set():
                    return
                k, steps, flat, records, ref = window[0]
                ready, _ = ray.wait([ref], timeout=0.1)
                if not ready:
                    continue
                window.popleft()
                res = ray.get(ref)
                self.extract_busy_s += res["finished"] - res["started"]
                self._emit({"event": "unit_extracted", "unit": k, "started": res["started"],
                            "finished": res["finished"], "pid": res["pid"]})
                if not self._hand_over(k, steps, flat, records, res["samples"], sampler, make_batch):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, raised there
            self._put(_Failed(exc))

    def _submit(self, sampler: Any, k: int, unit: tuple[int, int]) -> tuple[Any, ...]:
        first, end = unit
        steps = [(s, sampler.indices(s)) for s in range(first, end)]
        flat = [i for _, idx in steps for i in idx]
        records = [self.records[i] for i in flat]
        r = k % len(self.replicas)
        ref = self.replicas[r].extract_unit.remote([ids.tolist() for ids, _ in records])
        self._emit({"event": "unit_submitted", "unit": k, "first": first, "end": end,
                    "replica": r, "time": time.time()})
        return k, steps, flat, records, ref

    def _hand_over(self, k: int, steps: list[tuple[int, list[int]]], flat: list[int],
                   records: list[Any], got: list[Any], sampler: Any, make_batch: Any) -> bool:
        """Queue the unit's steps that this run trains; the last one frees the unit's slot."""
        if len(got) != len(flat):
            raise RuntimeError(f"unit {k}: the replica returned {len(got)} samples for {len(flat)} prompts")
        kept = [(s, idx) for s, idx in steps if sampler.start <= s < sampler.stop]
        pos = 0
        for s, idx in steps:
            samples = []
            for _ in idx:
                g = _Got(*got[pos])
                if g.index != pos:
                    raise RuntimeError(f"the replica handed out prompt {g.index}, expected {pos} (input order)")
                samples.append(self._sample(flat[pos], records[pos], g))
                pos += 1
            tokens = sum(int(x["input_ids"].shape[0]) for x in samples)
            self.extracted_tokens += tokens
            if (s, idx) not in kept:
                continue
            rate = self.extracted_tokens / max(self.extract_busy_s, 1e-9)
            last = k if s == kept[-1][0] else None
            if not self._put((make_batch(samples), tokens, rate, last)):
                return False
        return True

    def close(self) -> None:
        super().close()
        self._kill_replicas()

    def _kill_replicas(self) -> None:
        ray = ray_module()
        for a in getattr(self, "replicas", []):
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - a dead replica has nothing to close
                log.debug("closing a replica: %s", e)
            ray.kill(a)
        self.replicas = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
