"""serve-hidden-states' request checks: vLLM 0.26.0's status, error type, parameter and
message for each bad request, and a clear 400 for what the server cannot honour."""

from __future__ import annotations

import pytest

from vllm_compat.serve.api_errors import ApiError
from vllm_compat.serve.protocol import RequestChecker

MAX_LEN = 32
VOCAB = 100


def render(messages, *, add_generation_prompt, continue_final_message, tools=None,
           chat_template_kwargs=None):
    """A stand-in template: one token per message plus a generation-prompt token."""
    ids = [10 + len(str(m.get("content"))) for m in messages]
    return ids + ([99] if add_generation_prompt else [])


@pytest.fixture
def checker():
    return RequestChecker(["served-model", "alias"], MAX_LEN, VOCAB - 1, render_chat=render)


def error(fn, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body)
    return info.value


def test_a_good_completion(checker):
    req = checker.completion({"model": "alias", "prompt": [1, 2, 3], "max_tokens": 1,
                              "return_token_ids": True, "temperature": 0.7, "seed": 3})
    assert (req.model, req.token_ids, req.return_token_ids) == ("alias", [1, 2, 3], True)
    assert checker.completion({"prompt": [[5, 6]], "max_tokens": 1}).model == "served-model"


@pytest.mark.parametrize("body, status, err_type, param, message", [
    ({"model": "other", "prompt": [1], "max_tokens": 1}, 404, "NotFoundError", "model",
     "The model `other` does not exist."),
    ({"prompt": list(range(1, MAX_LEN + 1)), "max_tokens": 1}, 400, "BadRequestError",
     "input_tokens",
     f"This model's maximum context length is {MAX_LEN} tokens. However, you requested 1 "
     f"output tokens and your prompt contains {MAX_LEN} input tokens, for a total of "
     f"{MAX_LEN + 1} tokens. Please reduce the length of the input prompt or the number of "
     "requested output tokens."),
    ({"prompt": [], "max_tokens": 1}, 400, "BadRequestError", None,
     "You must pass at least one prompt"),
    ({"max_tokens": 1}, 400, "BadRequestError", None, "You must pass at least one prompt"),
    ({"prompt": [1, VOCAB, 3], "max_tokens": 1}, 400, "BadRequestError", None,
     f"Token id {VOCAB} is out of vocabulary"),
    ({"prompt": [1, -2], "max_tokens": 1}, 400, "BadRequestError", "prompt",
     "prompt[1]: Input should be greater than or equal to 0"),
])
def test_bad_completions_answer_as_vllm_does(checker, body, status, err_type, param, message):
    err = error(checker.completion, body)
    assert (int(err.status), err.err_type, err.param, err.message) == (
        status, err_type, param, message)
    assert err.body() == {"error": {"message": message, "type": err_type, "param": param,
                                    "code": status}}


def test_the_model_check_comes_first(checker):
    """vLLM checks the model before it renders: a wrong model with an over-long prompt is a
    404, not a 400."""
    err = error(checker.completion, {"model": "x", "prompt": list(range(99)), "max_tokens": 1})
    assert int(err.status) == 404


def test_length_is_checked_before_vocabulary(checker):
    err = error(checker.completion, {"prompt": [VOCAB + 5] * MAX_LEN, "max_tokens": 1})
    assert err.param == "input_tokens"


@pytest.mark.parametrize("field, value", [
    ("stream", True), ("n", 2), ("logprobs", 1), ("prompt_logprobs", 0), ("echo", True),
    ("use_beam_search", True), ("kv_transfer_params", {"include_output_tokens": True}),
    ("kv_transfer_params", {"hidden_states_path": "/elsewhere"}), ("suffix", "x"),
    ("response_format", {"type": "json_object"}), ("max_tokens", 2),
])
def test_fields_that_change_the_answer_are_refused_by_name(checker, field, value):
    body = {"prompt": [1, 2], "max_tokens": 1, field: value}
    err = error(checker.completion, body)
    assert int(err.status) == 400 and err.param == field
    assert "is not supported by this server" in err.message


def test_max_tokens_left_at_vllms_default_is_refused(checker):
    err = error(checker.completion, {"prompt": [1, 2]})
    assert err.param == "max_tokens" and "default of 16" in err.message


def test_text_and_batched_prompts_are_refused(checker):
    assert error(checker.completion, {"prompt": "hello", "max_tokens": 1}).param == "prompt"
    assert error(checker.completion, {"prompt": [[1], [2]], "max_tokens": 1}).param == "prompt"


def test_a_chat_request(checker):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    req = checker.chat({"messages": msgs, "max_tokens": 1, "add_generation_prompt": False,
                        "continue_final_message": False, "return_token_ids": True})
    assert req.token_ids == [12, 15]
    assert checker.chat({"messages": msgs, "max_completion_tokens": 1}).token_ids[-1] == 99
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "bc"}]}]
    assert checker.chat({"messages": parts, "max_tokens": 1,
                         "add_generation_prompt": False}).token_ids == [14]  # "a\nbc"


def test_bad_chat_requests(checker):
    msgs = [{"role": "user", "content": "hi"}]
    err = error(checker.chat, {"messages": msgs, "max_tokens": 1, "add_generation_prompt": True,
                               "continue_final_message": True})
    assert err.message == ("Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert "image_url" in error(checker.chat, {"messages": image, "max_tokens": 1}).message
    err = error(checker.chat, {"messages": msgs, "max_tokens": 1, "chat_template": "{{x}}"})
    assert "--trust-request-chat-template is not set" in err.message
    assert int(error(checker.chat, {"model": "nope", "messages": msgs}).status) == 404


def test_render_truncates_as_vllm_does(checker):
    msgs = [{"role": "user", "content": "x" * k} for k in range(5)]
    full = checker.render({"messages": msgs, "add_generation_prompt": True}).token_ids
    assert full == [10, 11, 12, 13, 14, 99]
    right = checker.render({"messages": msgs, "truncate_prompt_tokens": 3,
                            "truncation_side": "right"}).token_ids
    left = checker.render({"messages": msgs, "truncate_prompt_tokens": 3,
                           "truncation_side": "left"}).token_ids
    assert (right, left) == (full[:3], full[-3:])
    err = error(checker.render, {"messages": msgs, "truncate_prompt_tokens": MAX_LEN + 1})
    assert err.message == (f"truncate_prompt_tokens={MAX_LEN + 1} cannot be greater than "
                           f"max_model_len - max_tokens = {MAX_LEN}. Please request a smaller "
                           "truncation size.")
    assert err.param == "truncate_prompt_tokens"


def test_chat_without_a_tokenizer_is_refused():
    c = RequestChecker(["m"], MAX_LEN, VOCAB - 1)
    err = error(c.chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert err.param == "messages" and "without a tokenizer" in err.message
