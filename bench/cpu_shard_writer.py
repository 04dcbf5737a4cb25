"""ShardWriter throughput against a plain write + fsync of the same bytes (issue 4, path (c)).

On the H200 host the extractor's disk path ran at 0.16-0.22 of the disk's own speed, and the
writer (not the disk) was busy: serialising with ``safetensors.torch.save`` (one extra copy of
every byte), sha256, then the write. This measures, side by side and interleaved per round:

- ``plain``: the shard's tensor bytes written with one ``os.write`` loop + fsync;
- ``before``: the previous flush path: ``safetensors.torch.save`` to bytes, sha256, atomic write;
- ``serial``: ``ShardWriter`` as it was before sha256 ran beside the write (its ``data.py`` is
  read from git: the parent of the commit that removed ``_owning``, which copied views);
- ``writer``: ``ShardWriter`` as it is now (header + tensor buffers streamed, no joined copy,
  sha256 in a thread while the temporary file is written, views written as they are);
- ``serial_views`` / ``writer_views``: the same two fed what the extractor hands out, views of
  one host buffer per engine step (``--step-samples`` samples each).

Sixth session (the disk path on the H200 hosts ran at 0.67-0.74 of a plain write in bf16 and
0.26-0.32 in FP8), only when named in ``--modes``:

- ``plain_shards`` / ``plain_shards_kick``: the plain write cut into one file per shard, each
  fsync'ed (the durability the writer gives), without / with the writeback kick
  (``vllm_compat.locking.WRITEBACK_KICK_BYTES``: ``posix_fadvise(DONTNEED)`` every 32 MiB);
- ``writer_nokick``: ``writer`` with the kick off;
  ``writer_nohash``: diagnostic only, sha256 replaced by a constant (what hashing costs);
- ``c_bf16``, ``c_fp8_serial``, ``c_fp8``: ``bench/gpu_extraction.py``'s ``DurableShardWriter``
  (the GPU benchmark's path (c)) fed the samples: bf16; FP8 encoded on the writer thread (as
  the sixth session's H200 run did); FP8 encoded on a thread of its own.

    PYTHONPATH=src python bench/cpu_shard_writer.py --dir /data --mib 4096 --rounds 3 \
        --samples-per-shard 16 --modes plain,plain_shards,plain_shards_kick,writer,writer_nokick,c_bf16,c_fp8_serial,c_fp8

    PYTHONPATH=src python bench/cpu_shard_writer.py --dir /dev/shm --mib 512 --rounds 5

``--dir /dev/shm`` (tmpfs) takes the disk out, so what is left is the writer's own CPU cost.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from vllm_compat.eagle3.data import ShardWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from git_history import before_change, full_sha, module_at  # noqa: E402  (bench/ is not a package)

DATA = "src/vllm_compat/eagle3/data.py"
from vllm_compat import locking
from vllm_compat.locking import atomic_write_bytes

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


def run_before(d: Path, data: list[dict[str, torch.Tensor]], per_shard: int) -> int:
    n = 0
    for k in range(0, len(data), per_shard):
        tensors = {f"{i}.{key}": t for i, s in enumerate(data[k:k + per_shard]) for key, t in s.items()}
        payload = safetensors_bytes(tensors)
        hashlib.sha256(payload).hexdigest()
        atomic_write_bytes(d / f"before-{k:05d}.safetensors", payload)
        n += len(payload)
    return n


def previous_writer() -> tuple[type, str]:
    """``ShardWriter`` just before the change that removed ``_owning`` (it copied views, and
    hashed before writing)."""
    rev = before_change("def _owning(", DATA)
    if rev is None:
        raise SystemExit("no commit with the serial ShardWriter in this clone's history")
    mod = module_at(rev, DATA, "vllm_compat.eagle3._data_serial", package="vllm_compat.eagle3")
    return mod.ShardWriter, full_sha(rev)


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


def run_durable(d: Path, data: list[dict[str, torch.Tensor]], per_shard: int, fp8: bool,
                encode_thread: bool = True) -> int:
    """The GPU benchmark's path (c) writer, fed the samples as the extraction loop does."""
    from gpu_extraction import DurableShardWriter
    w = DurableShardWriter(d / "ds", hidden_size=H, layer_ids=[1, 2, 3, 4], fp8=fp8,
                           samples_per_shard=per_shard, max_queue=4 * per_shard,
                           encode_thread=encode_thread)
    for s in data:
        w.put(s["input_ids"], s["hidden_states"])
    w.close()
    return w.file_bytes()


