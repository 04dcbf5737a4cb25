"""CPU benchmark: how fast the draft trainer's batches are built, before and after the change
that keeps hidden states in their stored dtype and builds batches ahead in a thread.

    python -m bench.cpu_draft_batches --out OUT

Why: on the H200 (2026-11-29), a 1-layer EAGLE-3 draft trained at 7.0-7.8 steps/s (batch
16, ~534 tokens per sample, 4 states of 512): the step waited for its batch, built in the
training loop (shard reads, NaN check, float32 padding of the hidden states). This measures
the batch side alone, side by side in one run, on a dataset of that shape written with the
real ``ShardWriter``; the GPU side is not measured here.

Paths (same batches, same order; checked), each alone and in a loop that also waits
``--step-ms`` per batch for the device (a ``time.sleep``, which releases the GIL as waiting
for CUDA does; a stand-in, not a GPU measurement):
  before     the old loop: ``dataset[i]`` + float32 ``collate``, in the loop
  bf16       the new ``collate`` (stored dtype), in the loop (``prefetch=0``, the CPU default)
  prefetch   the new ``collate`` built 3 batches ahead by ``train.prefetched`` (the CUDA
             default); alone it can only add the thread's overhead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_compat.eagle3.data import HiddenStatesDataset, ShardWriter
from vllm_compat.eagle3.training import StepBatches, collate, prefetched


def collate_float32(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The collate of 2026-11-29 before the change (hidden states padded in float32)."""
    t = max(s["input_ids"].shape[0] for s in samples)
    b = len(samples)
    hs0 = samples[0]["hidden_states"]
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "valid": torch.zeros(b, t, dtype=torch.bool),
        "hidden_states": torch.zeros(b, t, *hs0.shape[1:], dtype=torch.float32),
    }
    for i, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        out["input_ids"][i, :n] = s["input_ids"]
        out["loss_mask"][i, :n] = s["loss_mask"].bool()
        out["valid"][i, :n] = True
        out["hidden_states"][i, :n] = s["hidden_states"].float()
    return out


def write(directory: Path, n: int, hidden: int, min_len: int, max_len: int, seed: int) -> int:
    g = torch.Generator().manual_seed(seed)
    tokens = 0
    with ShardWriter(directory, hidden_size=hidden, aux_layer_ids=(2, 4, 5), final_layer_id=8,
                     dtype=torch.bfloat16, samples_per_shard=256) as w:
        for _ in range(n):
            m = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            tokens += m
            w.add({"input_ids": torch.randint(0, 8192, (m,), generator=g),
                   "loss_mask": torch.ones(m, dtype=torch.bool),
                   "hidden_states": torch.randn(m, 4, hidden, generator=g).to(torch.bfloat16)})
    return tokens


def run(ds: HiddenStatesDataset, sampler: StepBatches, fn, depth: int, step_s: float
        ) -> tuple[float, list]:
    t0 = time.perf_counter()
    shapes = []
    for b in prefetched(lambda idx: fn([ds[i] for i in idx]), sampler, depth):
        shapes.append(tuple(b["hidden_states"].shape))
        if step_s:
            time.sleep(step_s)  # the device step the batch would feed
    return time.perf_counter() - t0, shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/vllm-compat-bench")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=60.0,
                    help="simulated device step per batch in the loop paths")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="draft-batches-") as tmp:
        d = Path(tmp) / "ds"
        tokens = write(d, a.samples, a.hidden, a.min_len, a.max_len, 0)
        ds = HiddenStatesDataset(d)
        steps = len(ds) // a.batch
        sampler = StepBatches(len(ds), a.batch, steps, seed=0, start=0, stop=steps)
        st = a.step_ms / 1000
        paths = {
            "before": lambda: run(ds, sampler, collate_float32, 0, 0.0),
            "bf16": lambda: run(ds, sampler, collate, 0, 0.0),
            "prefetch": lambda: run(ds, sampler, collate, 3, 0.0),
            "before+step": lambda: run(ds, sampler, collate_float32, 0, st),
            "bf16+step": lambda: run(ds, sampler, collate, 0, st),
            "prefetch+step": lambda: run(ds, sampler, collate, 3, st),
        }
        times: dict[str, list[float]] = {k: [] for k in paths}
        ref = None
        for _ in range(a.repeats):  # interleaved: the machine's noise hits every path alike
            for name, fn in paths.items():
                dt, shapes = fn()
                ref = ref or shapes
                if shapes != ref:
                    raise RuntimeError(f"{name}: different batches")
                times[name].append(round(dt, 4))
        best = {k: min(v) for k, v in times.items()}
        res = {
            "schema": "vllm-compat-cpu-draft-batches/1",
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
            "dataset": {"samples": len(ds), "tokens": tokens, "hidden": a.hidden, "states": 4,
                        "dtype": "bfloat16", "bytes_hidden_states": tokens * 4 * a.hidden * 2},
            "batch": a.batch, "batches": steps, "repeats": a.repeats, "step_ms": a.step_ms,
            "seconds": times,
            "ms_per_batch_best": {k: round(1000 * v / steps, 2) for k, v in best.items()},
            "speedup_vs_before": {
                k: round(best["before+step" if k.endswith("+step") else "before"] / v, 2)
                for k, v in best.items()},
        }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cpu_draft_batches.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("ms_per_batch_best", "speedup_vs_before")}, indent=1))
    print(f"wrote {path}; median seconds: "
          f"{ {k: statistics.median(v) for k, v in times.items()} }")


if __name__ == "__main__":
    main()
