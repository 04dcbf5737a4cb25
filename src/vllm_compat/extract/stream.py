"""An extractor fed over time: requests in, samples out as each one finishes.

``HiddenStatesExtractor.extract`` takes a known list of prompts. A server gets prompts one by
one from many clients, and a client may go away before its prompt is done; it needs to add
prompts while the engine is stepping, take each sample as soon as it is complete (not in
arrival order: a short prompt must not wait behind a long one), and cancel one prompt
without disturbing the others. :class:`ExtractionStream` gives exactly that, on the same
engine: everything added before a ``step()`` is scheduled together, so concurrent requests
share engine steps (and, where the engine keeps two steps in flight, the GPU never idles
between them).

Single-threaded: call it from the one thread that owns the extractor.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from .ordering import StreamAssembler, check_prompt

__all__ = ["ExtractionStream"]

_serial = itertools.count()


class ExtractionStream:
    """See the module doc. Keys are the caller's; each must be unique while it is running."""

    def __init__(self, extractor: Any) -> None:  # a HiddenStatesExtractor (it builds streams)
        self._ex = extractor
        self._engine = extractor._engine
        if self._engine.plan.mode == "native":
            raise ValueError("backend='native' runs through vLLM's LLM.generate, which cannot "
                             "take prompts while it runs: use backend='auto' for a stream")
        self._tag = f"vcs{next(_serial)}-"
        self._asm = StreamAssembler()
        self._index = itertools.count()

    def add(self, key: str, token_ids: Sequence[int]) -> list[int]:
        """Queue a prompt (checked as :meth:`HiddenStatesExtractor.extract` checks it: a
        ``ValueError`` names what is wrong); returns the token ids as ints."""
        ids = check_prompt(key, token_ids, self._ex._max_prompt, self._ex._vocab)
        self._asm.register(key, ids)
        self._engine.add(self._tag + key, ids)
        return ids

    def cancel(self, key: str) -> bool:
        """Stop ``key``'s prompt and free what the engine holds for it (its KV blocks); True
        when it was still running. Other prompts are not disturbed."""
        if not self._asm.drop(key):
            return False
        self._engine.cancel([self._tag + key])
        return True

    def step(self) -> list[tuple[str, Any]]:
        """One engine step; the samples it completed, ``(key, ExtractedSample)``, in completion
        order."""
        if not self.busy:
            return []
        chunks = self._engine.step()
        n = len(self._tag)
        self._asm.feed_many({k[n:]: v for k, v in chunks.items()})
        if not self._engine.has_unfinished():
            self._asm.forget_dropped()  # nothing launched before a cancel is left in flight
        out = []
        for key, ids, hs in self._asm.pop_finished():
            out.append((key, self._ex._sample(next(self._index), ids, hs)))
        return out

    @property
    def busy(self) -> bool:
        """Prompts running, or engine work (steps in flight, states not handed out) left."""
        return self._asm.running > 0 or self._engine.has_unfinished()

    @property
    def running(self) -> int:
        """Prompts added and not finished (nor cancelled)."""
        return self._asm.running

    def close(self) -> None:
        """Cancel every running prompt."""
        for key in self._asm.running_keys():
            self.cancel(key)

    def __enter__(self) -> ExtractionStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
