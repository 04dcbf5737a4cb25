"""Block hashes grounded in the engine: vLLM's own EngineCore (stand-in executor, no model)
admits requests through its front door; vllm_compat builds requests from the same tokens.
Same block hashes, and a prefix-cache hit for each after the other, in both orders, with
and without ``cache_salt``, on chat prompts with Kimi-K2.5's special and reserved ids.

The engine runs in a child process (engine_oracle.py says why).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .oracle import check_child

ROOT = Path(__file__).resolve().parents[2]
FULL_BLOCKS = 5  # engine_oracle.chat_tokens: 5 full blocks of 16 and 7 tokens


def run_engine_oracle(algo: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.conformance.engine_oracle", algo],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, **(env or {})})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the engine oracle printed no result:\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def assert_engine_and_library_share_blocks(result: dict) -> None:
    """What the engine oracle must show on a build where vllm_compat hashes like the engine."""
    for row in result["cases"]:
        first = row["first"]
        second = "vllm_compat" if first == "engine" else "engine"
        case = f"{first} first, salts {row['salt']!r} / {row['other_salt']!r}"
        assert row[first]["cached"] == 0, f"{case}: a cold prompt was served from the cache"
        assert len(row[first]["hashes"]) == FULL_BLOCKS, case
        if row["salt"] == row["other_salt"]:
            assert row[second]["hashes"] == row[first]["hashes"], f"{case}: other block hashes"
            assert row[second]["cached"] == FULL_BLOCKS * 16, f"{case}: no prefix-cache hit"
        else:  # another tenant's salt: another chain, no hit (the salt is in the hash)
            assert row[second]["hashes"][0] != row[first]["hashes"][0], case
            assert row[second]["cached"] == 0, case


@functools.lru_cache(maxsize=None)
def engine_result(algo: str) -> str:  # one engine process per algorithm and test run
    return json.dumps(run_engine_oracle(algo))


@pytest.fixture(scope="module")
def algos() -> list[str]:
    from vllm_compat.hash_check import offered_algorithms

    return offered_algorithms()


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_engine_admitted_and_library_built_requests_share_prefix_cache_blocks(algo, algos):
    if algo not in algos:
        pytest.skip(f"{algo} is not offered by this vLLM")
    result = check_child(json.loads(engine_result(algo)))
    assert_engine_and_library_share_blocks(result)


def test_block_hasher_for_hands_out_the_engines_own_hasher():
    result = check_child(json.loads(engine_result("sha256")))
    assert "block_hasher_for_error" not in result, result.get("block_hasher_for_error")
    assert result["for_core"] == {"source": "engine", "is_engine_hasher": True,
                                  "cached": FULL_BLOCKS * 16}
    # the scheduler an EngineCore owns: the engine's hasher where the engine can be found
    # from it (not after the engine froze its GC heap, 0.16+), else ours, checked
    assert result["for_scheduler"]["equal"] is True
    assert result["for_scheduler"]["source"] in ("engine", "vllm_compat")
