"""Dataset writing against the disk: ``ShardWriter`` and ``BackgroundShardWriter`` (what
extraction writes through) against a plain write + fsync of the same bytes, interleaved per
round, median MB/s. The CPU side of the GPU benchmark's to-disk mode
(``python -m bench.gpu_extraction --modes b,c``), without a GPU.

    python -m bench.cpu_shard_writer --dir /dev/shm --mib 512 --rounds 5 --out OUT.json
    python -m bench.cpu_shard_writer --dir /path/on/the/disk --mib 4096 --rounds 3 \
        --samples-per-shard 16 --modes plain,plain_shards_kick,writer,c_bf16,plain_fp8,c_fp8,c_fp8_encoded

``--dir /dev/shm`` (tmpfs) takes the disk out, so what is left is the writers' own CPU cost.
Modes (default: plain, writer, writer_views, c_bf16, plain_fp8, c_fp8, c_fp8_encoded):

- ``plain``: the samples' tensor bytes (bf16 states) written with one write loop + fsync;
- ``writer``: ``ShardWriter`` called in the loop; ``writer_views``: the same fed views of one
  host buffer per engine step (``--step-samples`` samples each), as the extractor hands them;
- ``plain_shards`` / ``plain_shards_kick``: the plain write cut into one fsync'ed file per
  shard, without / with early writeback (``posix_fadvise`` every
  ``vllm_compat.locking.WRITEBACK_KICK_BYTES``, as ``atomic_write_bytes`` does);
- ``writer_nokick``: ``writer`` with early writeback off; ``writer_nohash``: diagnostic only,
  the shard digest replaced by a constant (what hashing costs);
- ``c_bf16``: ``BackgroundShardWriter`` fed the bf16 samples (extraction's disk path);
- ``plain_fp8``: the plain write of the FP8 dataset's bytes (states, scales, ids, masks);
- ``c_fp8``: ``BackgroundShardWriter`` on an FP8 dataset fed bf16 samples, encoded on the CPU
  by its encoding thread (states extracted in bf16);
- ``c_fp8_encoded``: the same fed samples already in FP8 with their scales, as the extractor
  hands them out when it encodes on the GPU (``states_dtype=torch.float8_e4m3fn``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from vllm_compat import locking
from vllm_compat.eagle3.data import BackgroundShardWriter, ShardWriter
from vllm_compat.extract import fp8

H, LAYERS, T = 2048, 4, 1024  # the 1.1B Llama's 4 captured layers, 1024-token samples


def samples(mib: int) -> list[dict[str, torch.Tensor]]:
    n = max(1, (mib << 20) // (T * LAYERS * H * 2))
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 32000, (T,), generator=g),
             "loss_mask": torch.ones(T, dtype=torch.bool),
             "hidden_states": torch.randn(T, LAYERS, H, generator=g).to(torch.bfloat16)} for _ in range(n)]


def run_plain(d: Path, data: list[dict[str, torch.Tensor]]) -> int:
    fd = os.open(d / "plain.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    n = 0
    for s in data:
        for t in s.values():
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            n += len(view)
            while view:
                view = view[os.write(fd, view[: 1 << 20]):]
    os.fsync(fd)
    os.close(fd)
    return n


def as_views(data: list[dict[str, torch.Tensor]], step: int) -> list[dict[str, torch.Tensor]]:
    """The same samples, their hidden states views of one buffer per ``step`` samples."""
    out = []
    for k in range(0, len(data), step):
        group = data[k:k + step]
        buf = torch.cat([s["hidden_states"] for s in group])
        off = 0
        for s in group:
            n = s["hidden_states"].shape[0]
            out.append(dict(s, hidden_states=buf[off:off + n]))
            off += n
    return out


def run_plain_shards(d: Path, data: list[dict[str, torch.Tensor]], per_shard: int,
                     kick: bool) -> int:
    """The plain write, one file per shard, each fsync'ed (as the writer makes each shard
    durable before the next), with or without the writeback kick."""
    n = 0
    for k in range(0, len(data), per_shard):
        fd = os.open(d / f"plain-{k:05d}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        start = kicked = n
        for s in data[k:k + per_shard]:
            for t in s.values():
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                while view:
                    w = os.write(fd, view[: 1 << 20])
                    view = view[w:]
                    n += w
                    if kick and n - kicked >= locking.WRITEBACK_KICK_BYTES:
                        os.posix_fadvise(fd, kicked - start, n - kicked, os.POSIX_FADV_DONTNEED)
                        kicked = n
        os.fsync(fd)
        os.close(fd)
    return n


def run_writer_nohash(d: Path, data: list[dict[str, torch.Tensor]], per_shard: int) -> int:
    """Diagnostic only (the manifest's sha256 is wrong): the writer without hashing, to tell
    what the sha256 beside the write costs."""
    from vllm_compat.eagle3 import data as data_mod
    old = data_mod._digest_of
    data_mod._digest_of = lambda chunks, out: out.append("0" * 64)
    try:
        return run_writer(d, data, per_shard)
    finally:
        data_mod._digest_of = old


def run_writer_nokick(d: Path, data: list[dict[str, torch.Tensor]], per_shard: int) -> int:
    old, locking.WRITEBACK_KICK_BYTES = locking.WRITEBACK_KICK_BYTES, 0
    try:
        return run_writer(d, data, per_shard)
    finally:
        locking.WRITEBACK_KICK_BYTES = old


def run_background(d: Path, data: list[dict[str, torch.Tensor]], per_shard: int,
                   dtype: torch.dtype) -> int:
    """Extraction's disk path: ``BackgroundShardWriter`` fed the samples; every file durable
    when ``close()`` returns. Returns the files' bytes."""
    w = BackgroundShardWriter(_writer(d, per_shard, dtype), max_queue=4 * per_shard)
    for s in data:
        w.add(s)
    w.close()
    return sum(p.stat().st_size for p in (d / "ds").iterdir() if p.is_file())


def _writer(d: Path, per_shard: int, dtype: torch.dtype = torch.bfloat16) -> ShardWriter:
    return ShardWriter(d / "ds", hidden_size=H, aux_layer_ids=[1, 2, 3], final_layer_id=4,
                       dtype=dtype, samples_per_shard=per_shard)


def run_writer(d: Path, data: list[dict[str, torch.Tensor]], per_shard: int) -> int:
    with _writer(d, per_shard) as w:
        for s in data:
            w.add(s)
    return sum(s["bytes"] for s in w.manifest.shards)


def encoded(data: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The samples in FP8 with their scales, as the extractor hands them out (not timed)."""
    out = []
    for s in data:
        q, scale = fp8.encode(s["hidden_states"])
        out.append({**s, "hidden_states": q, fp8.SCALE_KEY: scale})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--mib", type=int, default=512, help="bf16 states to write per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples-per-shard", type=int, default=8)
    ap.add_argument("--step-samples", type=int, default=16, help="samples per engine-step buffer (views)")
    ap.add_argument("--out", default="/tmp/vllm-compat-bench/cpu_shard_writer.json")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, from {','.join(DEFAULT_MODES + EXTRA_MODES)}")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    unknown = set(modes) - set(DEFAULT_MODES + EXTRA_MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}")
    data = samples(a.mib)
    views = as_views(data, a.step_samples)
    data8 = encoded(data)
    root = Path(a.dir) / "vllm-compat-shard-bench"
    per = a.samples_per_shard
    every = {"plain": lambda d: run_plain(d, data),
             "writer": lambda d: run_writer(d, data, per),
             "writer_views": lambda d: run_writer(d, views, per),
             "plain_shards": lambda d: run_plain_shards(d, data, per, kick=False),
             "plain_shards_kick": lambda d: run_plain_shards(d, data, per, kick=True),
             "writer_nokick": lambda d: run_writer_nokick(d, data, per),
             "writer_nohash": lambda d: run_writer_nohash(d, data, per),
             "c_bf16": lambda d: run_background(d, data, per, torch.bfloat16),
             "plain_fp8": lambda d: run_plain(d, data8),
             "c_fp8": lambda d: run_background(d, data, per, fp8.FP8_DTYPE),
             "c_fp8_encoded": lambda d: run_background(d, data8, per, fp8.FP8_DTYPE)}
    fns = {m: every[m] for m in modes}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in fns}
    for r in range(a.rounds):
        order = list(fns)[r % len(fns):] + list(fns)[: r % len(fns)]  # rotate: none always first
        for name in order:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            t0 = time.perf_counter()
            nbytes = fns[name](root)
            dt = time.perf_counter() - t0
            runs[name].append({"round": r, "seconds": round(dt, 4), "bytes": nbytes,
                               "MB_s": round(nbytes / dt / 1e6, 1)})
    shutil.rmtree(root, ignore_errors=True)
    res = {"dir": a.dir, "mib": a.mib, "rounds": a.rounds, "samples_per_shard": a.samples_per_shard,
           "step_samples": a.step_samples, "cpus": os.cpu_count(),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "writeback_kick_bytes": locking.WRITEBACK_KICK_BYTES, "loadavg": os.getloadavg(),
           "runs": runs, **summarize(runs)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("median_MB_s", "ratios", "loadavg")}))
    return res


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict:
    """Median MB/s per mode and the ratios of the pairs in ``RATIOS`` that ran. The FP8 modes
    against ``plain_fp8`` compare throughput of the same bytes."""
    med = {k: statistics.median(x["MB_s"] for x in v) for k, v in runs.items() if v}
    ratios = {f"{x}/{y}": round(med[x] / med[y], 3) for x, y in RATIOS if x in med and y in med}
    return {"median_MB_s": med, "ratios": ratios}


DEFAULT_MODES = ("plain", "writer", "writer_views", "c_bf16", "plain_fp8", "c_fp8", "c_fp8_encoded")
EXTRA_MODES = ("plain_shards", "plain_shards_kick", "writer_nokick", "writer_nohash")
RATIOS = (("writer", "plain"), ("writer_views", "writer"), ("c_bf16", "plain"),
          ("c_fp8", "plain_fp8"), ("c_fp8_encoded", "plain_fp8"), ("c_fp8_encoded", "c_fp8"),
          ("plain_shards", "plain"), ("plain_shards_kick", "plain_shards"),
          ("writer", "writer_nokick"), ("writer", "plain_shards_kick"),
          ("c_bf16", "plain_shards_kick"), ("writer_nohash", "writer"))


if __name__ == "__main__":
    main()
