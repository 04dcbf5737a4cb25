"""Online EAGLE-3 training: the target's hidden states are extracted while the draft trains,
and never written to disk (unless a cache is asked for).

    from vllm_compat.eagle3.online import OnlineConfig, train_online
    train_online(TrainConfig(dataset="prep/", target=..., vocab=..., output_dir="run/"),
                 OnlineConfig(backend="vllm", queue_depth=4))

``cfg.dataset`` is a ``prepare`` output directory (``prepared.jsonl``). The trainer is the
offline one (:func:`vllm_compat.eagle3.training.run_training`); only its source differs.
:class:`OnlineSource` hands it the samples offline training would read from shards of the
same records: sample ``i`` is record ``i``, the data order is the trainer's
``epoch_order(n, seed, epoch)``, the layer ids are the dataset's (aux ids, then ``L``), and
the states go through the dtype the shards would store (cast, or FP8 encoded and decoded
with :mod:`vllm_compat.extract.fp8`, exactly as ``ShardWriter`` and ``HiddenStatesDataset``
do). So online training equals offline training on the same data, seed and settings (exactly
with a batch-independent extractor, the transformers backend; within vLLM's batch-to-batch
numerics otherwise), and a run killed at any point resumes from its last checkpoint with the
same data order.

Work units decide what is extracted together, not arrival. The steps of an epoch are cut
into online units of ``unit_steps`` steps (aligned to the epoch's start); the prompts of a
unit's steps go to the extractor in one ``extract`` call, which starts and ends with an idle
engine. The engine's batches are then a function of the unit alone, the same in a run that
was killed and resumed as in one that was not (a resume mid-unit re-extracts the unit from
its first step, discarding the steps before the checkpoint: at most ``unit_steps - 1``
steps' worth of extraction). A producer thread runs the extractor up to ``queue_depth``
steps ahead of the trainer (a bounded queue of ready batches).

``cache``: a directory kept in the offline work-unit format (:mod:`.units`: ``units.json``,
``units/unit-k/`` shard datasets of ``samples_per_unit`` consecutive records). A step's
samples are read from it where their unit is there, and their missing units are extracted
into it first (generate-on-missing, each unit written by :func:`.units.write_unit`, so the
cache is byte for byte what ``eagle3 extract --replicas`` writes). Later epochs and later
runs read it; ``merge_units(cache)`` turns it into a dataset offline training reads.

Placements: co-located (:mod:`.colocated`: the engine in this process, on the training GPU,
with a fixed KV-cache budget), split (:mod:`.split_engine`: the engine in a spawned
process on other GPUs of this host, states through shared memory), or replicas
(:mod:`.ray_engines`: engine replicas as Ray actors on any hosts, states through Ray's
object store, at most ``queue_depth`` units in flight per trainer).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..extract import fp8
from ..target import TargetInfo, read_target
from .data import DatasetFormatError, HiddenStatesDataset, Manifest, all_finite, check_sample
from .online_args import BACKENDS, PLACEMENTS, STATES_DTYPES, OnlineConfig  # noqa: F401
from .prepare import PREPARED
from .sources import MakeBatch, Sample

OPEN_CACHE_UNITS = 64  # cache units kept open at once (one shard file each)


# ----------------------------------------------------------------------------- records


class Records:
    """``(input_ids, loss_mask)`` of ``prepared.jsonl`` by record number, read on demand from
    byte offsets found in one pass (8 bytes per record in memory, not the token ids)."""

    def __init__(self, records_dir: str | os.PathLike[str]) -> None:
        self.path = Path(records_dir) / PREPARED
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: online training reads a prepare output "
                                    "directory (vllm-compat eagle3 prepare)")
        self.offsets = array("q")
        pos = 0
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    self.offsets.append(pos)
                pos += len(line)
        self._f: Any = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._f is None:  # opened in the thread that reads (the producer)
            self._f = open(self.path, "rb")  # noqa: SIM115 - kept open, closed by close()
        self._f.seek(self.offsets[i])
        row = json.loads(self._f.readline())
        return (torch.tensor(row["input_ids"], dtype=torch.int64),
                torch.tensor(row["loss_mask"], dtype=torch.bool))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# ----------------------------------------------------------------------------- states


def as_read_from_shards(states: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                        decode_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The ``hidden_states`` a shard of ``dtype`` would hand the trainer for these extracted
    states: cast to ``dtype`` (``ShardWriter.flush``), or for FP8 encoded (unless the
    extractor did, as it does on the GPU) and decoded into ``decode_dtype``
    (``HiddenStatesDataset``)."""
    if fp8.is_fp8(dtype):
        if fp8.is_fp8(states.dtype):
            if scale is None:
                raise DatasetFormatError(f"FP8 hidden_states without {fp8.SCALE_KEY}")
            q, s = states, scale.to(torch.float32)
        else:
            q, s = fp8.encode(states)
        return fp8.decode(q, s, decode_dtype)
    if fp8.is_fp8(states.dtype) or scale is not None:
        raise DatasetFormatError(f"FP8 states for a {dtype} run: extract in the model's dtype")
    return states.to(dtype)


