"""Kill points shared by the resume-after-kill tests, installed in the child process the
test SIGKILLs (test_train_resume_after_kill.py, test_online_resume_after_kill.py)."""

from __future__ import annotations

import io
import os
import signal
import time
from typing import Any

import torch


def tear_nth_torch_save(n: int) -> None:
    """From the ``n``-th call on, ``torch.save`` writes half its bytes, syncs them and
    SIGKILLs the process: a checkpoint torn in the middle of its write."""
    real_save, calls = torch.save, [0]

    def torn_save(obj: Any, f: Any, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] < n:
            return real_save(obj, f, *a, **k)
        buf = io.BytesIO()
        real_save(obj, buf)
        half = buf.getvalue()[: len(buf.getvalue()) // 2]
        h = f if hasattr(f, "write") else open(f, "wb")
        h.write(half)
        h.flush()
        os.fsync(h.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = torn_save


def slow_collate(training: Any, seconds: float) -> None:
    """Every training step takes at least ``seconds`` (``training`` is
    ``vllm_compat.eagle3.training``), so a kill can land on any step."""
    collate = training.collate

    def slow(samples: Any) -> Any:
        time.sleep(seconds)
        return collate(samples)

    training.collate = slow
