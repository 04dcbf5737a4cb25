"""Prompt validation in make_request runs before vLLM is touched (pure Python)."""

import pytest

from vllm_compat.errors import VllmCompatError
from vllm_compat.requests import _check_prompt


class NumpyLikeInt:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


def test_plain_ints_pass_through():
    assert _check_prompt([5, 0, 9], None) == [5, 0, 9]


def test_integer_scalars_become_python_ints():
    out = _check_prompt((NumpyLikeInt(3), 4), 10)
    assert out == [3, 4] and all(type(t) is int for t in out)


def test_empty_prompt():
    with pytest.raises(VllmCompatError, match="prompt_token_ids is empty"):
        _check_prompt([], None)


@pytest.mark.parametrize("bad,index", [([1, 2.0], 1), ([None], 0), ([1, "3"], 1), ([1, 2**70], 1)])
def test_non_integer_token(bad, index):
    with pytest.raises(VllmCompatError, match=rf"prompt_token_ids\[{index}\] is .*not an integer"):
        _check_prompt(bad, None)


def test_negative_token():
    with pytest.raises(VllmCompatError, match=r"prompt_token_ids\[2\] = -1 is outside the vocabulary >= 0"):
        _check_prompt([1, 2, -1], None)


def test_token_beyond_vocab():
    with pytest.raises(VllmCompatError, match=r"prompt_token_ids\[1\] = 32000 is outside the vocabulary \[0, 32000\)"):
        _check_prompt([5, 32000, 7], 32000)
