"""FP8 states encoded on the GPU (``states_dtype=torch.float8_e4m3fn``) against the bf16
states of the same engine settings encoded on the CPU: the same bytes, through the
overlapped copy (one packed pinned buffer per step) and the blocking copy, with prompts
split over many steps (chunked prefill). About 1 minute (two engine starts; the bf16
reference run is shared with test_extract_gpu.py when both run)."""

from __future__ import annotations

import pytest
import torch

from vllm_compat.extract import fp8

from . import _models as M
from .test_extract_gpu import _cat, ckpts, run  # noqa: F401 - ckpts is a fixture

pytestmark = pytest.mark.gpu


def test_fp8_encoding_gives_the_same_bytes_on_the_gpu_and_the_cpu():
    """The same states, encoded on each device: equal scales and bytes, every row."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, 4, 2048, generator=g) * torch.rand(4096, 4, 1, generator=g) * 3).bfloat16()
    q_cpu, s_cpu = fp8.encode(x)
    q_gpu, s_gpu = fp8.encode(x.cuda())
    same_scale = float((s_gpu.cpu() == s_cpu).float().mean())
    same_bytes = float((q_gpu.cpu().view(torch.uint8) == q_cpu.view(torch.uint8)).float().mean())
    M.record("fp8_encode_gpu_vs_cpu", same_scale=same_scale, same_bytes=same_bytes)
    assert (same_scale, same_bytes) == (1.0, 1.0)


@pytest.mark.parametrize("copy", ["overlap", "blocking"])
def test_fp8_states_encoded_on_the_gpu_equal_cpu_encoding(ckpts, copy):  # noqa: F811
    ref = run(ckpts, "llama", "chunked-overlap", max_num_batched_tokens=48)
    got = run(ckpts, "llama", f"chunked-{copy}-fp8", max_num_batched_tokens=48,
              overlap_copy=copy == "overlap", states_dtype=fp8.FP8_DTYPE)
    assert got["info"]["overlap_copy"] is (copy == "overlap")
    assert got["info"]["steps"] == ref["info"]["steps"] >= 10
    q = torch.cat([s.hidden_states for s in got["samples"]])
    scale = torch.cat([s.hidden_states_scale for s in got["samples"]])
    x = _cat(ref["samples"])
    assert q.dtype == fp8.FP8_DTYPE and scale.dtype == torch.float32
    assert q.shape == x.shape and scale.shape == x.shape[:2]
    want_q, want_scale = fp8.encode(x)  # on the CPU
    same_bytes = float((q.view(torch.uint8) == want_q.view(torch.uint8)).float().mean())
    rel = M.rel_err(fp8.decode(q, scale, torch.float32), x)
    M.record(f"fp8_gpu_vs_cpu_encoding:{copy}", same_bytes=same_bytes, rel_to_bf16=rel,
             scales_equal=bool(torch.equal(scale, want_scale)), steps=got["info"]["steps"])
    assert rel < 0.04  # FP8's error, not a misplaced row
    assert torch.equal(scale, want_scale) and same_bytes == 1.0