class NonFiniteStatesError(DatasetFormatError):
    """The extractor handed out NaN or Inf states (what a shard reader would refuse)."""


def _check_finite(index: int, hs: torch.Tensor) -> None:
    if not all_finite(hs):
        raise NonFiniteStatesError(f"record {index}: the extracted hidden states hold NaN or Inf")


def online_units(steps_per_epoch: int, unit_steps: int, start: int, stop: int
                 ) -> Iterator[tuple[int, int]]:
    """``(first, end)`` step ranges of the online units covering steps ``start .. stop-1``:
    ``unit_steps`` steps each, aligned to each epoch's first step, the first one extended
    back to its aligned start (re-extracted from there so its batching is the same)."""
    s = start
    while s < stop:
        epoch, offset = divmod(s, steps_per_epoch)
        first = epoch * steps_per_epoch + offset // unit_steps * unit_steps
        end = min(first + unit_steps, (epoch + 1) * steps_per_epoch)
        yield first, end
        s = end


# ----------------------------------------------------------------------------- source


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


class OnlineSource:
    """Samples extracted while training (see the module docstring). ``extractor``: an object
    with ``extract(prompts) -> iterator of ExtractedSample`` in input order (an in-process
    :class:`~vllm_compat.extract.HiddenStatesExtractor`, or :class:`.split_engine.SplitEngine`),
    or a pool of replicas with ``submit``, ``ready`` and ``result``
    (:class:`.ray_engines.ReplicaPool`), driven up to ``queue_depth`` units ahead; closed with
    the source when ``owns_extractor``. ``on_event``: the pool's unit events."""

    def __init__(self, records_dir: str | os.PathLike[str], target: str | os.PathLike[str] | TargetInfo,
                 extractor: Any, aux_layer_ids: Sequence[int], online: OnlineConfig, *,
                 steps_per_epoch: Callable[[int], int], owns_extractor: bool = True,
                 records: Records | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.target = read_target(target)
        self.records = records if records is not None else Records(records_dir)
        self.dir = Path(records_dir)
        self.online = online
        self.extractor = extractor
        self.owns_extractor = owns_extractor
        self.dtype = online.torch_states_dtype
        self.aux = tuple(aux_layer_ids)
        L = self.target.num_hidden_layers
        self.manifest = Manifest(self.target.hidden_size, list(self.aux), L, online.states_dtype,
                                 target=self.target.manifest_entry())
        self._steps_per_epoch = steps_per_epoch
        # a pool (.ray_engines.ReplicaPool) is driven ahead by units: at most queue_depth
        # units in flight, each slot freed when the trainer takes the unit's last step
        self._ahead = hasattr(extractor, "submit")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=0 if self._ahead else online.queue_depth)
        self._slots = threading.Semaphore(online.queue_depth)
        self._emit = on_event or (lambda e: None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # progress: tokens extracted and trained, seconds each side waited for the other
        self.extracted_tokens = 0
        self.extract_busy_s = 0.0
        self.trained_tokens = 0
        self.trainer_wait_s = 0.0
        self.extractor_wait_s = 0.0
        # host work of the producer between extraction and the queue: each sample's checks and
        # cast, each batch's padding and pinning (neither extraction nor training)
        self.prepare_s = 0.0
        self._t0 = time.monotonic()
        self._last: dict[str, float] = {}
        self._cache_units: OrderedDict[int, HiddenStatesDataset] = OrderedDict()
        self._plan: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.records)

    # ---- what the trainer calls

    def batches(self, steps: Iterable[list[int]], make_batch: MakeBatch, depth: int
                ) -> Iterator[dict[str, torch.Tensor]]:
        """``steps``: the trainer's :class:`~vllm_compat.eagle3.training.StepBatches`
        (its ``start``, ``stop`` and ``indices(step)``). ``depth`` is ignored: the queue is
        ``queue_depth`` deep."""
        sampler: Any = steps
        self._thread = threading.Thread(target=self._produce, args=(sampler, make_batch),
                                        name="online-extraction", daemon=True)
        self._thread.start()
        return self._consume(sampler)

    def _consume(self, sampler: Any) -> Iterator[dict[str, torch.Tensor]]:
        for _ in range(len(sampler)):
            t = time.monotonic()
            item = self._queue.get()
            waited = time.monotonic() - t
            self.trainer_wait_s += waited
            if isinstance(item, _Failed):
                raise item.exc
            batch, tokens, ext_rate, last_of = item
            if last_of is not None:  # the last step of a unit in flight: its slot is free
                self._emit({"event": "unit_taken", "unit": last_of, "time": time.time()})
                self._slots.release()
            self.trained_tokens += tokens
            self._last = {"online/trainer_wait_s": waited, "online/extract_tokens_per_s": ext_rate}
            yield batch

    def scalars(self) -> dict[str, float]:
        wall = max(time.monotonic() - self._t0, 1e-9)
        return {**self._last,
                "online/train_tokens_per_s": self.trained_tokens / wall,
                "online/extractor_wait_s_total": self.extractor_wait_s,
                "online/trainer_wait_s_total": self.trainer_wait_s,
                "online/queue": float(self._queue.qsize())}

    def progress(self) -> dict[str, str]:
        wall = max(time.monotonic() - self._t0, 1e-9)
        ext = self.extracted_tokens / max(self.extract_busy_s, 1e-9)
        waits = "trainer" if self.trainer_wait_s > self.extractor_wait_s else "extractor"
        return {"extract_tok/s": f"{ext:.0f}", "train_tok/s": f"{self.trained_tokens / wall:.0f}",
                "waits": waits}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(0.05)
        self.records.close()
        if self.owns_extractor and self.extractor is not None:
            self.extractor.close()
            self.extractor = None

    # ---- the producer thread

    def _put(self, item: Any) -> bool:
        t = time.monotonic()
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                self.extractor_wait_s += time.monotonic() - t
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, sampler: Any, make_batch: MakeBatch) -> None:
        if self._ahead:
            return self._produce_ahead(sampler, make_batch)
        try:
            spe = self._steps_per_epoch(len(self))
            for first, end in online_units(spe, self.online.unit_steps, sampler.start, sampler.stop):
                steps = [(s, sampler.indices(s)) for s in range(first, end)]
                for s, samples, tokens in self._unit_samples(steps):
                    if s < sampler.start or s >= sampler.stop:
                        continue
                    rate = self.extracted_tokens / max(self.extract_busy_s, 1e-9)
                    if not self._put((self._batch(make_batch, samples), tokens, rate, None)):
                        return
                if self._stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, raised there
            self._put(_Failed(exc))

    # ---- the producer thread, driving a pool of replicas ahead (bounded), in plan order

    def _produce_ahead(self, sampler: Any, make_batch: MakeBatch) -> None:
        try:
            spe = self._steps_per_epoch(len(self))
            plan = enumerate(online_units(spe, self.online.unit_steps, sampler.start, sampler.stop))
            window: deque[Any] = deque()
            nxt = next(plan, None)
            while nxt is not None or window:
                # send units while the trainer has slots free (wait only with none in flight)
                while nxt is not None and self._acquire(blocking=not window):
                    window.append(self._submit(sampler, *nxt))
                    nxt = next(plan, None)
                if self._stop.is_set():
                    return
                if not self.extractor.ready(window[0][-1], 0.1):  # the plan's next unit
                    continue
                k, steps, records, ref = window.popleft()
                res = self.extractor.result(ref)
                self.extract_busy_s += res["finished"] - res["started"]
                self._emit({"event": "unit_extracted", "unit": k, "started": res["started"],
                            "finished": res["finished"], "pid": res["pid"]})
                if not self._hand_over(k, steps, records, res["samples"], sampler, make_batch):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, raised there
            self._put(_Failed(exc))

    def _acquire(self, blocking: bool) -> bool:
        t = time.monotonic()
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.1 if blocking else 0):
                self.extractor_wait_s += time.monotonic() - t
                return True
            if not blocking:
                return False
        return False

    def _submit(self, sampler: Any, k: int, unit: tuple[int, int]) -> tuple[Any, ...]:
        first, end = unit
        steps = [(s, sampler.indices(s)) for s in range(first, end)]
        records = [(i, self.records[i]) for _, idx in steps for i in idx]
        r, ref = self.extractor.submit(k, [ids.tolist() for _, (ids, _) in records])
        self._emit({"event": "unit_submitted", "unit": k, "first": first, "end": end,
                    "replica": r, "time": time.time()})
        return k, steps, records, ref

    def _hand_over(self, k: int, steps: list[tuple[int, list[int]]], records: list[Any],
                   got: list[Any], sampler: Any, make_batch: MakeBatch) -> bool:
        """Queue the unit's steps this run trains; the last one carries the unit's slot."""
        if len(got) != len(records):
            raise RuntimeError(f"unit {k}: {len(got)} samples came back for {len(records)} prompts")
        kept = [s for s, _ in steps if sampler.start <= s < sampler.stop]
        pos = 0
        for s, idx in steps:
            samples = []
            for _ in idx:
                if got[pos].index != pos:
                    raise RuntimeError(f"the replica handed out prompt {got[pos].index}, "
                                       f"expected {pos} (input order)")
                samples.append(self._sample(records[pos][0], records[pos][1], got[pos]))
                pos += 1
            tokens = sum(int(x["input_ids"].shape[0]) for x in samples)
            self.extracted_tokens += tokens
            if s not in kept:
                continue
            rate = self.extracted_tokens / max(self.extract_busy_s, 1e-9)
            if not self._put((self._batch(make_batch, samples), tokens, rate, k if s == kept[-1] else None)):
                return False
        return True

    def _unit_samples(self, steps: list[tuple[int, list[int]]]
                      ) -> Iterator[tuple[int, list[Sample], int]]:
        """``(step, samples, tokens)`` for each step of one online unit, in step order."""
        if self.online.cache:
            for s, idx in steps:
                samples = [self._cached(i) for i in idx]
                yield s, samples, sum(int(x["input_ids"].shape[0]) for x in samples)
            return
        flat = [i for _, idx in steps for i in idx]
        records = [self.records[i] for i in flat]
        stream = self.extractor.extract(ids.tolist() for ids, _ in records)
        pos = 0
        try:
            for s, idx in steps:
                samples = []
                for _ in idx:
                    t = time.monotonic()
                    got = next(stream)
                    self.extract_busy_s += time.monotonic() - t
                    if got.index != pos:
                        raise RuntimeError(f"the extractor handed out prompt {got.index}, "
                                           f"expected {pos} (input order)")
                    samples.append(self._sample(flat[pos], records[pos], got))
                    pos += 1
                tokens = sum(int(x["input_ids"].shape[0]) for x in samples)
                self.extracted_tokens += tokens
                yield s, samples, tokens
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    def _batch(self, make_batch: MakeBatch, samples: list[Sample]) -> dict[str, torch.Tensor]:
        t = time.monotonic()
        batch = make_batch(samples)
        self.prepare_s += time.monotonic() - t
        return batch

    def _sample(self, index: int, record: tuple[torch.Tensor, torch.Tensor], got: Any) -> Sample:
        t = time.monotonic()
        ids, mask = record
        if not torch.equal(got.token_ids.to(torch.int64), ids):
            raise RuntimeError(f"record {index}: the extractor's tokens differ from the record's")
        hs = as_read_from_shards(got.hidden_states, got.hidden_states_scale, self.dtype)
        sample = {"input_ids": ids, "loss_mask": mask, "hidden_states": hs}
        check_sample(sample, len(self.manifest.layer_ids), self.manifest.hidden_size)
        _check_finite(index, hs)
        self.prepare_s += time.monotonic() - t
        return sample

    # ---- the cache (offline work-unit format)

    def _cached(self, i: int) -> Sample:
        from .units import UnitSpec, is_finished, unit_dir, write_plan, write_unit

        cache = Path(self.online.cache or "")
        if self._plan is None:
            spec = UnitSpec(self.manifest.hidden_size, self.aux, self.manifest.final_layer_id,
                            self.online.states_dtype, self.online.samples_per_shard,
                            dict(self.manifest.target))
            self._spec = spec
            self._plan = write_plan(cache, self.dir, self.online.unit_size, spec)
        k = i // self.online.unit_size
        unit = self._plan[k]
        if k not in self._cache_units:
            if not is_finished(cache, unit):  # generate on missing
                t = time.monotonic()
                rep = write_unit(self.extractor, self.dir, cache, unit, self._spec)
                self.extract_busy_s += time.monotonic() - t
                self.extracted_tokens += int(rep.get("tokens", 0))
            self._cache_units[k] = HiddenStatesDataset(unit_dir(cache, unit))
            if len(self._cache_units) > OPEN_CACHE_UNITS:  # each keeps a shard file open
                self._cache_units.popitem(last=False)
        self._cache_units.move_to_end(k)
        sample = self._cache_units[k][i - unit.start]
        return {key: sample[key] for key in ("input_ids", "loss_mask", "hidden_states")}


