"""What a request body asks for, checked the way vLLM checks it (no FastAPI, no engine).

The part of vLLM's OpenAI API that speculators 0.5-0.9 and hs-connectors 0.9 use:

* ``POST /v1/completions``: ``prompt`` = one list of token ids, ``max_tokens=1``,
  ``return_token_ids`` -> ``choices[0].prompt_token_ids``;
* ``POST /v1/chat/completions``: ``messages`` rendered with the chat template
  (``add_generation_prompt``, ``continue_final_message``, ``tools``,
  ``chat_template_kwargs``), ``max_tokens=1``, ``return_token_ids`` -> top-level
  ``prompt_token_ids``;
* ``POST /v1/chat/completions/render``: the same rendering, optionally truncated
  (``truncate_prompt_tokens``, ``truncation_side``), token ids only.

Checks and their messages follow vLLM 0.26.0 in vLLM's order: the model name (404), the
prompt's presence and length (the length check leaves room for ``max_tokens``), an empty
prompt, then out-of-vocabulary ids. Fields that would change the answer and that this server
cannot honour (streaming, several choices, logprobs, beam search, more than one generated
token, per-request KV-transfer parameters, images) get a 400 naming the field; sampling
fields that only shape the one token vLLM would sample are accepted and have no effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .api_errors import ApiError, bad_request, model_not_found, not_supported, prompt_too_long

__all__ = ["PromptRequest", "RequestChecker"]

# Fields whose presence (with a value other than these defaults) changes what vLLM answers.
_UNSUPPORTED_COMMON: dict[str, Any] = {
    "stream": (None, False), "n": (None, 1), "best_of": (None, 1), "use_beam_search": (None, False),
    "logprobs": (None, False), "top_logprobs": (None, 0), "prompt_logprobs": (None,),
    "kv_transfer_params": (None, {}), "prompt_embeds": (None,), "echo": (None, False),
    "response_format": (None,), "structured_outputs": (None,), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "suffix": (None,), "logit_bias": (None, {}), "min_tokens": (None, 0),
}


@dataclass(frozen=True)
class PromptRequest:
    """A checked request: the model name to echo, the prompt's token ids, and whether the
    response carries them back (``return_token_ids``)."""
    model: str
    token_ids: list[int]
    return_token_ids: bool


class RequestChecker:
    """Checks bodies against the served model. ``render_chat``: messages -> token ids (the
    server's :class:`~.chat.ChatRenderer`), None when the model has no tokenizer."""

    def __init__(self, served_names: Sequence[str], max_model_len: int, max_token_id: int, *,
                 render_chat: Callable[..., list[int]] | None = None) -> None:
        self.served_names = list(served_names)
        self.max_model_len = max_model_len
        self.max_token_id = max_token_id
        self._render_chat = render_chat

    # ---- endpoints

    def completion(self, body: Any) -> PromptRequest:
        body = _object(body)
        model = self._model(body)
        self._refuse_unsupported(body)
        max_tokens = self._one_token(body, ("max_tokens",), default=16)
        prompt = body.get("prompt")
        if isinstance(prompt, (str, bytes)) or (
                isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            raise not_supported("A text prompt (send token ids: this server loads no "
                                "tokenizer for /v1/completions)", param="prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise not_supported(f"A batch of {len(prompt)} prompts (send one list of token "
                                    "ids per request)", param="prompt")
            prompt = prompt[0]
        if prompt is None or prompt == []:
            # vllm/renderers/base.py render_prompts: no prompt to render
            raise bad_request("You must pass at least one prompt")
        ids = _token_ids(prompt, "prompt")
        ids = self._truncate(body, ids, max_tokens)
        self._check_prompt(ids, max_tokens)
        return PromptRequest(model, ids, bool(body.get("return_token_ids")))

    def chat(self, body: Any) -> PromptRequest:
        body = _object(body)
        self._check_generation_prompt(body)
        model = self._model(body)
        self._refuse_unsupported(body)
        if body.get("tool_choice") not in (None, "none", "auto"):  # forces a tool call
            raise not_supported(f"tool_choice={body['tool_choice']!r}", param="tool_choice")
        max_tokens = self._one_token(body, ("max_completion_tokens", "max_tokens"), default=None)
        ids = self._render(body, default_generation_prompt=True)
        ids = self._truncate(body, ids, max_tokens)
        self._check_prompt(ids, max_tokens)
        return PromptRequest(model, ids, bool(body.get("return_token_ids")))

    def render(self, body: Any) -> PromptRequest:
        """``/v1/chat/completions/render``: token ids only (nothing is computed)."""
        body = _object(body)
        self._check_generation_prompt(body)
        model = self._model(body)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0
        ids = self._render(body, default_generation_prompt=True)
        ids = self._truncate(body, ids, max_tokens)
        if len(ids) > self.max_model_len - max_tokens:
            raise prompt_too_long(self.max_model_len, max_tokens, len(ids))
        if not ids:
            # vllm/entrypoints/scale_out/render/serving.py
            raise bad_request("No token_ids rendered")
        return PromptRequest(model, ids, True)

    # ---- checks, in vLLM's order

    def _model(self, body: Mapping[str, Any]) -> str:
        name = body.get("model")
        if name in (None, ""):
            return self.served_names[0]
        if name not in self.served_names:
            raise model_not_found(name)
        return str(name)

    @staticmethod
    def _check_generation_prompt(body: Mapping[str, Any]) -> None:
        # vllm/entrypoints/openai/chat_completion/protocol.py check_generation_prompt
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise bad_request("Cannot set both `continue_final_message` and "
                              "`add_generation_prompt` to True.")

    @staticmethod
    def _refuse_unsupported(body: Mapping[str, Any]) -> None:
        for f, allowed in _UNSUPPORTED_COMMON.items():
            if f in body and body[f] not in allowed:
                raise not_supported(f"{f}={body[f]!r}", param=f)

    @staticmethod
    def _one_token(body: Mapping[str, Any], fields: Sequence[str], default: int | None) -> int:
        for f in fields:
            if body.get(f) is not None:
                v = body[f]
                if isinstance(v, bool) or not isinstance(v, int):
                    raise bad_request(f"{f} must be an integer, got {v!r}", param=f)
                if v != 1:
                    raise not_supported(f"{f}={v} (send {f}=1: the hidden states are the "
                                        "prompt's, one sampled token is what vLLM's "
                                        "extract_hidden_states clients request)", param=f)
                return 1
        if default is not None and default != 1:
            raise not_supported(f"{fields[-1]} left at vLLM's default of {default} (send "
                                f"{fields[-1]}=1)", param=fields[-1])
        return 1

    def _render(self, body: Mapping[str, Any], *, default_generation_prompt: bool) -> list[int]:
        if body.get("chat_template") is not None or (
                isinstance(body.get("chat_template_kwargs"), dict)
                and body["chat_template_kwargs"].get("chat_template") is not None):
            # vllm/renderers/online_renderer.py validate_chat_template
            raise bad_request("Chat template is passed with request, but "
                              "--trust-request-chat-template is not set. Refused request "
                              "with untrusted chat template.")
        if self._render_chat is None:
            raise not_supported("A chat request for a model served without a tokenizer "
                                "(its directory has no tokenizer files)", param="messages")
        from .chat import check_text_only

        messages = check_text_only(body.get("messages"))
        agp = body.get("add_generation_prompt")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise bad_request("chat_template_kwargs must be an object",
                              param="chat_template_kwargs")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise bad_request("tools must be a list", param="tools")
        return self._render_chat(
            messages, add_generation_prompt=default_generation_prompt if agp is None else bool(agp),
            continue_final_message=bool(body.get("continue_final_message")), tools=tools,
            chat_template_kwargs=kwargs)

    def _truncate(self, body: Mapping[str, Any], ids: list[int], max_tokens: int) -> list[int]:
        n = body.get("truncate_prompt_tokens")
        side = body.get("truncation_side")
        if side not in (None, "left", "right"):
            raise bad_request("`truncation_side` must be either 'left' or 'right'.",
                              param="truncation_side")
        if n is None:
            return ids
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise bad_request(f"truncate_prompt_tokens must be an integer >= -1, got {n!r}",
                              param="truncate_prompt_tokens")
        limit = self.max_model_len - max_tokens
        if n > limit:
            # vllm/renderers/params.py TokenizeParams.__post_init__
            raise ApiError(
                f"truncate_prompt_tokens={n} cannot be greater than max_model_len - "
                f"max_tokens = {limit}. Please request a smaller truncation size.",
                param="truncate_prompt_tokens")
        keep = limit if n == -1 else n
        if keep >= len(ids):
            return ids
        if keep == 0:
            return []
        return ids[-keep:] if side == "left" else ids[:keep]

    def _check_prompt(self, ids: list[int], max_tokens: int) -> None:
        if len(ids) > self.max_model_len - max_tokens:
            raise prompt_too_long(self.max_model_len, max_tokens, len(ids))
        if not ids:
            # vllm/v1/engine/input_processor.py _validate_prompt_len
            raise bad_request("The decoder prompt cannot be empty")
        top = max(ids)
        if top > self.max_token_id:
            # vllm/v1/engine/input_processor.py _validate_model_input
            raise bad_request(f"Token id {top} is out of vocabulary")


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _token_ids(prompt: Any, param: str) -> list[int]:
    if not isinstance(prompt, list):
        raise bad_request(f"{param} must be a list of token ids", param=param)
    for j, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad_request(f"{param}[{j}] = {t!r} is not a token id", param=param)
        if t < 0:
            # CompletionRequest.prompt is list[Annotated[int, Field(ge=0)]] in vLLM
            raise bad_request(f"{param}[{j}]: Input should be greater than or equal to 0",
                              param=param)
    return list(prompt)
