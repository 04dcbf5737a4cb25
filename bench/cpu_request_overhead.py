"""CPU micro-benchmark: vllm_compat.make_request + hasher vs the raw vLLM constructor + hasher.

Both sides build a real Request with vLLM's own block hasher for the same prompt; they
run interleaved in one process (this machine is noisy, so only the ratio measured side
by side is reported). Target: overhead <= 5 %.

    python bench/cpu_request_overhead.py [--prompt-len 1024] [--rounds 30] [--n 200]
Writes bench/results/cpu_request_overhead-<vllm version>.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()

    import vllm
    from vllm import SamplingParams
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    import vllm_compat as vc
    from tests.conformance.engine_path import hash_fn

    prompt = list(range(1000, 1000 + args.prompt_len))
    sp = SamplingParams(max_tokens=16)
    ours_hasher = vc.make_block_hasher(16, "sha256")  # also runs init_none_hash
    raw_hasher = kcu.get_request_block_hasher(16, hash_fn("sha256"))
    raw_kw = dict(prompt_token_ids=prompt, sampling_params=sp, pooling_params=None, block_hasher=raw_hasher)
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:
        raw_kw["eos_token_id"] = None

    def raw() -> None:
        for i in range(args.n):
            Request(request_id=str(i), **raw_kw)

    def ours() -> None:
        for i in range(args.n):
            vc.make_request(str(i), prompt, sampling_params=sp, block_hasher=ours_hasher)

    assert vc.make_request("x", prompt, sampling_params=sp, block_hasher=ours_hasher).block_hashes == \
        Request(request_id="x", **raw_kw).block_hashes
    raw(), ours()  # warm-up
    t_raw, t_ours = [], []
    for r in range(args.rounds):
        for fn, sink in ((raw, t_raw), (ours, t_ours)) if r % 2 == 0 else ((ours, t_ours), (raw, t_raw)):
            t0 = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - t0)
    ratios = [o / r for o, r in zip(t_ours, t_raw)]
    result = {
        "vllm": vllm.__version__,
        "prompt_len": args.prompt_len,
        "requests_per_round": args.n,
        "rounds": args.rounds,
        "raw_us_per_request_median": statistics.median(t_raw) / args.n * 1e6,
        "ours_us_per_request_median": statistics.median(t_ours) / args.n * 1e6,
        "overhead_ratio_median": statistics.median(ratios),
        "overhead_ratio_p90": sorted(ratios)[int(0.9 * len(ratios))],
        "target_ratio": 1.05,
    }
    out = Path(__file__).parent / "results" / f"cpu_request_overhead-{vllm.__version__}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