def run_writer(d: Path, data: list[dict[str, torch.Tensor]], per_shard: int,
               cls: type = ShardWriter) -> int:
    with cls(d / "ds", hidden_size=H, aux_layer_ids=[1, 2, 3], final_layer_id=4,
                     dtype=torch.bfloat16, samples_per_shard=per_shard) as w:
        for s in data:
            w.add(s)
    return sum(s["bytes"] for s in w.manifest.shards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples-per-shard", type=int, default=8)
    ap.add_argument("--step-samples", type=int, default=16, help="samples per engine-step buffer (views)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_shard_writer.json"))
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated, from {','.join(DEFAULT_MODES + EXTRA_MODES)}")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    unknown = set(modes) - set(DEFAULT_MODES + EXTRA_MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}")
    data = samples(a.mib)
    views = as_views(data, a.step_samples)
    serial_cls, serial_rev = previous_writer() if {"serial", "serial_views"} & set(modes) \
        else (None, None)
    root = Path(a.dir) / "vllm-compat-shard-bench"
    per = a.samples_per_shard
    every = {"plain": lambda d: run_plain(d, data),
             "before": lambda d: run_before(d, data, per),
             "serial": lambda d: run_writer(d, data, per, serial_cls),
             "writer": lambda d: run_writer(d, data, per),
             "serial_views": lambda d: run_writer(d, views, per, serial_cls),
             "writer_views": lambda d: run_writer(d, views, per),
             "plain_shards": lambda d: run_plain_shards(d, data, per, kick=False),
             "plain_shards_kick": lambda d: run_plain_shards(d, data, per, kick=True),
             "writer_nokick": lambda d: run_writer_nokick(d, data, per),
             "writer_nohash": lambda d: run_writer_nohash(d, data, per),
             "c_bf16": lambda d: run_durable(d, data, per, fp8=False),
             "c_fp8_serial": lambda d: run_durable(d, data, per, fp8=True, encode_thread=False),
             "c_fp8": lambda d: run_durable(d, data, per, fp8=True)}
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
            runs[name].append({"round": r, "seconds": round(dt, 4), "MB_s": round(nbytes / dt / 1e6, 1)})
    shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(x["MB_s"] for x in v) for k, v in runs.items()}
    ratios = {f"{x}_vs_{y}": round(med[x] / med[y], 3) for x, y in RATIOS if x in med and y in med}
    res = {"dir": a.dir, "mib": a.mib, "rounds": a.rounds, "samples_per_shard": a.samples_per_shard,
           "step_samples": a.step_samples, "serial_from": serial_rev, "cpus": os.cpu_count(),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "writeback_kick_bytes": locking.WRITEBACK_KICK_BYTES, "loadavg": os.getloadavg(),
           "runs": runs, "median_MB_s": med, **ratios}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({"median_MB_s": med, **ratios, "loadavg": res["loadavg"]}))


DEFAULT_MODES = ("plain", "before", "serial", "writer", "serial_views", "writer_views")
EXTRA_MODES = ("plain_shards", "plain_shards_kick", "writer_nokick", "writer_nohash", "c_bf16",
               "c_fp8_serial", "c_fp8")
RATIOS = (("writer", "plain"), ("before", "plain"), ("writer", "before"), ("writer", "serial"),
          ("writer_views", "serial_views"), ("plain_shards", "plain"),
          ("plain_shards_kick", "plain_shards"), ("writer", "writer_nokick"),
          ("writer", "plain_shards_kick"), ("c_bf16", "plain"), ("c_fp8", "c_fp8_serial"),
          ("c_fp8", "plain"), ("writer_nohash", "writer"),
          ("c_bf16", "plain_shards_kick"), ("c_fp8", "plain_shards_kick"))


if __name__ == "__main__":
    main()
