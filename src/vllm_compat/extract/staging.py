"""Device -> host hand-off of each engine step's hidden states without stalling the GPU.

Torch only (no vLLM): used by the extraction worker when it runs in this process.
"""

from __future__ import annotations

from typing import Any

import torch

from .ordering import BatchLayout


class StagedCopy:
    """One step's ``[tokens, layers, hidden]`` block on its way into a pinned host buffer."""

    def __init__(self, pool: "HostStaging", lay: BatchLayout, host: torch.Tensor,
                 buf: torch.Tensor, done: Any) -> None:
        self._pool, self._lay, self._host, self._buf, self._done = pool, lay, host, buf, done

    def finish(self) -> dict[str, torch.Tensor]:
        """Wait for the copy; the states as views of one pageable tensor, per request."""
        self._done.synchronize()
        out = torch.empty(self._host.shape, dtype=self._host.dtype)
        out.copy_(self._host)  # parallel host memcpy; the pinned buffer goes back to the pool
        self._release()
        lay = self._lay
        return {r: out[s:e] for r, s, e in zip(lay.req_ids, lay.starts, lay.ends)}

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
        self._free: list[torch.Tensor] = []
        self._stream: Any = None

    def _buffer(self, n: int, dtype: torch.dtype, capacity: int) -> torch.Tensor:
        for i, b in enumerate(self._free):
            if b.numel() >= n and b.dtype == dtype:
                return self._free.pop(i)
        self._free = [b for b in self._free if b.dtype == dtype]  # drop unusable ones first
        if self._free:  # all too small: replace the smallest rather than pin one more
            self._free.remove(min(self._free, key=torch.Tensor.numel))
        return torch.empty(max(n, capacity), dtype=dtype, pin_memory=True)

    def start(self, stacked: torch.Tensor, lay: BatchLayout, capacity_tokens: int) -> StagedCopy:
        n = stacked.numel()
        per_token = n // max(1, stacked.shape[0])
        buf = self._buffer(n, stacked.dtype, capacity_tokens * per_token)
        host = buf[:n].view(stacked.shape)
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
        return StagedCopy(self, lay, host, buf, done)
