"""A vLLM build whose engine hashes otherwise than vllm_compat (``salted_engine_hash``: the
function EngineCore builds its request hasher with is salted; vLLM's hash helpers and
``hash_block_tokens`` are unchanged, so a reference replaying them sees nothing).

doctor --drift must report it (exit 1, ``differs: engine``), block_hasher_for must refuse
ours for a standalone scheduler and hand out the engine's own hasher for an engine, and the
engine-grounded oracle must fail on it. Each in a fresh process, the drift made in the
installed vLLM before vllm_compat reads it (drift_inject.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .engine_checks import (
    FULL_BLOCKS,
    assert_engine_and_library_share_blocks,
    run_engine_oracle,
)

ROOT = Path(__file__).resolve().parents[2]
KIND = "salted_engine_hash"


def run_drift_probe(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.conformance.drift_inject", kind],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the drift probe printed no result:\n{out.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def salted() -> dict:
    return run_drift_probe(KIND)


def test_doctor_reports_the_engines_other_hashes_and_exits_1(salted):
    assert salted["doctor_exit"] == 1
    checks = salted["doctor"]["hash_check"]["checks"]
    assert checks and all(c["differs"] == "engine" for c in checks)
    items = [i for i in salted["doctor"]["drift"]["items"] if i["kind"] == "hash_scheme_changed"]
    assert {i["symbol"] for i in items} == {f"EngineCore request hasher ({c['hash_algo']})"
                                           for c in checks}
    assert all(i["affects"] and i["capability"] == "hashing" and "differs: engine" in i["found"]
               and "block_hasher_for" in i["workaround"] for i in items)
    assert "hashing" in salted["doctor"]["drift"]["capabilities"]


def test_block_hasher_for_refuses_ours_naming_the_engine(salted):
    err = salted.get("error")
    assert err is not None, f"block_hasher_for took a hasher the engine disagrees with: {salted}"
    assert err["type"] == "EngineHashMismatchError" and err["capability"] == "hashing"
    assert err["differs"] == "engine"
    assert "block_hasher_for" in err["workaround"] and "make_request" in err["workaround"]


def test_the_engine_oracle_fails_and_the_engines_own_hasher_still_shares_blocks():
    result = run_engine_oracle("sha256", env={"VLLM_COMPAT_TEST_DRIFT": KIND})
    with pytest.raises(AssertionError):
        assert_engine_and_library_share_blocks(result)
    # requests built with block_hasher_for(engine_core) hit the engine's prefix cache
    assert result["for_core"] == {"source": "engine", "is_engine_hasher": True,
                                  "cached": FULL_BLOCKS * 16}


def test_an_unchanged_build_reports_equal_hashes():
    control = run_drift_probe("none")
    assert all(c["differs"] is None and c["error"] is None
               for c in control["doctor"]["hash_check"]["checks"])
    assert not [i for i in control["doctor"]["drift"]["items"]
                if i["kind"].startswith("hash_")]
    assert control["doctor_exit"] == 0
