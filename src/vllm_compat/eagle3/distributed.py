"""Extraction over many replicas with Ray: one actor per replica (``tensor_parallel_size``
GPUs each, TP within the replica), each writing whole work units (:mod:`.units`).

    from vllm_compat.eagle3.distributed import extract_distributed
    extract_distributed("/ckpt", "/data/prep", "/mnt/team/ds", replicas=16,
                        tensor_parallel_size=8, samples_per_unit=1024)

The driver splits the records into units (deterministically, :func:`.units.write_plan`),
starts the replicas as Ray actors (``num_gpus=gpus_per_replica``), hands each idle replica
the next unit, and writes the merged ``manifest.json`` at the end. A replica that dies (its
process killed, its node lost) is restarted by Ray (``max_restarts``) and its unit is
handed out again; the unit's partial files are deleted first. Running the same call again
after the whole job died resumes: finished units are kept, partial ones recomputed. The
output directory must be one file system that every replica writes and the driver reads
(NFS, Lustre, ...). Ray is optional (``pip install 'vllm-compat[ray]'``); without it, use
:func:`vllm_compat.eagle3.extract_step.extract_dataset` on one machine.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..extract import fp8
from ..locking import lock_output_dir
from ..target import read_target
from .data import Manifest
from .extract_step import aux_layer_ids_for
from .units import (
    UnitSpec,
    is_finished,
    merge_units,
    read_plan,
    remove_partials,
    write_plan,
    write_unit,
)

log = logging.getLogger(__name__)

BACKENDS = ("vllm", "transformers")
Event = Callable[[dict[str, Any]], None]


class ExtractionReplica:
    """One replica: an extractor that writes whole units of the output directory's split.

    ``backend="vllm"``: :class:`~vllm_compat.extract.HiddenStatesExtractor` on the GPUs Ray
    gave this actor (``extractor_kwargs`` go to it: ``tensor_parallel_size``,
    ``max_num_batched_tokens``, ``kv_cache_memory_bytes``, ...); ``"transformers"``: the CPU
    reference (:class:`~vllm_compat.eagle3.hf_reference.TransformersExtractor`). FP8 datasets
    get FP8 states from the extractor (encoded on the GPU with vLLM)."""

    def __init__(self, target_dir: str, records_dir: str, output_dir: str, *,
                 backend: str = "vllm", extractor_kwargs: dict[str, Any] | None = None) -> None:
        self.records_dir, self.output_dir = records_dir, output_dir
        self.units, self.spec, _ = read_plan(output_dir)
        states_dtype = fp8.FP8_DTYPE if fp8.is_fp8(self.spec.dtype) else None
        kw = dict(extractor_kwargs or {})
        t0 = time.perf_counter()
        if backend == "vllm":
            from ..extract import HiddenStatesExtractor
            if kw.get("tensor_parallel_size", 1) > 1:
                # worker processes on this node's GPUs (Ray placed the replica there)
                kw.setdefault("distributed_executor_backend", "mp")
            self.extractor: Any = HiddenStatesExtractor(
                target_dir, layer_ids=self.spec.layer_ids, states_dtype=states_dtype, **kw)
        elif backend == "transformers":
            from .hf_reference import TransformersExtractor
            self.extractor = TransformersExtractor(target_dir, self.spec.layer_ids,
                                                   states_dtype=states_dtype, **kw)
        else:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.startup_s = round(time.perf_counter() - t0, 2)

    def info(self) -> dict[str, Any]:
        """Where this replica runs (the driver's events name it by pid and host)."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "startup_s": self.startup_s,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def run_unit(self, index: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        res = write_unit(self.extractor, self.records_dir, self.output_dir, self.units[index],
                         self.spec)
        return dict(res, seconds=round(time.perf_counter() - t0, 3), pid=os.getpid())

    def close(self) -> None:
        close = getattr(self.extractor, "close", None)
        if close is not None:
            close()


