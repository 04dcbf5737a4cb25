"""Bookkeeping between the engine's steps and the caller (pure Python: no vLLM, no torch).

The engine schedules requests in its own order, splits long prompts over several steps
(chunked prefill) and lays a step's requests out in the model runner's batch order.
:class:`OrderedAssembler` takes whatever chunks a step produced, concatenates each
prompt's chunks, checks the token count, and hands finished prompts back strictly in
input order; it holds at most the in-flight window, never the dataset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

__all__ = ["BatchLayout", "OrderedAssembler", "StreamAssembler", "check_prompt", "split_batch"]


def check_prompt(index: int | str, token_ids: Any, max_len: int | None = None,
                 vocab_size: int | None = None) -> list[int]:
    """A prompt as a list of ints; ValueError naming the prompt and the bad value."""
    if hasattr(token_ids, "tolist"):
        if getattr(token_ids, "ndim", 1) != 1:
            raise ValueError(f"prompt {index}: token ids must be 1-D, got shape "
                             f"{tuple(token_ids.shape)}")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"prompt {index}: expected token ids, got a string (tokenize first)")
    ids = list(token_ids)
    if not ids:
        raise ValueError(f"prompt {index} is empty")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"prompt {index}: token {j} is {t!r}, not an integer")
        t = int(t.__index__())
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"prompt {index}: token {j} = {t} is outside the vocabulary "
                             f"[0, {vocab_size})")
        ids[j] = t
    if max_len is not None and len(ids) > max_len:
        raise ValueError(f"prompt {index} has {len(ids)} tokens; at most {max_len} fit "
                         "(max_model_len - 1, one slot is kept for the sampled token)")
    return ids


@dataclass(frozen=True)
class BatchLayout:
    """Where each request's tokens sit in one step's flattened batch: ``[start, end)``."""
    req_ids: tuple[str, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.ends[-1] if self.ends else 0


def split_batch(batch_req_ids: Sequence[str | None],
                num_scheduled_tokens: Mapping[str, int]) -> BatchLayout:
    """Layout of a step from the runner's batch order and the scheduler's token counts.

    ``batch_req_ids`` is the runner's request order for this step (V1: ``input_batch.req_ids``;
    V2: ``execute_model_state.input_batch.req_ids``); tokens are laid out request after
    request in that order. Every scheduled request must appear exactly once.
    """
    ids = [r for r in batch_req_ids if r is not None]
    if len(set(ids)) != len(ids):
        raise ValueError(f"batch order lists a request twice: {ids}")
    missing = set(num_scheduled_tokens) - set(ids)
    if missing:
        raise ValueError(f"scheduled requests absent from the batch order: {sorted(missing)}")
    starts, ends, order = [], [], []
    pos = 0
    for r in ids:
        n = num_scheduled_tokens.get(r)
        if n is None:  # in the persistent batch but not scheduled this step
            continue
        if n < 0:
            raise ValueError(f"request {r} has {n} scheduled tokens")
        order.append(r)
        starts.append(pos)
        pos += int(n)
        ends.append(pos)
    return BatchLayout(tuple(order), tuple(starts), tuple(ends))


def _default_concat(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    import torch  # only when real tensors flow
    if isinstance(parts[0], tuple):  # (FP8 states, scales): each joined along the tokens
        return tuple(torch.cat(list(p), dim=0) for p in zip(*parts))
    return torch.cat(parts, dim=0)


def _default_length(chunk: Any) -> int:
    return len(chunk[0]) if isinstance(chunk, tuple) else len(chunk)


@dataclass
class _Pending:
    index: int
    key: str
    token_ids: list[int]
    parts: list[Any] = field(default_factory=list)
    received: int = 0


class OrderedAssembler:
    """Concatenate per-step chunks per request; release finished requests in input order.

    ``concat`` joins a request's chunks (default ``torch.cat(dim=0)``, part by part for a
    tuple of tensors); ``length`` gives a chunk's token count (default ``len``, of the first
    part for a tuple). Indices must be registered in increasing order.
    """

    def __init__(self, concat: Callable[[list[Any]], Any] | None = None,
                 length: Callable[[Any], int] = _default_length) -> None:
        self._concat = concat or _default_concat
        self._length = length
        self._by_key: dict[str, _Pending] = {}
        self._by_index: dict[int, _Pending] = {}
        self._done: dict[int, tuple[_Pending, Any]] = {}
        self._next_out = 0
        self._last_in = -1

    def register(self, index: int, key: str, token_ids: Sequence[int]) -> None:
        if index <= self._last_in:
            raise ValueError(f"index {index} registered after {self._last_in}")
        if key in self._by_key:
            raise ValueError(f"request key {key!r} already registered")
        if self._last_in == -1:
            self._next_out = index
        self._last_in = index
        p = _Pending(index, key, list(token_ids))
        self._by_key[key] = p
        self._by_index[index] = p

    def feed(self, key: str, chunk: Any) -> None:
        p = self._by_key.get(key)
        if p is None:
            raise KeyError(f"chunk for unknown or finished request {key!r}")
        n = int(self._length(chunk))
        if p.received + n > len(p.token_ids):
            raise ValueError(f"request {key!r}: {p.received} + {n} tokens received, the prompt "
                             f"has {len(p.token_ids)}")
        p.parts.append(chunk)
        p.received += n
        if p.received == len(p.token_ids):
            del self._by_key[key]
            self._done[p.index] = (p, self._concat(p.parts))
            p.parts = []

    def feed_many(self, chunks: Mapping[str, Any]) -> None:
        for key, chunk in chunks.items():
            self.feed(key, chunk)

    def pop_ready(self) -> Iterator[tuple[int, list[int], Any]]:
        """``(index, token_ids, data)`` for every finished request whose predecessors are out."""
        while self._next_out in self._done or (
                self._next_out not in self._by_index and self._next_out <= self._last_in):
            if self._next_out not in self._by_index:  # an index never registered: skip
                self._next_out += 1
                continue
            p, data = self._done.pop(self._next_out)
            del self._by_index[self._next_out]
            self._next_out += 1
            yield p.index, p.token_ids, data

    @property
    def in_flight(self) -> int:
        """Requests registered and not yet handed out (running or waiting for order)."""
        return len(self._by_index)

    @property
    def running(self) -> int:
        """Requests still missing tokens."""
        return len(self._by_key)

    def missing(self) -> dict[str, tuple[int, int]]:
        """``key -> (received, expected)`` for unfinished requests."""
        return {k: (p.received, len(p.token_ids)) for k, p in self._by_key.items()}


class StreamAssembler:
    """Per-request chunk assembly for requests that come and go while the engine runs (a
    server): keyed by the caller's request key, each request handed back as soon as it is
    complete, in any order. A cancelled request's chunks that a step launched before the
    cancel still produced are dropped; any other unknown key is an error."""

    def __init__(self, concat: Callable[[list[Any]], Any] | None = None,
                 length: Callable[[Any], int] = _default_length) -> None:
        self._concat = concat or _default_concat
        self._length = length
        self._running: dict[str, _Pending] = {}
        self._finished: list[tuple[str, list[int], Any]] = []
        self._dropped: set[str] = set()

    def register(self, key: str, token_ids: Sequence[int]) -> None:
        if key in self._running:
            raise ValueError(f"request key {key!r} already registered")
        self._dropped.discard(key)
        self._running[key] = _Pending(0, key, list(token_ids))

    def drop(self, key: str) -> bool:
        """Forget ``key`` (cancelled); True when it was still running."""
        if self._running.pop(key, None) is None:
            return False
        self._dropped.add(key)
        return True

    def feed_many(self, chunks: Mapping[str, Any]) -> None:
        for key, chunk in chunks.items():
            p = self._running.get(key)
            if p is None:
                if key in self._dropped:
                    continue  # computed by a step launched before the cancel
                raise KeyError(f"chunk for unknown or finished request {key!r}")
            n = int(self._length(chunk))
            if p.received + n > len(p.token_ids):
                raise ValueError(f"request {key!r}: {p.received} + {n} tokens received, the "
                                 f"prompt has {len(p.token_ids)}")
            p.parts.append(chunk)
            p.received += n
            if p.received == len(p.token_ids):
                del self._running[key]
                self._finished.append((key, p.token_ids, self._concat(p.parts)))

    def pop_finished(self) -> list[tuple[str, list[int], Any]]:
        """``(key, token_ids, data)`` of every request completed since the last call."""
        out, self._finished = self._finished, []
        return out

    def forget_dropped(self) -> None:
        """Clear the record of cancelled keys (when no step launched before them is in flight)."""
        self._dropped.clear()

    @property
    def running(self) -> int:
        """Requests still missing tokens."""
        return len(self._running)

    def running_keys(self) -> list[str]:
        return list(self._running)


def windows(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Successive lists of at most ``size`` items (lazy)."""
    if size < 1:
        raise ValueError(f"window size must be >= 1, got {size}")
    buf: list[Any] = []
    for it in items:
        buf.append(it)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf
