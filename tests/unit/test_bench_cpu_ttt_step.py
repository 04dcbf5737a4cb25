"""bench/cpu_ttt_step.py runs, and the model.py it reads from git (the explicit TTT form)
gives the same loss as today's fused form on the same weights and batch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--batch", "2", "--seq", "12", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "48", "--vocab", "64", "--ttt-steps", "3", "--repeats", "1"]


def _has_history() -> bool:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return False
    r = subprocess.run(["git", "log", "--format=%H", "-S", "def ttt_attention_mask", "--",
                        "src/vllm_compat/eagle3/model.py"], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0 and bool(r.stdout.split())


@pytest.mark.skipif(not _has_history(), reason="needs the git history that holds the explicit form")
def test_before_and_after_agree_and_results_are_written(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_ttt_step.py"), "--out", str(tmp_path), *TINY],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "cpu_ttt_step.json").read_text())
    assert res["loss_rel_diff"] < 1e-5, res["loss"]
    assert set(res["best_s"]) == {"before", "after"} and res["speedup_best"] > 0
    assert len(res["before_rev"]) == 40
