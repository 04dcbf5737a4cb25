"""Many-hosts placement: engine replicas as Ray actors feeding the trainer through Ray's
object store (``eagle3 train --online --engine-replicas N``).

Each replica (:class:`EngineReplica`) is a Ray actor running the extractor the other
placements run (:class:`~vllm_compat.extract.HiddenStatesExtractor`, keywords from
:func:`.split_engine.engine_kwargs`), placed by Ray like the replicas of
``eagle3 extract --replicas`` (``num_gpus`` = the tensor-parallel size with vLLM, none with
the transformers backend). :class:`ReplicaPool` holds them; :class:`.online.OnlineSource`
walks the same online-unit plan as with the other placements (:func:`.online.online_units`),
sends each unit's prompts to a replica in one ``extract_unit`` call (round robin over the
units), and hands the trainer the units' steps in plan order, whatever order the replicas
finish in. So the trainer sees the samples, order and layer ids of the other placements, and of
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

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from .distributed import import_ray
from .split_engine import _owns_storage, engine_kwargs

log = logging.getLogger(__name__)

MAX_RESTARTS = 3
Event = Callable[[dict[str, Any]], None]


def ray_module() -> Any:
    return import_ray("--engine-replicas (engines as Ray actors)")


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


class ReplicaPool:
    """``engine_replicas`` :class:`EngineReplica` actors, as the asynchronous extractor
    :class:`.online.OnlineSource` drives ahead of the trainer: ``submit(k, prompts)`` sends
    unit ``k`` to replica ``k % N`` (round robin), ``ready(ref, timeout)``, ``result(ref)``
    (the replica's times and the unit's ``ExtractedSample`` in input order), ``close()``.
    ``on_event``: called with ``replica_ready`` (pid, host) for each replica."""

    def __init__(self, target_path: str, layer_ids: Sequence[int], online: Any,
                 on_event: Event | None = None) -> None:
        self.layer_ids = tuple(layer_ids)
        self.replicas: list[Any] = []
        ray = ray_module()
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=online.ray_address)
        kw = engine_kwargs(online)
        gpus = float(kw.get("tensor_parallel_size", 1)) if online.backend == "vllm" else 0.0
        actor = ray.remote(EngineReplica).options(num_gpus=gpus, max_restarts=MAX_RESTARTS,
                                                  max_task_retries=MAX_RESTARTS)
        self.replicas = [actor.remote(target_path, list(layer_ids), kw)
                         for _ in range(online.engine_replicas)]
        try:
            self.info = ray.get([r.info.remote() for r in self.replicas])
        except BaseException:
            self.close()
            raise
        for r, info in enumerate(self.info):
            (on_event or (lambda e: None))({"event": "replica_ready", "replica": r, **info})

    def submit(self, k: int, prompts: list[list[int]]) -> tuple[int, Any]:
        r = k % len(self.replicas)
        return r, self.replicas[r].extract_unit.remote(prompts)

    def ready(self, ref: Any, timeout_s: float) -> bool:
        done, _ = ray_module().wait([ref], timeout=timeout_s)
        return bool(done)

    def result(self, ref: Any) -> dict[str, Any]:
        from ..extract.extractor import ExtractedSample

        res: dict[str, Any] = ray_module().get(ref)
        res["samples"] = [ExtractedSample(i, ids, hs, self.layer_ids, scale)
                          for i, ids, hs, scale in res["samples"]]
        return res

    def close(self) -> None:
        ray = ray_module()
        for a in self.replicas:
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - a dead replica has nothing to close
                log.debug("closing a replica: %s", e)
            ray.kill(a)
        self.replicas = []
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
