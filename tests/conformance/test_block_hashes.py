"""Block-hash parity with vLLM's engine-core path, NONE_HASH seeding, init ordering."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_compat as vc
from vllm_compat.errors import StaleBlockHasherError, VllmCompatError

from .engine_path import engine_request, hash_fn
from . import reference
from .oracle import oracle_failed, outdated

ROOT = Path(__file__).resolve().parents[2]


def algorithms() -> list[str]:
    names = list(vc.adapter().hash_function_names())
    if importlib.util.find_spec("xxhash") is None:  # xxhash algos need the package
        names = [n for n in names if not n.startswith("xxhash")]
    return names


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.lists(st.integers(0, 150_000), min_size=1, max_size=300),
    block_size=st.sampled_from([1, 2, 3, 7, 16, 32, 64]),
    algo_index=st.integers(0, 3),
)
def test_hashes_equal_the_engine_core_path(tokens, block_size, algo_index):
    algos = algorithms()
    algo = algos[algo_index % len(algos)]
    ours = vc.make_request("ours", tokens, block_size=block_size, hash_algo=algo).block_hashes
    # Same process, NONE_HASH as our make_block_hasher left it: the engine's hasher and
    # Request.from_engine_core_request must give the very same chain.
    engine = engine_request(algo, block_size, tokens, init=False).block_hashes
    assert ours == engine
    assert len(ours) == len(tokens) // block_size


def test_hashes_extend_during_decode_like_the_engine():
    tokens = list(range(1, 40))
    ours = vc.make_request("ours", tokens, block_size=16)
    engine = engine_request("sha256", 16, tokens, init=False)
    for t in range(50, 60):
        ours.append_output_token_ids(t)
        engine.append_output_token_ids(t)
    assert ours.block_hashes == engine.block_hashes and len(ours.block_hashes) == 3


@pytest.mark.parametrize("bad", [0, -16, 1.5, "16", True, None])
def test_bad_block_size_is_a_clear_error(bad):
    with pytest.raises(VllmCompatError, match="block_size must be a positive integer"):
        vc.make_block_hasher(bad)


def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(VllmCompatError, match="unknown hash algorithm 'md5'.*supports"):
        vc.make_block_hasher(16, "md5")


def test_reinit_by_someone_else_makes_old_hasher_refuse():
    h = vc.make_block_hasher(16, "sha256")
    engine_root = b"\x01" * 32
    with reference.engine_none_hash(engine_root):  # what an in-process EngineCore does
        with pytest.raises(StaleBlockHasherError, match="re-initialised"):
            vc.make_request("r", list(range(40)), block_hasher=h)
        # A new hasher adopts the engine's root instead of re-seeding under it.
        fresh = vc.make_block_hasher(16, "sha256")
        assert fresh.none_hash == engine_root and reference.none_hash() == engine_root
        tokens = list(range(40))
        assert (vc.make_request("r", tokens, block_hasher=fresh).block_hashes
                == engine_request("sha256", 16, tokens, init=False).block_hashes)


def test_switching_algorithm_reinitialises_and_old_hashers_refuse():
    algos = algorithms()
    if len(algos) < 2:
        pytest.skip("this release offers one hash algorithm")
    a = vc.make_block_hasher(16, algos[0])
    b = vc.make_block_hasher(16, algos[1])
    tokens = list(range(40))
    assert vc.make_request("r", tokens, block_hasher=b).block_hashes
    if a.none_hash != b.none_hash:  # random roots (<=0.28 unseeded) or per-algo seeds
        with pytest.raises(StaleBlockHasherError):
            vc.make_request("r", tokens, block_hasher=a)


def test_threads_share_one_consistent_hasher():
    with ThreadPoolExecutor(16) as pool:
        hashers = list(pool.map(lambda _: vc.make_block_hasher(16, "sha256"), range(64)))
    assert len({h.none_hash for h in hashers}) == 1
    tokens = list(range(64))
    assert len({tuple(vc.make_request("r", tokens, block_hasher=h).block_hashes) for h in hashers}) == 1


# ---------------------------------------------------------------- fresh processes


def _probe(algo: str, order: str, seed: str | None, block_size: int = 16) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-m", "tests.conformance.hash_probe", algo, str(block_size), order],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert lines, f"probe failed (rc={p.returncode}):\n{err[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _engine(r: dict) -> list[str]:
    if "oracle_error" in r:
        oracle_failed("the engine-core path in a fresh process (hash_probe)",
                      RuntimeError(r["oracle_error"]))
    return r["engine"]


@pytest.fixture(scope="module")
def fresh_processes():
    """All fresh-process probes, started together (each pays vLLM's import once)."""
    procs = {
        "unseeded": _probe("sha256", "engine-first", None),
        "ours_first": _probe("sha256", "ours-first", None),  # unseeded too
        "seeded": _probe("sha256", "raw-then-engine", "1234"),
    }
    return {k: _result(p) for k, p in procs.items()}


def test_same_process_engine_and_ours_agree(fresh_processes):
    for name in ("unseeded", "seeded", "ours_first"):
        r = fresh_processes[name]
        assert r["ours"] == _engine(r) and len(r["ours"]) == 3, name


def test_none_hash_seeding_rules_across_processes(fresh_processes, info):
    a, b = fresh_processes["unseeded"]["ours"], fresh_processes["ours_first"]["ours"]
    if info.probes["fixed_none_hash_seed"]:
        # 0.29+: sha256 seeds NONE_HASH from the fixed "vllm-none-hash".
        assert a == b
        seed = "vllm-none-hash"
    else:
        # <= 0.28: NONE_HASH = os.urandom(32) per process without PYTHONHASHSEED.
        assert a != b
        seed = None
    fn = hash_fn("sha256")
    tokens = list(range(100, 116))
    seeded_first = reference.hash_block_tokens(fn, fn("1234"), tokens, None)
    seeded_root = reference.hash_block_tokens(fn, fn(seed), tokens, None) if seed else None
    assert fresh_processes["seeded"]["ours"][0] == seeded_first.hex()  # PYTHONHASHSEED wins
    if seed is not None:
        assert a[0] == seeded_root.hex()


def test_fresh_process_asking_for_a_hasher_first_works(fresh_processes):
    r = fresh_processes["ours_first"]
    assert r["init_calls"] == 1 and r["distinct_none_hashes"] == 1  # 16 racing threads
    assert len(r["ours"]) == 3


def test_raw_hashing_without_init_none_hash_fails(fresh_processes):
    # vLLM's hasher reads the NONE_HASH global, which does not exist until init_none_hash.
    # Which exception vLLM raises for it is vLLM's business: the test asks only that the raw
    # path gives no hashes where vllm_compat's does.
    r = fresh_processes["seeded"]
    if "error" not in r:  # vLLM hashes without init_none_hash now: the premise is outdated
        outdated(f"raw hashing before init_none_hash gave hashes {r.get('raw_without_init')}")
    assert "raw_without_init" not in r and len(r["ours"]) == 3, r
