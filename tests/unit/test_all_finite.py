"""``eagle3.data.all_finite``: the one-pass check the dataset reader and online training run on
every sample's states agrees with ``torch.isfinite(t).all()`` wherever a NaN or Inf sits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_compat.eagle3.data import all_finite  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@settings(max_examples=200, deadline=None)
@given(shape=st.tuples(st.integers(1, 40), st.integers(1, 4), st.integers(1, 16)),
       dtype=st.sampled_from(DTYPES),
       bad=st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                              st.sampled_from([float("nan"), float("inf"), float("-inf")])),
                    max_size=3),
       scale=st.sampled_from([1.0, 1e4, 1e-4]))
def test_agrees_with_isfinite(shape, dtype, bad, scale):
    t = (torch.randn(shape) * scale).to(dtype)
    flat = t.view(-1)
    for where, value in bad:
        flat[int(where * flat.numel())] = value
    assert all_finite(t) == bool(torch.isfinite(t).all())


def test_fp8_states():
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    t = torch.randn(8, 3, 16).to(fp8)
    assert all_finite(t)
    t.view(torch.uint8)[5, 1, 7] = 0x7F  # e4m3fn's NaN (it has no Inf)
    assert not all_finite(t)


def test_empty_and_integer_tensors_are_finite():
    assert all_finite(torch.empty(0, 4, 8, dtype=torch.bfloat16))
    assert all_finite(torch.arange(10))
