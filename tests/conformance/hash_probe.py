"""Run in a fresh process: print the first block hashes of a fixed prompt, two ways.

``ours``: vllm_compat.make_request with its default hasher.
``engine``: vLLM's engine-core sequence (get_hash_fn_by_name -> init_none_hash ->
get_request_block_hasher -> Request.from_engine_core_request), as EngineCore does it.
Usage: python hash_probe.py ALGO BLOCK_SIZE ORDER   (ORDER: ours-first | engine-first | raw-then-engine)
``raw-then-engine`` first hashes without init_none_hash, as old fork code did (expected to
fail), then runs the engine-first path in the same process.
"""

from __future__ import annotations

import json
import os
import sys
import threading

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def engine_path_hashes(algo: str, block_size: int, tokens: list[int], init: bool = True) -> list[str]:
    from tests.conformance.engine_path import engine_request

    # unwrapped: this process reports the oracle's failure, the test decides (oracle.py)
    raw = engine_request.__wrapped__
    return [h.hex() for h in raw(algo, block_size, tokens, init=init).block_hashes]


def _engine(out: dict, algo: str, block_size: int, tokens: list[int], init: bool) -> None:
    # the oracle: on a drifted build its failure is reported, not raised (see oracle.py)
    try:
        out["engine"] = engine_path_hashes(algo, block_size, tokens, init=init)
    except Exception as exc:  # noqa: BLE001
        out["oracle_error"] = f"{type(exc).__name__}: {exc}"


def main() -> None:
    from tests.conformance.drift_inject import apply_from_env

    apply_from_env()  # the parent test run's simulated drift, if any
    algo, block_size, order = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tokens = list(range(100, 100 + 3 * block_size + 5))
    out: dict[str, object] = {}
    if order == "raw-then-engine":
        # What fork code did before it learned about init_none_hash: hash without it.
        try:
            out["raw_without_init"] = engine_path_hashes(algo, block_size, tokens, init=False)
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            out["error"] = f"{type(exc).__name__}: {exc}"
        order = "engine-first"
    if order == "ours-first":
        import vllm_compat as vc
        from vllm_compat.hashing import none_hash_init_count

        barrier = threading.Barrier(16)
        hashers = []

        def worker() -> None:
            barrier.wait()
            hashers.append(vc.make_block_hasher(block_size, algo))

        threads = [threading.Thread(target=worker) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["init_calls"] = none_hash_init_count()
        out["distinct_none_hashes"] = len({h.none_hash for h in hashers})
        req = vc.make_request("r", tokens, block_hasher=hashers[0])
        out["ours"] = [h.hex() for h in req.block_hashes]
        _engine(out, algo, block_size, tokens, init=False)
    else:
        _engine(out, algo, block_size, tokens, init=True)
        import vllm_compat as vc

        out["ours"] = [h.hex() for h in vc.make_request("r", tokens, block_size=block_size,
                                                           hash_algo=algo).block_hashes]
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
