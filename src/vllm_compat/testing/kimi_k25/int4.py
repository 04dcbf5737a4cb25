"""compressed-tensors ``pack-quantized`` INT4: symmetric, one bf16 scale per group of inputs.

A weight ``w`` [out, in] is stored as three tensors:

- ``weight_packed`` int32 [out, in / 8]: ``q + 8`` as unsigned 4-bit nibbles, 8 per int32,
  the lowest-index input in the least-significant nibble;
- ``weight_scale`` bf16 [out, in / group]: ``absmax / 7.5`` of each group (the minmax
  observer), so ``q = clamp(round(w / scale), -8, 7)``;
- ``weight_shape`` int32 [2]: ``[out, in]``.

It dequantizes to ``q * scale`` exactly (in fp32), which is what a reference should use.
"""

from __future__ import annotations

import torch

NIBBLES = 8  # 4-bit values per int32
_SHIFTS = torch.arange(NIBBLES, dtype=torch.int32) * 4


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [out, in], scale bf16 [out, in / group_size])``."""
    out_f, in_f = weight.shape
    if in_f % group_size or group_size % NIBBLES:
        raise ValueError(f"in_features {in_f} must be a multiple of the group size {group_size}")
    groups = weight.float().reshape(out_f, in_f // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7)
    return q.reshape(out_f, in_f).to(torch.int8), scale


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [out, in] -> int32 [out, in / 8]."""
    if q.min() < -8 or q.max() > 7:
        raise ValueError("INT4 values must lie in [-8, 7]")
    nibbles = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, NIBBLES)
    words = (nibbles << _SHIFTS.long()).sum(dim=-1)  # < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [out, in / 8] -> int8 [out, in]."""
    # (x >> 4k) & 0xF is nibble k of a negative int32 too: the sign fill lands above the mask
    nibbles = (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF
    return (nibbles - 8).reshape(packed.shape[0], -1).to(torch.int8)


def compress(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The three tensors a checkpoint stores for ``weight`` (suffixes of ``...proj.``)."""
    q, scale = quantize(weight, group_size)
    return {"weight_packed": pack(q), "weight_scale": scale,
            "weight_shape": torch.tensor(list(weight.shape), dtype=torch.int32)}


def decompress(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 ``q * scale`` from the three stored tensors."""
    q = unpack(tensors["weight_packed"]).float()
    out_f, in_f = (int(v) for v in tensors["weight_shape"])
    scale = tensors["weight_scale"].float()
    group = in_f // scale.shape[1]
    w = q[:, :in_f].reshape(out_f, -1, group) * scale[..., None]
    return w.reshape(out_f, in_f)
