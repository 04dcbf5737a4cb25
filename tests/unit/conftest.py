"""Shared fixtures of the CPU unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module, restored afterwards. Tiny matmuls on a
    2-core CPU only contend with a second thread, and runs resumed in child processes
    use one thread too (same kernels, same sums)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
