"""Repack edit: ``ModelRunnerOutput.sampled_token_ids`` typed ``list[np.ndarray]`` (as in vLLM
0.11.x), and the scheduler turns the arrays into lists before it reads them, as 0.11.x did.
Written against the 0.33.0 sources.
"""

from __future__ import annotations

from pathlib import Path


def _sub(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    if text.count(old) != 1:
        raise SystemExit(f"{path}: expected {old!r} once, found it {text.count(old)} times")
    path.write_text(text.replace(old, new), encoding="utf-8")


def edit(root: Path) -> None:
    _sub(root / "vllm" / "v1" / "outputs.py",
         "    sampled_token_ids: list[list[int]] = field(default_factory=list)\n",
         "    sampled_token_ids: list[np.ndarray] = field(default_factory=list)\n")
    _sub(root / "vllm" / "v1" / "core" / "sched" / "scheduler.py",
         "        sampled_token_ids = model_runner_output.sampled_token_ids\n",
         "        sampled_token_ids = [\n"
         "            t.tolist() if hasattr(t, \"tolist\") else t\n"
         "            for t in model_runner_output.sampled_token_ids\n"
         "        ]\n")
