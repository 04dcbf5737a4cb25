"""Block hashes grounded in the engine: vLLM's own EngineCore (stand-in executor, no model)
admits requests through its front door; vllm_compat builds requests from the same tokens.
Same block hashes, and a prefix-cache hit for each after the other, in both orders, with
and without ``cache_salt``, on chat prompts with Kimi-K2.5's special and reserved ids.

The engine runs in a child process (engine_oracle.py says why).
"""

from __future__ import annotations

import functools
import json

import pytest

from .engine_checks import FULL_BLOCKS, assert_engine_and_library_share_blocks, run_engine_oracle
from .oracle import check_child


@functools.cache
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
