"""The finiteness check run on every sample's states (online training, the dataset reader's
``check_finite``): ``torch.isfinite(t).all()`` against ``eagle3.data.all_finite`` (one
``aminmax`` pass), side by side on the same tensor, interleaved per round.

    python -m bench.cpu_finite_check --tokens 1024 --layers 4 --hidden 2048 --out OUT.json

Why: online training checks each sample on the host as it arrives from the extractor, in the
thread that feeds the trainer; bf16 ``isfinite`` has no vectorised CPU kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from vllm_compat.eagle3.data import all_finite


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="/tmp/vllm-compat-bench/cpu_finite_check.json")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    t = torch.randn(a.tokens, a.layers, a.hidden).to(getattr(torch, a.dtype))
    fns = {"isfinite_all": lambda: bool(torch.isfinite(t).all()), "all_finite": lambda: all_finite(t)}
    for f in fns.values():
        assert f()  # warm, and both say finite
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(a.rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            runs[name].append(round((time.perf_counter() - t0) * 1e3, 3))
    med = {k: statistics.median(v) for k, v in runs.items()}
    res = {"tokens": a.tokens, "layers": a.layers, "hidden": a.hidden, "dtype": a.dtype,
           "rounds": a.rounds, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__, "ms_per_sample": runs, "median_ms": med,
           "speedup": round(med["isfinite_all"] / med["all_finite"], 2)}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"median_ms": med, "speedup": res["speedup"], "results": str(out)}))
    return res


if __name__ == "__main__":
    main()