def import_ray(needed_for: str) -> Any:
    """``ray``, imported on use (it is optional); the error says what needs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{needed_for} needs Ray: pip install 'vllm-compat[ray]'") from e
    return ray


def extract_distributed(
    target_dir: str | os.PathLike[str],
    records_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    aux_layer_ids: Sequence[int] | None = None,
    *,
    replicas: int,
    gpus_per_replica: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    samples_per_shard: int = 256,
    samples_per_unit: int | None = None,
    backend: str = "vllm",
    ray_address: str | None = None,
    max_restarts: int = 3,
    staggered_start: bool = False,
    on_event: Event | None = None,
    **extractor_kwargs: Any,
) -> Manifest:
    """Extract ``records_dir`` (a ``prepare`` output) into ``output_dir`` over ``replicas``
    Ray actors; returns the merged manifest. Resumable (see the module doc).

    ``gpus_per_replica``: Ray's ``num_gpus`` per actor (default ``tensor_parallel_size``
    for vLLM, 0 for transformers; a fraction puts several replicas on one GPU, each with
    its own fixed ``kv_cache_memory_bytes``). ``samples_per_unit`` (default 4 shards): the
    work unit, also what a dead replica costs. ``ray_address``: ``ray.init``'s (``"auto"``:
    the running cluster; None: connect to one if this process already is, else start a
    local one). ``staggered_start``: start the replicas one after another (replicas that
    share a GPU profile its memory one at a time). ``on_event``: called in the driver
    with each event (``replica_ready``, ``unit_started``, ``unit_done``, ``replica_died``,
    ``replica_lost`` once Ray gave up restarting it).
    ``extractor_kwargs``: to each replica's extractor.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ray = import_ray("extraction over replicas (one machine: extract_dataset needs no Ray)")
    target = read_target(target_dir)
    aux = aux_layer_ids_for(target, aux_layer_ids)
    spec = UnitSpec(target.hidden_size, tuple(aux), target.num_hidden_layers,
                    str(dtype).removeprefix("torch."), samples_per_shard, target.manifest_entry())
    out = Path(output_dir)
    emit = on_event or (lambda e: None)
    with lock_output_dir(out, f"eagle3 extract --replicas {replicas}"):
        units = write_plan(out, records_dir, samples_per_unit or 4 * samples_per_shard, spec)
        for name in remove_partials(out):  # a dead job's writers left these
            log.info("removed the partial unit %s of an earlier run", name)
        todo = collections.deque(u.index for u in units if not is_finished(out, u))
        log.info("%d units, %d to extract over %d replicas", len(units), len(todo), replicas)
        if todo:
            if not ray.is_initialized():
                ray.init(address=ray_address)
            gpus = gpus_per_replica if gpus_per_replica is not None else (
                float(extractor_kwargs.get("tensor_parallel_size", 1)) if backend == "vllm" else 0)
            _run(ray, todo, replicas, gpus, max_restarts, staggered_start, emit,
                 (str(target.path), str(records_dir), str(out)),
                 {"backend": backend, "extractor_kwargs": extractor_kwargs})
        return merge_units(out)


def _run(ray: Any, todo: collections.deque[int], replicas: int, gpus: float,
         max_restarts: int, staggered: bool, emit: Event, args: tuple[str, str, str],
         kwargs: dict[str, Any]) -> None:
    from ray.exceptions import ActorDiedError, RayActorError

    actor_cls = ray.remote(ExtractionReplica).options(
        num_gpus=gpus, max_restarts=max_restarts, max_task_retries=0)
    actors: list[Any] = []
    try:
        infos = []
        for _ in range(min(replicas, len(todo))):
            actors.append(actor_cls.remote(*args, **kwargs))
            if staggered:
                infos.append(ray.get(actors[-1].info.remote()))
        if not staggered:
            infos = ray.get([a.info.remote() for a in actors])
        for r, info in enumerate(infos):
            emit({"event": "replica_ready", "replica": r, **info})
        idle = collections.deque(range(len(actors)))
        running: dict[Any, tuple[int, int]] = {}  # task ref -> (replica, unit)
        probes: dict[Any, int] = {}  # info() of a restarting replica -> replica
        while todo or running:
            while idle and todo:
                r, u = idle.popleft(), todo.popleft()
                running[actors[r].run_unit.remote(u)] = (r, u)
                emit({"event": "unit_started", "replica": r, "unit": u, "pid": infos[r]["pid"]})
            if not running and not probes:
                raise RuntimeError(f"every replica died; {len(todo)} units left")
            [ref], _ = ray.wait([*running, *probes], num_returns=1)
            if ref in probes:  # a restarting replica answered, or not yet
                r = probes.pop(ref)
                try:
                    infos[r] = ray.get(ref)
                except ActorDiedError:  # out of restarts
                    emit({"event": "replica_lost", "replica": r})
                except RayActorError:  # still restarting: ask again shortly
                    time.sleep(0.5)
                    probes[actors[r].info.remote()] = r
                else:
                    emit({"event": "replica_ready", "replica": r, "restarted": True, **infos[r]})
                    idle.append(r)
                continue
            r, u = running.pop(ref)
            try:
                res = ray.get(ref)
            except RayActorError as e:  # the process or node died: the unit goes back
                todo.appendleft(u)
                lost = isinstance(e, ActorDiedError)
                emit({"event": "replica_died", "replica": r, "unit": u, "restarting": not lost,
                      "error": f"{type(e).__name__}: {str(e)[:300]}"})
                if not lost:  # Ray restarts it (max_restarts); use it once it answers
                    infos[r] = dict(infos[r], pid=None)
                    probes[actors[r].info.remote()] = r
                continue
            emit({"event": "unit_done", "replica": r, **res})
            idle.append(r)
    finally:
        for a in actors:
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - a dead replica has nothing to close
                log.debug("closing a replica: %s", e)
            ray.kill(a)
