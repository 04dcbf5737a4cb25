"""Many threads at once: ``detect()``, hasher creation and vLLM's ``init_none_hash``.

Each scenario runs in a fresh process (``NONE_HASH`` unset, nothing detected yet, no
PYTHONHASHSEED), where 16 threads start together at a barrier. vLLM's ``init_none_hash``
is wrapped to count its calls and to sleep 50 ms, which holds the window between "is
NONE_HASH set?" and "set it" open for every thread: without a guard, all of them get in.

- ``guarded``: vllm_compat as shipped. One ``init_none_hash`` call, one NONE_HASH, one hash
  chain (equal to vLLM's engine-core path), one ``VllmInfo``.
- ``unguarded``: the same with ``vllm_compat.hashing._lock`` replaced by a no-op, to show
  the ``guarded`` assertions can fail: ``init_none_hash`` runs once per thread, and on
  releases with a random NONE_HASH (<= 0.28) the threads end up with different roots.
- ``raw``: what code calling vLLM directly does (``init_none_hash`` then
  ``get_request_block_hasher`` per thread): distinct roots on <= 0.28, one on 0.29+.

Run as ``python -m tests.conformance.test_concurrency MODE`` it is the probe itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .oracle import check_child, child_main

ROOT = Path(__file__).resolve().parents[2]
THREADS = 16
MODES = ("guarded", "unguarded", "raw")


def _probe(mode: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for k, v in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("VLLM_LOGGING_LEVEL", "ERROR")):
        env.setdefault(k, v)
    return subprocess.Popen([sys.executable, "-m", "tests.conformance.test_concurrency", mode],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs():
    procs = {m: _probe(m) for m in MODES}  # started together: each pays vLLM's import once
    out = {}
    for mode, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"{mode} probe failed (rc={p.returncode}):\n{stderr[-3000:]}"
        out[mode] = json.loads(lines[-1][len("RESULT "):])
    print(json.dumps(out, indent=1))  # shown with -rP
    for r in out.values():  # the probe's own raw-vLLM code failed: the oracle's, not ours
        check_child(r)
    return out


def test_detect_from_many_threads_is_one_result(runs):
    r = runs["guarded"]
    assert r["distinct_detect_results"] == 1 and r["distinct_adapters"] == 1 and not r["errors"], r


def test_hashers_from_many_threads_share_one_init_and_one_root(runs):
    r = runs["guarded"]
    assert r["errors"] == [], r
    assert r["vllm_init_calls"] == 1 and r["our_init_calls"] == 1, r
    assert r["distinct_none_hashes"] == 1, r
    assert r["distinct_chains"] == 1 and r["chains"] == THREADS and r["matches_engine_path"], r


def test_the_guarded_checks_fail_without_the_init_lock(runs, info):
    r = runs["unguarded"]
    # what test_hashers_from_many_threads_share_one_init_and_one_root asserts, now false:
    assert r["vllm_init_calls"] > 1 and r["our_init_calls"] > 1, r
    if not info.probes["fixed_none_hash_seed"]:  # <= 0.28: every init draws a new root
        assert r["distinct_none_hashes"] > 1 and r["stale_hashers"] > 0, r
        assert r["distinct_chains"] > 1 and not r["matches_engine_path"], r


def test_raw_vllm_path_from_many_threads(runs, info):
    r = runs["raw"]
    assert r["vllm_init_calls"] == THREADS, r
    if info.probes["fixed_none_hash_seed"]:  # 0.29+: sha256 roots are fixed, races are harmless
        assert r["distinct_none_hashes"] == 1, r
    else:  # <= 0.28: each thread hashed under its own random root
        assert r["distinct_none_hashes"] > 1, r


# ----------------------------------------------------------------------------- the probe


def _main(mode: str) -> None:
    import contextlib
    import threading
    import time

    import vllm_compat as vc
    from vllm_compat import hashing
    from vllm_compat.errors import StaleBlockHasherError

    from tests.conformance import reference
    from tests.conformance.engine_path import engine_request, hash_fn

    calls: list[int] = []

    def counted(real_init):
        def slow_init(fn):
            calls.append(threading.get_ident())
            time.sleep(0.05)
            return real_init(fn)
        return slow_init

    # the probe's own raw-vLLM knowledge: where vLLM keeps init_none_hash
    reference.wrap_init_none_hash(counted)
    kcu = reference.kv_cache_utils()
    if mode == "unguarded":
        hashing._lock = contextlib.nullcontext()

    tokens = list(range(100, 100 + 3 * 16 + 5))
    barrier = threading.Barrier(THREADS)
    lock = threading.Lock()
    got: dict[str, list] = {"detect": [], "adapter": [], "hasher": [], "chain": [], "root": [], "errors": []}

    def run(fn) -> None:
        def worker(i: int) -> None:
            barrier.wait()
            try:
                fn(i)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                with lock:
                    got["errors"].append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    out: dict[str, object] = {"mode": mode}
    if mode == "raw":
        def raw(i: int) -> None:
            fn = hash_fn("sha256")
            kcu.init_none_hash(fn)
            root = kcu.NONE_HASH
            kcu.get_request_block_hasher(16, fn)
            with lock:
                got["root"].append(root)

        run(raw)
        out.update(vllm_init_calls=len(calls), distinct_none_hashes=len(set(got["root"])),
                   errors=got["errors"])
    else:
        def first_use(i: int) -> None:
            info, ad = vc.detect(), vc.adapter()
            with lock:
                got["detect"].append(id(info))
                got["adapter"].append(id(ad))

        run(first_use)

        def hasher_or_request(i: int) -> None:
            if i % 2:  # half build a hasher, half a request (which builds one itself)
                h = vc.make_block_hasher(16, "sha256")
                chain = vc.make_request(f"r{i}", tokens, block_hasher=h).block_hashes
            else:
                h, chain = None, vc.make_request(f"r{i}", tokens, block_size=16).block_hashes
            with lock:
                got["hasher"].append(h)
                got["chain"].append(tuple(chain))

        run(hasher_or_request)
        hashers = [h for h in got["hasher"] if h is not None]
        stale = 0
        for h in hashers:  # built during the race: do they still agree with NONE_HASH now?
            try:
                vc.make_request("check", tokens, block_hasher=h)
            except StaleBlockHasherError:
                stale += 1
        engine = tuple(engine_request("sha256", 16, tokens, init=False).block_hashes)
        out.update(
            distinct_detect_results=len(set(got["detect"])), distinct_adapters=len(set(got["adapter"])),
            vllm_init_calls=len(calls), our_init_calls=hashing.none_hash_init_count(),
            distinct_none_hashes=len({getattr(h, "none_hash", None) for h in hashers}),
            stale_hashers=stale, chains=len(got["chain"]), distinct_chains=len(set(got["chain"])),
            matches_engine_path=set(got["chain"]) == {engine}, errors=got["errors"],
        )
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    child_main(lambda: _main(sys.argv[1]))
