"""The extractor in its own thread, fed by the HTTP loop; admission control in front of it.

One thread owns the :class:`~vllm_compat.extract.HiddenStatesExtractor` and its
:class:`~vllm_compat.extract.stream.ExtractionStream`: it takes every request that arrived
since its last step into the next one (so concurrent requests share engine steps, and the
engine keeps its two steps in flight), hands each finished prompt's states to the file
writers and wakes the request's handler. The HTTP loop never runs engine code, and the
engine never waits on HTTP.

:class:`Admission` bounds what the server holds: requests (and prompt tokens) between
admission and the end of their file write. Past that, requests wait in line, in arrival
order, in the HTTP loop; past ``max_waiting`` waiting ones the server answers 503 rather
than queue without bound. A request that is cancelled (its client disconnected or timed out)
leaves the engine at once: its KV blocks are freed and its file is never written.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from .api_errors import ApiError
from .hs_files import HiddenStatesFiles, Reservation

__all__ = ["Admission", "EngineThread", "Job"]

log = logging.getLogger(__name__)


def server_busy(waiting: int) -> ApiError:
    return ApiError(f"The server is busy: {waiting} requests are already waiting to be "
                    "admitted (--max-waiting-requests). Retry later.",
                    status=HTTPStatus.SERVICE_UNAVAILABLE, err_type="ServiceUnavailableError")


class Admission:
    """At most ``max_requests`` requests and ``max_tokens`` prompt tokens held at once (a
    prompt larger than ``max_tokens`` is admitted alone); waiters are served first come,
    first served. Loop-thread only."""

    def __init__(self, max_requests: int, max_tokens: int, max_waiting: int) -> None:
        if max_requests < 1 or max_tokens < 1 or max_waiting < 0:
            raise ValueError("admission limits must be positive")
        self.max_requests, self.max_tokens, self.max_waiting = max_requests, max_tokens, max_waiting
        self.requests = 0
        self.tokens = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _fits(self, n: int) -> bool:
        return self.requests < self.max_requests and (
            self.tokens + n <= self.max_tokens or self.requests == 0)

    def _take(self, n: int) -> None:
        self.requests += 1
        self.tokens += n

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self._take(n)
            return
        if len(self._waiters) >= self.max_waiting:
            raise server_busy(len(self._waiters))
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)  # admitted just as the client went away
            else:
                self._waiters.remove(entry)
                self._wake()  # a smaller request behind it may fit now
            raise

    def release(self, n: int) -> None:
        self.requests -= 1
        self.tokens -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if fut.done():
                continue
            self._take(n)
            fut.set_result(None)


@dataclass
class Job:
    """One prompt on its way through the engine. ``future`` (loop thread) resolves to the
    file's :class:`Reservation` once the states are computed and the lock is held."""
    key: str
    token_ids: list[int]
    future: asyncio.Future[Reservation]
    cancelled: bool = False
    admitted: bool = False
    reservation: Reservation | None = None


class EngineThread:
    """Runs ``extractor``'s stream; ``submit``/``cancel`` from any thread."""

    def __init__(self, extractor: Any, files: HiddenStatesFiles,
                 loop: asyncio.AbstractEventLoop, on_done: Any) -> None:
        self.extractor = extractor
        self.files = files
        self.loop = loop
        self._on_done = on_done  # called on the loop with (job) when it holds nothing more
        self._inbox: queue.SimpleQueue[tuple[str, Job | None]] = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}
        self.error: BaseException | None = None
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="vllm-compat-engine",
                                        daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if not self.alive:
            raise ApiError(f"the engine stopped: {self.error!r}",
                           status=HTTPStatus.SERVICE_UNAVAILABLE, err_type="EngineDeadError")
        self._inbox.put(("add", job))

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self._inbox.put(("cancel", job))

    def stop(self, timeout: float | None = None) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---- the engine thread

    def _run(self) -> None:
        stream = None
        try:
            stream = self.extractor.open_stream()
            while True:
                if not self._apply(self._take(block=not stream.busy), stream):
                    break
                if stream.busy:
                    done = stream.step()
                    self.steps += 1
                    for key, sample in done:
                        job = self._jobs.pop(key, None)
                        if job is not None:
                            self._deliver(job, sample)
        except BaseException as exc:  # noqa: BLE001 - every waiting request must hear of it
            log.exception("the extraction engine failed")
            self.error = exc
            for job in list(self._jobs.values()):
                self._fail(job, ApiError(f"the extraction engine failed: {exc!r}",
                                         status=HTTPStatus.INTERNAL_SERVER_ERROR,
                                         err_type="InternalServerError"))
            self._jobs.clear()
        finally:
            if stream is not None:
                stream.close()
            # requests still in the inbox: tell them too
            while True:
                try:
                    _, job = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if job is not None and not job.cancelled:
                    self._fail(job, ApiError("the server is shutting down",
                                             status=HTTPStatus.SERVICE_UNAVAILABLE,
                                             err_type="ServiceUnavailableError"))

    def _take(self, block: bool) -> list[tuple[str, Job | None]]:
        cmds = []
        try:
            cmds.append(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
            while True:
                cmds.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _apply(self, cmds: list[tuple[str, Job | None]], stream: Any) -> bool:
        for cmd, job in cmds:
            if cmd == "stop":
                return False
            assert job is not None
            if cmd == "add":
                if job.cancelled:  # its client left before the engine saw it
                    self._done(job)
                    continue
                try:
                    stream.add(job.key, job.token_ids)
                except ValueError as exc:  # checked at the door; a last guard
                    self._fail(job, ApiError(str(exc)))
                    continue
                self._jobs[job.key] = job
            elif cmd == "cancel" and self._jobs.pop(job.key, None) is not None:
                stream.cancel(job.key)  # its KV blocks are free from here on
                self._done(job)
            # a cancel for a delivered job: its file write ends it (HiddenStatesFiles.discard)
        return True

    def _done(self, job: Job) -> None:
        self.loop.call_soon_threadsafe(self._on_done, job)

    def _deliver(self, job: Job, sample: Any) -> None:
        if job.cancelled:
            return
        res = self.files.reserve(job.key)  # the lock is held before the path leaves
        job.reservation = res
        self.loop.call_soon_threadsafe(self._resolve, job, res)
        def written(ok: bool) -> None:  # in the writer thread
            self.loop.call_soon_threadsafe(self._on_done, job)

        self.files.write(res, sample.token_ids, sample.hidden_states, on_done=written)

    def _resolve(self, job: Job, res: Reservation) -> None:
        if job.future.done() or job.cancelled:  # the client left meanwhile
            self.files.discard(res)
            return
        job.future.set_result(res)

    def _fail(self, job: Job, err: ApiError) -> None:
        def fail() -> None:
            if not job.future.done():
                job.future.set_exception(err)
            self._on_done(job)
        self.loop.call_soon_threadsafe(fail)
