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
    a = ap.parse_args()
    data = samples(a.mib)
    views = as_views(data, a.step_samples)
    serial_cls, serial_rev = previous_writer()
    root = Path(a.dir) / "vllm-compat-shard-bench"
    fns = {"plain": lambda d: run_plain(d, data),
           "before": lambda d: run_before(d, data, a.samples_per_shard),
           "serial": lambda d: run_writer(d, data, a.samples_per_shard, serial_cls),
           "writer": lambda d: run_writer(d, data, a.samples_per_shard),
           "serial_views": lambda d: run_writer(d, views, a.samples_per_shard, serial_cls),
           "writer_views": lambda d: run_writer(d, views, a.samples_per_shard)}
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
    res = {"dir": a.dir, "mib": a.mib, "rounds": a.rounds, "samples_per_shard": a.samples_per_shard,
           "step_samples": a.step_samples, "serial_from": serial_rev, "cpus": os.cpu_count(),
           "torch": torch.__version__, "loadavg": os.getloadavg(), "runs": runs, "median_MB_s": med,
           "writer_vs_plain": round(med["writer"] / med["plain"], 3),
           "before_vs_plain": round(med["before"] / med["plain"], 3),
           "writer_vs_before": round(med["writer"] / med["before"], 3),
           "writer_vs_serial": round(med["writer"] / med["serial"], 3),
           "writer_views_vs_serial_views": round(med["writer_views"] / med["serial_views"], 3)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("median_MB_s", "writer_vs_plain", "before_vs_plain",
                                          "writer_vs_before", "writer_vs_serial",
                                          "writer_views_vs_serial_views", "loadavg")}))


if __name__ == "__main__":
    main()
