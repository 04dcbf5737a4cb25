"""Device -> host hand-off of each engine step's hidden states without stalling the GPU.

Torch only (no vLLM): used by the extraction worker when it runs in this process.

A step's states are one ``[tokens, layers, hidden]`` tensor, or a tuple of tensors that
share the token dimension (FP8 states and their scales, :mod:`.fp8`). A tuple crosses to the
host as one packed byte buffer (one copy, one pinned buffer) and is unpacked there into
views; each request then gets a tuple of row slices.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from .ordering import BatchLayout

Parts = Union[torch.Tensor, tuple[torch.Tensor, ...]]
_ALIGN = 64  # bytes: every packed part starts aligned for any dtype's view

# (dtype, shape, byte offset) of each part of a packed buffer
Packing = list[tuple[torch.dtype, tuple[int, ...], int]]


def pack(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Packing]:
    """The parts' bytes one after the other in one uint8 tensor (on their device)."""
    layout: Packing = []
    off = 0
    for p in parts:
        layout.append((p.dtype, tuple(p.shape), off))
        off += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    flat = torch.empty(off, dtype=torch.uint8, device=parts[0].device)
    for p, (_, _, o) in zip(parts, layout):
        n = p.numel() * p.element_size()
        flat[o:o + n].copy_(p.contiguous().view(-1).view(torch.uint8))
    return flat, layout


def unpack(flat: torch.Tensor, layout: Packing) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` (as :func:`pack` made it) with each part's dtype and shape."""
    out = []
    for dtype, shape, o in layout:
        n = dtype.itemsize
        for x in shape:
            n *= x
        out.append(flat[o:o + n].view(dtype).view(shape))
    return tuple(out)


def per_request(parts: Parts, lay: BatchLayout, copy: bool = False) -> dict[str, Any]:
    """Each request's rows ``[start, end)`` of the step's states (a tuple stays a tuple);
    views of ``parts`` unless ``copy``."""
    def rows(t: torch.Tensor, s: int, e: int) -> torch.Tensor:
        return t[s:e].clone() if copy else t[s:e]
    if isinstance(parts, tuple):
        return {r: tuple(rows(p, s, e) for p in parts)
                for r, s, e in zip(lay.req_ids, lay.starts, lay.ends)}
    return {r: rows(parts, s, e) for r, s, e in zip(lay.req_ids, lay.starts, lay.ends)}


def to_host(parts: Parts) -> Parts:
    """A blocking copy to the CPU (a tuple part by part)."""
    if isinstance(parts, tuple):
        return tuple(p.to("cpu") for p in parts)
    return parts.to("cpu")


class StagedCopy:
    """One step's ``[tokens, layers, hidden]`` block on its way into a pinned host buffer."""

    def __init__(self, pool: "HostStaging", lay: BatchLayout, host: torch.Tensor,
                 buf: torch.Tensor, done: Any, packing: Packing | None = None) -> None:
        self._pool, self._lay, self._host, self._buf, self._done = pool, lay, host, buf, done
        self._packing = packing

    def finish(self) -> dict[str, Any]:
        """Wait for the copy; the states as views of one pageable tensor, per request."""
        self._done.synchronize()
        out = torch.empty(self._host.shape, dtype=self._host.dtype)
        out.copy_(self._host)  # parallel host memcpy; the pinned buffer goes back to the pool
        self._release()
        return per_request(out if self._packing is None else unpack(out, self._packing),
                           self._lay)

    def discard(self) -> None:
        self._done.synchronize()
        self._release()

    def _release(self) -> None:
        if self._buf is not None:
            self._pool._free.append(self._buf)
            self._buf = self._host = None  # type: ignore[assignment]


class HostStaging:
    """The device->host hand-off of each step's states without stalling the GPU.

    ``start`` queues the copy of a step's ``[tokens, layers, hidden]`` block into a pinned
    buffer on a side stream (the copy engine runs it while the GPU goes on) and returns a
    :class:`StagedCopy`; its ``finish``, called later, waits for that copy and makes the
    pageable tensor the caller keeps (a parallel host memcpy that overlaps the next
    forward). Pinned buffers are reused, one per copy not yet finished (two when steps are
    pipelined). Why: a blocking ``.to("cpu")`` into fresh pageable memory keeps the GPU
    idle for the whole copy of every step (hundreds of MB at 16k-token steps). In-process (TP=1) workers only: its results are views of one host tensor."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # pinned uint8 buffers, viewed as each step's dtype
        self._stream: Any = None
        self.allocations = 0  # pinned buffers made so far (each costs a cudaHostAlloc)

    def _buffer(self, nbytes: int, capacity: int) -> torch.Tensor:
        """A free buffer of at least ``nbytes``, whatever dtype it last held: switching between
        bf16 and FP8 states (``states_dtype`` between calls) reuses the same pinned memory
        instead of freeing it (cudaFreeHost synchronizes the device) and pinning anew."""
        for i, b in enumerate(self._free):
            if b.numel() >= nbytes:
                return self._free.pop(i)
        if self._free:  # all too small: replace the smallest rather than pin one more
            self._free.remove(min(self._free, key=torch.Tensor.numel))
        self.allocations += 1
        return self._pinned(max(nbytes, capacity))

    def _pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def start(self, stacked: Parts, lay: BatchLayout, capacity_tokens: int) -> StagedCopy:
        packing = None
        if isinstance(stacked, tuple):  # FP8 states and scales: one packed buffer
            tokens = stacked[0].shape[0]
            stacked, packing = pack(stacked)
        else:
            tokens = stacked.shape[0]
        nbytes = stacked.numel() * stacked.element_size()
        per_token = -(-nbytes // max(1, tokens))
        buf = self._buffer(nbytes, capacity_tokens * per_token)
        host = buf[:nbytes].view(stacked.dtype).view(stacked.shape)
        dev = stacked.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self._stream):
            host.copy_(stacked, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        # the compute stream may reuse ``stacked``'s memory only after the copy has read it
        stacked.record_stream(self._stream)
        return StagedCopy(self, lay, host, buf, done, packing)
