"""The pinned-buffer pool of extract.staging.HostStaging: buffers are bytes, reused whatever
dtype a step's states have. Pinning needs CUDA, so here a subclass hands out ordinary memory;
the pooling logic under test is the same."""

from __future__ import annotations

import torch

from vllm_compat.extract.staging import HostStaging


class _Unpinned(HostStaging):
    def _pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


def test_switching_between_bf16_and_fp8_reuses_the_same_buffers():
    pool = _Unpinned()
    cap = 1 << 20
    bf16 = [pool._buffer(2 * 1000, cap), pool._buffer(2 * 1000, cap)]  # two steps in flight
    assert pool.allocations == 2
    pool._free += bf16
    fp8 = [pool._buffer(1000 + 64, cap), pool._buffer(1000 + 64, cap)]  # packed FP8 + scales
    assert pool.allocations == 2 and {id(b) for b in fp8} == {id(b) for b in bf16}
    pool._free += fp8
    again = pool._buffer(2 * 1000, cap)
    assert pool.allocations == 2 and again.dtype == torch.uint8
    # a view of the bytes as the step's dtype, as HostStaging.start takes it
    assert again[: 2 * 1000].view(torch.bfloat16).view(10, 100).shape == (10, 100)


def test_a_larger_step_replaces_the_smallest_buffer():
    pool = _Unpinned()
    small = [pool._buffer(100, 100), pool._buffer(200, 200)]
    pool._free += small
    big = pool._buffer(500, 100)
    assert pool.allocations == 3 and big.numel() == 500
    assert [b.numel() for b in pool._free] == [200]  # the smallest went, one stays
