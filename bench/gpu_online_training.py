"""Online EAGLE-3 training against offline training from shards: tokens/s and peak GPU memory.

    python -m bench.gpu_online_training --model llama-1b --out OUT
    python -m bench.gpu_online_training --model llama-8b --out OUT --placements colocated,split \\
        --engine-devices 1 --kv-cache-memory-bytes 8000000000
    python -m bench.gpu_online_training --model llama-tiny --backend transformers --device cpu \\
        --out OUT --num-records 64 --record-len 64      # the whole path on a CPU

One process. The target is a random checkpoint of ``--model`` (:mod:`bench.gpu_models`);
the records are ``--num-records`` seeded chat-shaped token sequences (a special id opening
each, ``--record-len`` tokens, the last three quarters trained on); the draft vocabulary is
built from them. Then, one after another:

  offline    ``eagle3 extract`` of the records into shards (timed on its own), every shard
             read once so the page cache holds them, then ``train`` on them: tokens/s of
             training that reads shards from a warm page cache.
  colocated  ``train_online`` with the engine in this process on the training GPU, with a
             fixed KV-cache budget (``--kv-cache-memory-bytes``).
  colocated-stream  the same with the draft's step on a CUDA stream of its own
             (``OnlineConfig.trainer_stream``), beside the engine's kernels.
  colocated-process the same GPU, the engine in a process of its own
             (``OnlineConfig.engine_process``): no interpreter lock shared with the trainer.
  split      ``train_online`` with the engine in its own process on ``--engine-devices``.

An untimed offline run goes first (kernel selection for each batch shape happens once per
process). Each run trains ``--steps`` steps of ``--batch-size`` records with the same seed, so every
run trains the same tokens in the same order. tokens/s = the records' tokens trained / the
seconds from the moment the run's sample source exists (the engine loaded, the draft not yet
built) to the end of training: engine start-up is reported apart (``engine_start_s``). The
summary holds ``online_tokens_per_s / offline_tokens_per_s`` per placement; each online run
also says where its time went (seconds the extractor computed, the trainer waited for a
batch, the extractor waited for room, and the producer's host work between the two: checks,
cast, padding and pinning). Peak GPU memory is sampled every 50 ms with
``torch.cuda.mem_get_info`` on every device the run uses (the engine process's memory
included), minus what was in use once cached blocks were released, beside this process's
allocator peak.

Results: ``<out>/gpu_online_training-<model>.json`` (rewritten after every run) with the
commit, the vLLM / torch / CUDA versions and GPUs, and the command line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import gpu_models

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "vllm-compat-gpu-online-training/1"
PLACEMENTS = ("colocated", "colocated-stream", "colocated-process", "split")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(gpu_models.SPECS))
    ap.add_argument("--checkpoint", help="use this checkpoint instead of building --model's")
    ap.add_argument("--out", required=True, help="results directory")
    ap.add_argument("--scratch-dir", help="records, shards and runs (default <out>/scratch-<model>)")
    ap.add_argument("--backend", choices=("vllm", "transformers"), default="vllm")
    ap.add_argument("--device", default="cuda", help="cuda; cpu with --backend transformers")
    ap.add_argument("--placements", default="colocated,split",
                    help="comma-separated, of " + ",".join(PLACEMENTS))
    ap.add_argument("--engine-devices", default="1", help="split: the engine's GPUs")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    ap.add_argument("--states-dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"))
    ap.add_argument("--num-records", type=int, default=1024)
    ap.add_argument("--record-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--queue-depth", type=int, default=4)
    ap.add_argument("--unit-steps", type=int, default=8)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int,
                    help="torch.set_num_threads for every run (CPU runs whose cores other "
                         "processes also use: 1; two threads on two such cores ran the same "
                         "offline training 20x slower, measured 2026-12-03)")
    a = ap.parse_args(argv)
    bad = [p for p in a.placements.split(",") if p not in PLACEMENTS]
    if bad:
        ap.error(f"unknown placement(s) {bad}; choose from {','.join(PLACEMENTS)}")
    return a


def write_records(directory: Path, n: int, length: int, vocab: int, seed: int) -> Path:
    """``prepared.jsonl``: a special id (bos 1, or a reserved id at the top of the vocabulary)
    opens each record and recurs every 64 tokens, ordinary ids between."""
    g = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    special = torch.tensor([1, 2, vocab - 1, vocab - 2])
    with open(directory / "prepared.jsonl", "w") as f:
        for i in range(n):
            ids = torch.randint(3, vocab - 8, (length,), generator=g)
            sp = special[torch.randint(0, len(special), (length,), generator=g)]
            ids = torch.where(torch.arange(length) % 64 == 0, sp, ids)
            mask = torch.arange(length) >= length // 4
            f.write(json.dumps({"line": i + 1, "input_ids": ids.tolist(),
                                "loss_mask": mask.int().tolist()}) + "\n")
    return directory


class PeakMemory:
    """Peak GPU memory on ``devices`` while open: the device's (total - free, sampled; other
    processes' engines included) above the level when opened, and this process's allocator
    peak (``max_memory_reserved``). Cached blocks are released first: an in-process engine
    would otherwise reuse what an earlier run's allocator still holds, and the device level
    would not move (the first H200 run read 0.0 GiB for every run that way)."""

    def __init__(self, devices: list[int], period_s: float = 0.05) -> None:
        self.devices, self.period_s = devices, period_s
        self.peak: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _used(self, d: int) -> int:
        free, total = torch.cuda.mem_get_info(d)
        return int(total - free)

    def __enter__(self) -> PeakMemory:
        if not self.devices:
            return self
        gc.collect()
        torch.cuda.empty_cache()
        for d in self.devices:
            torch.cuda.reset_peak_memory_stats(d)
        self.base = {d: self._used(d) for d in self.devices}
        self.peak = dict.fromkeys(self.devices, 0)

        def sample() -> None:
            while not self._stop.wait(self.period_s):
                for d in self.devices:
                    self.peak[d] = max(self.peak[d], self._used(d) - self.base[d])

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.reserved = {d: torch.cuda.max_memory_reserved(d) for d in self.devices}

    def report(self) -> dict[str, Any]:
        """GiB per device: ``device`` above the opening level, ``process_reserved`` peak."""
        return {f"cuda:{d}": {"device": round(b / 2**30, 3),
                              "process_reserved": round(self.reserved.get(d, 0) / 2**30, 3)}
                for d, b in self.peak.items()}


def _timed_source(module: Any, cls_name: str, mark: dict[str, float],
                  held: list[Any] | None = None) -> Any:
    """Record when ``module.cls_name`` is instantiated (the run's source: the engine is up),
    and keep the instance in ``held`` (its counters say where the time went)."""
    cls = getattr(module, cls_name)
    init = cls.__init__

    def wrapped(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        mark["source_ready"] = time.perf_counter()
        if held is not None:
            held.append(self)

    cls.__init__ = wrapped
    return lambda: setattr(cls, "__init__", init)


def online_times(source: Any) -> dict[str, float]:
    """Where an online run's time went, from its source's counters: seconds the extractor
    computed, the producer spent on host work between extraction and the queue (checks, cast,
    padding, pinning), the trainer waited for a batch, the extractor waited for room."""
    return {k: round(float(getattr(source, k)), 3)
            for k in ("extract_busy_s", "prepare_s", "trainer_wait_s", "extractor_wait_s", "extracted_tokens")}


def trained_tokens(out: Path, records: Path) -> int:
    import csv

    lens = [len(json.loads(line)["input_ids"]) for line in (records / "prepared.jsonl").open() if line.strip()]
    with (out / "data_order.csv").open(newline="") as f:
        return sum(lens[int(i)] for r in csv.DictReader(f) for i in r["samples"].split())


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    from vllm_compat.eagle3 import online as online_mod
    from vllm_compat.eagle3 import sources as sources_mod
    from vllm_compat.eagle3.extract_step import extract_dataset
    from vllm_compat.eagle3.online import OnlineConfig, train_online
    from vllm_compat.eagle3.training import TrainConfig, train
    from vllm_compat.eagle3.vocab import build_vocab
    from vllm_compat.target import read_target
    from vllm_compat.testing.provenance import code_id, versions

    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(a.scratch_dir or out / f"scratch-{a.model}")
    scratch.mkdir(parents=True, exist_ok=True)
    result_path = out / f"gpu_online_training-{a.model}.json"
    result: dict[str, Any] = {
        "schema": SCHEMA, "commit": code_id(ROOT), "versions": versions(),
        "command": [sys.executable, "-m", "bench.gpu_online_training", *(argv or sys.argv[1:])],
        "settings": {k: v for k, v in vars(a).items()}, "runs": {}, "summary": {}}

    def save() -> None:
        result_path.write_text(json.dumps(result, indent=1))

    ckpt = a.checkpoint or str(scratch / "target")
    if not a.checkpoint:
        result["build"] = gpu_models.build(a.model, ckpt, device=a.device)
    target = read_target(ckpt)
    records = write_records(scratch / "prep", a.num_records, a.record_len, target.vocab_size, a.seed)
    vocab_dir = scratch / "vocab"
    build_vocab(records, target.vocab_size, draft_vocab_size=min(a.draft_vocab_size, target.vocab_size),
                output_dir=vocab_dir, progress=False)
    cuda = a.device.startswith("cuda") and torch.cuda.is_available()
    train_dev = [0] if cuda else []
    engine_devs = [int(d) for d in a.engine_devices.split(",")] if cuda else []

    def cfg(run: str) -> TrainConfig:
        return TrainConfig(dataset=str(records), target=ckpt, vocab=str(vocab_dir),
                           output_dir=str(scratch / "runs" / run), max_steps=a.steps, epochs=max(
                               1, -(-a.steps * a.batch_size // a.num_records)),
                           batch_size=a.batch_size, seed=a.seed, checkpoint_every=10**9,
                           progress=False, tensorboard=False, dtype="bf16" if cuda else "fp32")

    def finish(run: str, t_end: float, mark: dict[str, float], peak: PeakMemory, **extra: Any) -> None:
        rd = scratch / "runs" / run
        tokens = trained_tokens(rd, records)
        secs = t_end - mark["source_ready"]
        result["runs"][run] = dict(extra, tokens=tokens, train_s=round(secs, 3),
                                   torch_threads=torch.get_num_threads(),
                                   tokens_per_s=round(tokens / secs, 1), peak_gib=peak.report())
        save()

    # offline: extract, warm the page cache, train
    ds = scratch / "shards"
    shutil.rmtree(ds, ignore_errors=True)
    t0 = time.perf_counter()
    kw: dict[str, Any] = {}
    if a.backend == "vllm":
        kw["kv_cache_memory_bytes"] = a.kv_cache_memory_bytes
    extract_dataset(ckpt, records, ds, backend=a.backend, dtype=getattr(torch, a.states_dtype),
                    progress=False, **kw)
    extract_s = time.perf_counter() - t0
    shard_bytes = 0
    for p in ds.rglob("*.safetensors"):  # read once: the page cache holds them now
        shard_bytes += len(p.read_bytes())
    # untimed: the first run in a process pays for kernel selection at each new batch shape
    # (CPU, 2026-12-03: the same offline run took 35 s cold and 10 s warm)
    w = cfg("warmup")
    w.dataset = str(ds)
    train(w, resume=False)
    mark: dict[str, float] = {}
    undo = _timed_source(sources_mod, "ShardSource", mark)
    try:
        c = cfg("offline")
        c.dataset = str(ds)
        with PeakMemory(train_dev) as peak:
            train(c, resume=False)
            t_end = time.perf_counter()
    finally:
        undo()
    finish("offline", t_end, mark, peak, extract_s=round(extract_s, 2), shard_bytes=shard_bytes,
           note="shards read from a warm page cache")

    for placement in a.placements.split(","):
        oc = OnlineConfig(backend=a.backend, states_dtype=a.states_dtype, queue_depth=a.queue_depth,
                          unit_steps=a.unit_steps, placement=placement.split("-")[0],
                          trainer_stream=placement.endswith("-stream"),
                          engine_process=placement.endswith("-process"),
                          engine_devices=a.engine_devices if placement == "split" and cuda else None,
                          kv_cache_memory_bytes=a.kv_cache_memory_bytes if a.backend == "vllm" else None)
        mark = {}
        held: list[Any] = []
        undo = _timed_source(online_mod, "OnlineSource", mark, held)
        t0 = time.perf_counter()
        try:
            devices = train_dev + (engine_devs if placement == "split" else [])
            with PeakMemory(devices) as peak:
                train_online(cfg(placement), oc, resume=False)
                t_end = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - recorded; the other placements still run
            result["runs"][placement] = {"error": f"{type(exc).__name__}: {exc}"}
            save()
            continue
        finally:
            undo()
        finish(placement, t_end, mark, peak, engine_start_s=round(mark["source_ready"] - t0, 2),
               **online_times(held[0]))
        off = result["runs"]["offline"]["tokens_per_s"]
        result["summary"][f"{placement}_vs_offline"] = round(
            result["runs"][placement]["tokens_per_s"] / off, 3)
        save()
    print(json.dumps(result["summary"] | {"results": str(result_path)}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    raise SystemExit(main())
