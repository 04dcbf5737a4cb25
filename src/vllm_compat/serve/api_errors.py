"""HTTP errors in vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``.

The wording of each message is vLLM 0.26.0's (``vllm/entrypoints/openai``, ``renderers``,
``v1/engine/input_processor.py``), so a client that matches on it, or a person who knows
vLLM's, reads the same thing. Requests this server does not answer (it computes prompt
hidden states; it generates nothing) get a 400 that says so.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

__all__ = ["ApiError", "bad_request", "model_not_found", "not_supported", "prompt_too_long"]


class ApiError(Exception):
    """An error response: HTTP status, vLLM's error type, message and parameter."""

    def __init__(self, message: str, *, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 err_type: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": int(self.status)}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(message, param=param)


def model_not_found(name: Any) -> ApiError:
    # vllm/entrypoints/serve/engine/serving.py BaseServing._check_model
    return ApiError(f"The model `{name}` does not exist.", status=HTTPStatus.NOT_FOUND,
                    err_type="NotFoundError", param="model")


def prompt_too_long(max_model_len: int, max_tokens: int, n: int) -> ApiError:
    # vllm/renderers/params.py TokenizeParams._token_len_check (max_total_tokens_param
    # "max_model_len", as the completion and chat requests set it)
    return ApiError(
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {max_tokens} output tokens and your prompt contains {n} input tokens, "
        f"for a total of {n + max_tokens} tokens. Please reduce the length of the input "
        f"prompt or the number of requested output tokens.", param="input_tokens")


def not_supported(what: str, param: str | None = None) -> ApiError:
    """A request field this server cannot honour (vLLM would; we compute prompt states)."""
    return ApiError(f"{what} is not supported by this server: it computes the prompt's hidden "
                    "states for vLLM's extract_hidden_states clients and generates no text",
                    param=param)
