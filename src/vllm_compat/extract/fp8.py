"""FP8 (e4m3) storage of hidden states: one float32 scale per token and layer.

``encode(x)`` for states ``x`` ``[T, n, H]`` (any float dtype, CPU or GPU) returns ``q``
float8_e4m3fn ``[T, n, H]`` and ``scale`` float32 ``[T, n]`` with
``x ~= q.float() * scale[..., None]``, where ``scale`` is the row's largest ``|x|`` over ``H``
divided by 448 (e4m3's largest finite value): every token-layer row uses the whole FP8 range.

Why per token: a prompt's states arrive over several engine steps (chunked prefill), and a
token's scale is known as soon as its row is. So the GPU can encode each step's block before
it is copied to the host: half the bytes cross PCIe and no CPU encodes anything. The scale
costs 4 bytes per token and layer (0.2 % at hidden 2048).

Error of one value (e4m3 has 3 mantissa bits): relative ``<= 2**-4`` where
``|x| >= 2**-6 * scale`` (FP8's normal range), absolute ``<= 2**-10 * scale`` below it
(subnormals), plus the input's own rounding. The same input gives the same bytes on the CPU
and the GPU: both divide correctly rounded in float32 and cast round-to-nearest-even. A
non-finite input row decodes to NaN, which dataset readers reject.

Datasets written earlier with one scale per sample and layer (``scale`` ``[n]``) decode
through :func:`decode` too (the scale is broadcast over the tokens).
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_ELEMENTS", "FP8_DTYPE", "FP8_MAX", "SCALE_KEY", "decode", "encode", "is_fp8"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_KEY = "hidden_states_scale"  # the scale's name beside "hidden_states" in a sample
_TINY = torch.finfo(torch.float32).tiny  # an all-zero row: scale tiny, q zero (not NaN)


def is_fp8(dtype: torch.dtype | str | None) -> bool:
    """Whether ``dtype`` (a torch dtype or its name, as a manifest holds it) is FP8 e4m3."""
    return dtype in (FP8_DTYPE, "float8_e4m3fn", "torch.float8_e4m3fn")


CHUNK_ELEMENTS = 1 << 25  # float32 temporaries of at most 128 MiB (on the GPU, beside the KV cache)


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., H]`` -> (float8_e4m3fn like ``x``, float32 scale ``x.shape[:-1]``)."""
    step = max(1, CHUNK_ELEMENTS // max(1, x[0].numel())) if x.dim() > 1 else 0
    if 0 < step < x.shape[0]:  # row blocks: the same bytes, bounded temporaries
        q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        for i in range(0, x.shape[0], step):
            q[i:i + step], scale[i:i + step] = encode(x[i:i + step])
        return q, scale
    # |x| and its max in the input dtype (exact for bf16), then float32: the division
    # promotes, so no float32 copy of x is made before it. The divisor is a tensor: CUDA
    # divides by a Python scalar as a multiplication by its reciprocal, which rounds
    # differently from the CPU's division in about half the rows
    amax = x.abs().amax(dim=-1).float()
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(_TINY)
    q = (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def decode(q: torch.Tensor, scale: torch.Tensor,
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q * scale`` in ``dtype``. ``scale``: ``q.shape[:-1]`` (per token and layer), or
    ``[n]`` for ``q`` ``[T, n, H]`` (one scale per sample and layer, earlier datasets)."""
    s = scale.to(device=q.device, dtype=torch.float32)
    if s.shape == q.shape[:-1]:
        s = s.unsqueeze(-1)
    elif q.dim() == 3 and s.shape == q.shape[1:2]:
        s = s.view(1, -1, 1)
    else:
        raise ValueError(f"FP8 scale of shape {tuple(scale.shape)} does not fit states of shape "
                         f"{tuple(q.shape)} (expected {tuple(q.shape[:-1])} or ({q.shape[1]},))")
    return (q.float() * s).to(dtype)
