"""Conversations to token ids, the way vLLM's chat endpoints render them.

vLLM (0.26.0, ``renderers/hf.py::safe_apply_chat_template``) applies the tokenizer's chat
template with ``tokenize=True`` (the template's text tokenized without adding special
tokens), passing ``tools``, ``add_generation_prompt``, ``continue_final_message`` and the
request's ``chat_template_kwargs``. A message whose content is a list of text parts is joined
with newlines first (vLLM's "string" content format). Only text: a conversation with
images, audio or video needs the model's processor and vision tower, which the extractor
does not run (:func:`check_text_only` says so).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..tokenizer import load_tokenizer
from .api_errors import ApiError, bad_request, not_supported

__all__ = ["ChatRenderer", "check_text_only"]


def check_text_only(messages: Any) -> list[dict[str, Any]]:
    """The messages with list contents joined into strings; 400 for anything but text."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'",
                              param="messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise not_supported(f"messages[{i}] content part of type {kind!r} "
                                        "(only text parts)", param="messages")
                texts.append(part["text"])
            m = dict(m, content="\n".join(texts))
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of parts",
                              param="messages")
        out.append(m)
    return out


class ChatRenderer:
    """The served model's tokenizer and chat template."""

    def __init__(self, tokenizer_path: str, *, chat_template: str | None = None,
                 trust_remote_code: bool = False) -> None:
        self.tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code,
                                        chat_template=chat_template)

    @property
    def max_token_id(self) -> int:
        """The largest id the tokenizer knows (vLLM's ``tokenizer.max_token_id``)."""
        return max(self.tokenizer.get_vocab().values())

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
               continue_final_message: bool, tools: Sequence[Any] | None = None,
               chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if self.tokenizer.chat_template is None:
            # vllm/renderers/hf.py: ChatTemplateResolutionError
            raise bad_request("As of transformers v4.44, default chat template is no longer "
                              "allowed, so you must provide a chat template if the tokenizer "
                              "does not define one.")
        kwargs = {k: v for k, v in (chat_template_kwargs or {}).items()
                  if k not in ("tokenize", "chat_template", "return_dict")}
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=list(tools) if tools is not None else None, tokenize=True,
                return_dict=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        except ApiError:
            raise
        except Exception as exc:  # the template raised: vLLM answers 400 with its message
            raise bad_request(str(exc)) from exc
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
