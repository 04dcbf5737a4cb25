"""The HTTP routes (FastAPI) in front of :class:`~.service.HiddenStatesService`.

Responses have vLLM's shape (0.26.0 ``CompletionResponse`` / ``ChatCompletionResponse``);
the completion itself is empty (``text`` / ``content`` ``""``, no generated token): the
server computes the prompt's hidden states only, which is all vLLM's extract_hidden_states
clients take from the answer (``prompt_token_ids`` and ``kv_transfer_params``).

A request whose client disconnects (or times out) before its answer is ready is cancelled,
as vLLM's ``with_cancellation`` does: the engine drops the prompt at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from http import HTTPStatus
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from .api_errors import ApiError, bad_request
from .protocol import PromptRequest
from .service import HiddenStatesService

__all__ = ["create_app"]

T = TypeVar("T")


def create_app(service: HiddenStatesService) -> FastAPI:
    """The ASGI app; its lifespan starts the engine thread and stops it (closing the
    extractor) at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="vllm-compat hidden states", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=int(exc.status))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if service.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": service.created, "owned_by": "vllm",
             "root": service.model_path, "parent": None, "max_model_len": service.max_model_len,
             "permission": []} for name in service.served_names]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = service.checker.completion(await _json(request))
        rid = service.new_id("cmpl")
        path = await _unless_disconnected(request, lambda: service.hidden_states(req, f"{rid}-0"))
        if path is None:
            return Response(status_code=499)  # nobody is listening
        return JSONResponse(_completion_body(rid, req, path))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _json(request)
        req = await run_in_threadpool(service.checker.chat, body)  # tokenizing: off the loop
        rid = service.new_id("chatcmpl")
        path = await _unless_disconnected(request, lambda: service.hidden_states(req, rid))
        if path is None:
            return Response(status_code=499)
        return JSONResponse(_chat_body(rid, req, path))

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> Response:
        body = await _json(request)
        req = await run_in_threadpool(service.checker.render, body)
        return JSONResponse({"request_id": service.new_id("chatcmpl"), "token_ids": req.token_ids,
                             "assistant_tokens_mask": None, "model": req.model, "stream": False})

    return app


async def _json(request: Request) -> Any:
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        # vllm/entrypoints/serve/utils/api_utils.py validate_json_request
        raise ApiError("Unsupported Media Type: Only 'application/json' is allowed",
                       status=HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                       err_type=HTTPStatus.UNSUPPORTED_MEDIA_TYPE.phrase)
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"JSON decode error: {exc}") from exc


async def _unless_disconnected(request: Request,
                               work: Callable[[], Awaitable[T]]) -> T | None:
    """``work()``, cancelled if the client disconnects first (then None)."""
    task = asyncio.ensure_future(work())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    if task.done() and not task.cancelled():
        return task.result()  # raises the work's own error (an ApiError, ...)
    with contextlib.suppress(asyncio.CancelledError):
        await task  # let its cleanup (the engine cancel) run
    return None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
            "prompt_tokens_details": None}


def _completion_body(rid: str, req: PromptRequest, path: str) -> dict[str, Any]:
    ids = req.token_ids if req.return_token_ids else None
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "token_ids": [] if req.return_token_ids else None,
                     "prompt_logprobs": None, "prompt_token_ids": ids}],
        "usage": _usage(len(req.token_ids)),
        "kv_transfer_params": {"hidden_states_path": path},
    }


def _chat_body(rid: str, req: PromptRequest, path: str) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": "length", "stop_reason": None,
                     "token_ids": [] if req.return_token_ids else None}],
        "usage": _usage(len(req.token_ids)),
        "prompt_logprobs": None,
        "prompt_token_ids": req.token_ids if req.return_token_ids else None,
        "kv_transfer_params": {"hidden_states_path": path},
    }
