"""The shard digest: one whole-file sha256 against ``sha256_tree`` (per-piece sha256s on a
thread pool), side by side on the same bytes, interleaved per round.

    python -m bench.cpu_shard_digest --mib 256 --rounds 5 --out OUT.json

Why: one sha256 runs on one core (~1.6-2 GB/s), slower than a fast disk; ``ShardWriter``
without its digest (``python -m bench.cpu_shard_writer``'s ``writer_nohash``) ran at the disk's
speed on an H200 host, and at 0.61 of it with a whole-file sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

from vllm_compat.eagle3 import data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="/tmp/vllm-compat-bench/cpu_shard_digest.json")
    a = ap.parse_args()
    buf = os.urandom(a.mib << 20)
    fns = {"sha256": lambda: hashlib.sha256(buf).hexdigest(),
           "sha256_tree": lambda: data.sha256_tree([buf])}
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(a.rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            runs[name].append(round(len(buf) / (time.perf_counter() - t0) / 1e6, 1))
    med = {k: statistics.median(v) for k, v in runs.items()}
    res = {"mib": a.mib, "rounds": a.rounds, "cpus": os.cpu_count(),
           "pool_threads": data._pool()._max_workers, "piece_bytes": data.DIGEST_PIECE,
           "loadavg": os.getloadavg(), "MB_s": runs, "median_MB_s": med,
           "tree_vs_sha256": round(med["sha256_tree"] / med["sha256"], 3)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("median_MB_s", "tree_vs_sha256", "cpus", "loadavg")}))


if __name__ == "__main__":
    main()
