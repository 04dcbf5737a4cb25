"""GPU tests: real vLLM on a CUDA device. Skipped, with the reason, anywhere else."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
# Triton MoE for the tiny DeepSeek-V3: vLLM 0.20.2 otherwise picks FlashInfer's CUTLASS MoE,
# which FlashInfer 0.6.8 JIT-builds from source with ninja + nvcc on first use (the H200 run
# of 2026-11-29 was still building after 5 minutes; the test timed out). Kernel choice is
# not what these tests check.
os.environ.setdefault("VLLM_USE_FLASHINFER_MOE_FP16", "0")


def _skip_reason() -> str | None:
    for mod in ("torch", "transformers", "vllm"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    reason = _skip_reason()
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        if "gpu" not in item.keywords:
            raise pytest.UsageError(f"{item.nodeid} is in tests/gpu but not marked gpu")
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