# ----------------------------------------------------------------------------- entry point


def trainer_stream(online: OnlineConfig, device: torch.device) -> Any:
    """The stream the training step runs on: its own with ``online.trainer_stream`` on a CUDA
    device (batches reach the GPU through host memory on that stream, so no tensor crosses
    from the engine's stream to it), else the current one."""
    if online.trainer_stream and device.type == "cuda":
        return torch.cuda.stream(torch.cuda.Stream(device))
    return nullcontext()


def train_online(cfg: Any, online: OnlineConfig, *, resume: bool = True,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """Train the draft on states extracted while training. ``cfg``: a
    :class:`~vllm_compat.eagle3.training.TrainConfig` whose ``dataset`` is a ``prepare``
    output directory. Same outputs as offline training (``metrics.csv``, ``data_order.csv``,
    ``checkpoints/``, ``final/``), TensorBoard scalars under ``online/``. One process, or
    torchrun ranks with the replicas placement (each rank feeds itself); ``on_event``: the
    replicas placement's events (``replica_ready``, ``unit_submitted``, ``unit_extracted``
    with the replica's own start and finish times, ``unit_taken`` when the trainer took the
    unit's last step)."""
    from ..locking import lock_output_dir
    from .extract_step import aux_layer_ids_for
    from .training import TRAIN_CONFIG, _dist, epoch_order, run_training

    online.check()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and online.placement != "replicas":
        raise ValueError("co-located and split online training run one trainer process; for "
                         "torchrun use the replicas placement (--engine-replicas), or extract "
                         "offline (eagle3 extract) and train with torchrun")
    rank, world, device, started_pg = _dist()
    out = Path(cfg.output_dir)
    target = read_target(cfg.target)
    aux = aux_layer_ids_for(target, online.aux_layer_ids)
    # one lock and one train_config.json per run: rank 0's (every rank writes one directory)
    lock = lock_output_dir(out, "eagle3 train --online") if rank == 0 else None
    try:
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / TRAIN_CONFIG).write_text(json.dumps(
                {**asdict(cfg), "online": dict(asdict(online), aux_layer_ids=list(aux))}, indent=1))
        if online.cache:
            cache = Path(online.cache).resolve()
            if cache == out.resolve() or out.resolve() in cache.parents:
                raise ValueError(f"the cache {online.cache} is inside the output directory "
                                 f"{cfg.output_dir}: keep states apart from the run's outputs")
        records = Records(cfg.dataset)
        spe = lambda n: len(epoch_order(n, cfg.seed, 0, rank, world)) // cfg.batch_size
        if online.placement == "replicas":
            from .ray_engines import ReplicaPool

            extractor: Any = ReplicaPool(str(target.path), [*aux, target.num_hidden_layers], online,
                                         on_event=on_event)
        elif online.placement == "split":
            from .split_engine import SplitEngine

            extractor = SplitEngine(target.path, [*aux, target.num_hidden_layers], online)
        else:
            from .colocated import open_colocated

            extractor = open_colocated(cfg, online, target, aux, device, records)
        try:
            source = OnlineSource(cfg.dataset, target, extractor, aux, online, records=records,
                                  steps_per_epoch=spe, on_event=on_event)
        except BaseException:
            extractor.close()
            raise
        with trainer_stream(online, device):
            return run_training(cfg, source, resume=resume, dist=(rank, world, device, started_pg),
                                pin=device.type == "cuda", scalar_prefix="online")
    finally:
        if lock is not None:
            lock.release()
