"""The server's state and its one operation: prompt token ids in, hidden-state file out.

:class:`HiddenStatesService` ties the extractor (in :class:`~.engine_thread.EngineThread`),
the file writers (:class:`~.hs_files.HiddenStatesFiles`), the request checks
(:class:`~.protocol.RequestChecker`) and admission control together; :mod:`.app` puts HTTP
routes in front of it. No FastAPI here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Sequence

from .engine_thread import Admission, EngineThread, Job
from .hs_files import HiddenStatesFiles, Reservation
from .protocol import PromptRequest, RequestChecker

__all__ = ["HiddenStatesService"]


class HiddenStatesService:
    """``extractor``: a started :class:`~vllm_compat.extract.HiddenStatesExtractor` (owned by
    the service from here on: the engine thread runs it, :meth:`stop` closes it).
    ``served_names``: the names ``/v1/models`` lists and requests may use (the first is the
    default). ``renderer``: a :class:`~.chat.ChatRenderer` for the chat endpoints, or None."""

    def __init__(self, extractor: Any, files: HiddenStatesFiles, *, served_names: Sequence[str],
                 model_path: str, renderer: Any = None, max_pending_requests: int = 256,
                 max_pending_tokens: int | None = None, max_waiting_requests: int = 4096) -> None:
        self.extractor = extractor
        self.files = files
        self.served_names = list(served_names)
        self.model_path = model_path
        self.renderer = renderer
        if extractor.max_prompt_len is None:
            raise ValueError("the model's context length is unknown (no max_position_embeddings "
                             "in config.json): pass --max-model-len")
        self.max_model_len = int(extractor.max_prompt_len) + 1
        vocab = int(extractor.target.vocab_size)
        max_id = vocab - 1 if renderer is None else max(vocab - 1, renderer.max_token_id)
        self.checker = RequestChecker(
            self.served_names, self.max_model_len, max_id,
            render_chat=renderer.render if renderer is not None else None)
        if max_pending_tokens is None:
            max_pending_tokens = max(self.max_model_len, 64 * 1024)
        self.admission = Admission(max_pending_requests, max_pending_tokens, max_waiting_requests)
        self.created = int(time.time())
        self.engine: EngineThread | None = None

    async def start(self) -> None:
        self.engine = EngineThread(self.extractor, self.files, asyncio.get_running_loop(),
                                   self._job_done)
        self.engine.start()

    async def stop(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        await asyncio.to_thread(self.files.close)
        self.extractor.close()

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.engine.alive

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def hidden_states(self, req: PromptRequest, key: str) -> str:
        """Compute ``req``'s states and hand out its file's path (the lock already held, the
        file being written). Waits for admission first. Cancelled (the client left): the
        engine drops the prompt, and no file or lock file stays behind."""
        assert self.engine is not None, "start() the service first"
        n = len(req.token_ids)
        await self.admission.acquire(n)
        job = Job(key, req.token_ids, asyncio.get_running_loop().create_future(), admitted=True)
        submitted = False
        try:
            self.engine.submit(job)
            submitted = True
            res: Reservation = await job.future
        except BaseException:
            fut = job.future
            if not fut.done() or fut.cancelled():  # the client left while it was computed
                if submitted:
                    self.engine.cancel(job)  # the engine thread releases it (or its writer)
                else:
                    self._job_done(job)
            elif fut.exception() is None:  # computed just as the client left
                self.files.discard(fut.result())  # its writer releases it
            raise  # (a failed job was released by the engine thread)
        return res.path

    def _job_done(self, job: Job) -> None:
        """The job holds nothing any more (file written, or dropped): release admission."""
        if job.admitted:
            job.admitted = False
            self.admission.release(len(job.token_ids))
