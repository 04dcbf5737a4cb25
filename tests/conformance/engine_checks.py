"""What the engine-grounded hash tests share: running the engine oracle in a child process
(engine_oracle.py) and what its result must show. Imports no vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FULL_BLOCKS = 5  # engine_oracle.chat_tokens: 5 full blocks of 16 and 7 tokens


def run_engine_oracle(algo: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.conformance.engine_oracle", algo],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
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
