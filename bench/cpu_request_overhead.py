"""CPU micro-benchmark: vllm_compat.make_request + hasher vs the raw vLLM constructor + hasher.

Every variant builds a real Request with vLLM's own sha256 block hasher for the same
prompt. The variants run interleaved in one process, in a rotating order each round, and
each variant's ratio to the raw constructor is taken per round (wall times move with
whatever else the machine runs, so only ratios measured side by side are reported). Times
are the thread's CPU time (time.thread_time: time spent waiting for a core is not counted); wall
times are recorded too. Target: overhead <= 5 % (ratio <= 1.05) for the default path.

Variants:
  raw         Request(...) with kv_cache_utils.get_request_block_hasher (what fork code does)
  ours        make_request(id, prompt, sampling_params=sp, block_hasher=h): the default,
              validated path with a hasher built once (block_hasher_for / make_block_hasher)
  ours_auto   make_request(id, prompt, sampling_params=sp): hasher left to AUTO
  ours_vocab  as `ours`, plus vocab_size= (adds a max() over the prompt)
  ours_novalidate  as `ours` with validate=False

    python -m bench.cpu_request_overhead [--prompt-len 1024] [--rounds 800] [--n 10] [--out OUT.json]
Writes /tmp/vllm-compat-bench/cpu_request_overhead-<vllm version>.json unless ``--out`` says.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--vocab-size", type=int, default=151_936)
    ap.add_argument("--variants", default="ours,ours_auto,ours_vocab,ours_novalidate",
                    help="comma-separated variants to run beside raw")
    ap.add_argument("--no-components", action="store_true",
                    help="skip the per-component profile (where make_request's time goes)")
    ap.add_argument("--out", default=None, help="result file (default: /tmp/vllm-compat-bench/cpu_request_overhead-<vllm>.json)")
    args = ap.parse_args()

    import vllm
    from vllm import SamplingParams
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    import vllm_compat as vc
    from tests.conformance.engine_path import hash_fn

    rng = random.Random(0)
    prompt = [rng.randrange(args.vocab_size) for _ in range(args.prompt_len)]  # realistic ids
    sp = SamplingParams(max_tokens=16)
    ours_hasher = vc.make_block_hasher(16, "sha256")  # also runs init_none_hash
    raw_hasher = kcu.get_request_block_hasher(16, hash_fn("sha256"))
    raw_kw = dict(prompt_token_ids=prompt, sampling_params=sp, pooling_params=None, block_hasher=raw_hasher)
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:
        raw_kw["eos_token_id"] = None
    n, vocab = args.n, args.vocab_size
    make = vc.make_request

    def raw() -> None:
        for i in range(n):
            Request(request_id=str(i), **raw_kw)

    def ours() -> None:
        for i in range(n):
            make(str(i), prompt, sampling_params=sp, block_hasher=ours_hasher)

    def ours_auto() -> None:
        for i in range(n):
            make(str(i), prompt, sampling_params=sp)

    def ours_vocab() -> None:
        for i in range(n):
            make(str(i), prompt, sampling_params=sp, block_hasher=ours_hasher, vocab_size=vocab)

    def ours_novalidate() -> None:
        for i in range(n):
            make(str(i), prompt, sampling_params=sp, block_hasher=ours_hasher, validate=False)

    chosen = set(args.variants.split(",")) | {"raw"}
    variants = {f.__name__: f for f in (raw, ours, ours_auto, ours_vocab, ours_novalidate)
                if f.__name__ in chosen}
    expected = Request(request_id="x", **raw_kw).block_hashes
    assert make("x", prompt, sampling_params=sp, block_hasher=ours_hasher).block_hashes == expected
    assert make("x", prompt, sampling_params=sp).block_hashes == expected
    for fn in variants.values():  # warm-up
        fn()
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {k: [] for k in variants}  # CPU time
    walls: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for r in range(args.rounds):
        rot = order[r % len(order):] + order[:r % len(order)]
        for name in rot:
            w0, t0 = time.perf_counter(), time.thread_time()
            variants[name]()
            t1, w1 = time.thread_time(), time.perf_counter()
            times[name].append(t1 - t0)
            walls[name].append(w1 - w0)
    load_after = os.getloadavg()

    def us(name: str, src: dict[str, list[float]] = times) -> float:
        return statistics.median(src[name]) / n * 1e6

    def us_p10(name: str) -> float:  # the least disturbed rounds (cf. timeit's min)
        return sorted(times[name])[len(times[name]) // 10] / n * 1e6

    result: dict = {
        "vllm": vllm.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.cpu_request_overhead"] + sys.argv[1:]),
        "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
        "loadavg_1_5_15_after": [round(x, 2) for x in load_after],
        "cpu_count": os.cpu_count(),
        "prompt_len": args.prompt_len,
        "block_size": 16,
        "hash_algo": "sha256",
        "requests_per_round": n,
        "rounds": args.rounds,
        "timer": "time.thread_time (CPU time of the benchmark thread)",
        "raw_us_per_request_median": us("raw"),
        "raw_wall_us_per_request_median": us("raw", walls),
        "raw_us_per_request_p10": us_p10("raw"),
        "target_ratio": 1.05,
        "variants": {},
    }
    for name in variants:
        if name == "raw":
            continue
        ratios = sorted(o / r for o, r in zip(times[name], times["raw"]))
        wall_ratios = [o / r for o, r in zip(walls[name], walls["raw"])]
        result["variants"][name] = {
            "us_per_request_median": us(name),
            "us_per_request_p10": us_p10(name),
            "overhead_ratio_of_p10_times": us_p10(name) / us_p10("raw"),
            "wall_us_per_request_median": us(name, walls),
            "wall_overhead_ratio_median": statistics.median(wall_ratios),
            "overhead_ratio_median": statistics.median(ratios),
            "overhead_ratio_p10": ratios[int(0.1 * len(ratios))],
            "overhead_ratio_p90": ratios[int(0.9 * len(ratios))],
        }
    # the headline numbers: the default path
    if "ours" in result["variants"]:
        result["ours_us_per_request_median"] = result["variants"]["ours"]["us_per_request_median"]
        result["overhead_ratio_median"] = result["variants"]["ours"]["overhead_ratio_median"]
    if not args.no_components:
        result["components_us_median"] = components(prompt, sp, ours_hasher, raw_hasher, raw_kw,
                                                    vocab, args.rounds)
    out = Path(args.out) if args.out else (
        Path("/tmp/vllm-compat-bench") / f"cpu_request_overhead-{vllm.__version__}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def components(prompt, sp, hasher, raw_hasher, raw_kw, vocab, rounds) -> dict[str, float]:
    """Where make_request's time goes: each piece timed alone, interleaved, CPU time."""
    import marshal
    from array import array

    from vllm.v1.request import Request

    import vllm_compat as vc
    from vllm_compat.requests import _check_prompt, _fast_ok

    def check_before_this_change(ids):  # list + array("q") + min + max + tolist
        ids = list(ids)
        arr = array("q", ids)
        _ = min(arr) < 0 or max(arr) >= vocab
        return arr.tolist()

    no_hash_kw = dict(raw_kw, block_hasher=None)
    pieces = {
        "raw Request + vLLM hasher": lambda: Request(request_id="1", **raw_kw),
        "raw Request, no hasher": lambda: Request(request_id="1", **no_hash_kw),
        "raw Request + our BlockHasher": lambda: Request(request_id="1", **dict(raw_kw, block_hasher=hasher)),
        "make_request(validate=False), no hasher":
            lambda: vc.make_request("1", prompt, sampling_params=sp, block_hasher=None, validate=False),
        "make_request, no hasher": lambda: vc.make_request("1", prompt, sampling_params=sp, block_hasher=None),
        "_check_prompt: copy + marshal check": lambda: _check_prompt(prompt),
        "list copy": lambda: prompt.copy(),
        "marshal.dumps(ids, 2)": lambda: marshal.dumps(prompt, 2),
        "_fast_ok: marshal + 2 byte slices": lambda: _fast_ok(prompt),
        "max(ids): the vocab_size check": lambda: max(prompt),
        "alternative: sum(ids) + array('Q', ids)": lambda: (sum(prompt), array("Q", prompt)),
        "alternative: min(ids) + max(ids)": lambda: (min(prompt), max(prompt)),
        "check before this change": lambda: check_before_this_change(prompt),
        "make_block_hasher(16), cached": lambda: vc.make_block_hasher(16),
    }
    k = 20
    samples: dict[str, list[float]] = {name: [] for name in pieces}
    for fn in pieces.values():
        fn()
    for _ in range(rounds):
        for name, fn in pieces.items():
            t0 = time.thread_time()
            for _ in range(k):
                fn()
            samples[name].append((time.thread_time() - t0) / k * 1e6)
    return {name: round(statistics.median(v), 2) for name, v in samples.items()}


if __name__ == "__main__":
    main()
