"""Prompt validation in make_request runs before vLLM is touched (pure Python).

Every bad input has a test with the exact message. The fast path (one marshal pass) is
checked against the element-by-element reference on generated inputs.
"""

import enum
import re
from array import array
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_compat import make_request
from vllm_compat.errors import VllmCompatError
from vllm_compat.hashing import _check_block_size
from vllm_compat.requests import InvalidPromptError, _check_prompt, _check_slow, _fast_ok


class NumpyLikeInt:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v

    def __repr__(self):
        return f"NumpyLikeInt({self.v})"


class Tok(enum.IntEnum):
    BOS = 1


def raises_exactly(message, exc=InvalidPromptError):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


# ---------------------------------------------------------------- accepted input


def test_plain_ints_pass_through_as_a_copy():
    ids = [5, 0, 9]
    out = _check_prompt(ids)
    assert out == [5, 0, 9] and out is not ids


@pytest.mark.parametrize("seq", [(5, 0, 9), array("q", [5, 0, 9]), iter([5, 0, 9]), range(5, 6)])
def test_other_sequences_become_lists(seq):
    out = _check_prompt(seq)
    assert type(out) is list and all(type(t) is int for t in out)


def test_integer_scalars_become_python_ints():
    out = _check_prompt((NumpyLikeInt(3), 4), 10)
    assert out == [3, 4] and all(type(t) is int for t in out)


@pytest.mark.parametrize("odd", [True, Tok.BOS])
def test_int_subclasses_become_plain_ints(odd):
    # a bool / IntEnum pickles differently from 1, so it would not hash like the engine's id
    out = _check_prompt([2, odd])
    assert out == [2, 1] and all(type(t) is int for t in out)


def test_numpy_and_torch_inputs():
    np = pytest.importorskip("numpy")
    for arr in (np.array([3, 4], dtype=np.int64), np.array([3, 4], dtype=np.int32)):
        out = _check_prompt(arr)
        assert out == [3, 4] and all(type(t) is int for t in out)
    out = _check_prompt([np.int64(3), 4])  # list(ndarray) gives numpy scalars
    assert out == [3, 4] and all(type(t) is int for t in out)
    with raises_exactly("prompt_token_ids must be 1-D, got shape (1, 2)"):
        _check_prompt(np.array([[3, 4]]))
    torch = pytest.importorskip("torch")
    out = _check_prompt(torch.tensor([3, 4]))
    assert out == [3, 4] and all(type(t) is int for t in out)
    out = _check_prompt(list(torch.tensor([3, 4])))  # 0-d tensors
    assert out == [3, 4] and all(type(t) is int for t in out)


def test_limits_are_inclusive_where_they_should_be():
    assert _check_prompt([0, 31999], 32000) == [0, 31999]
    assert _check_prompt([2**31 - 1]) == [2**31 - 1]
    assert _check_prompt([1] * 7, None, 7, 8) == [1] * 7


# ---------------------------------------------------------------- bad input, exact messages


def test_empty_prompt():
    with raises_exactly("prompt_token_ids is empty: a request needs at least one prompt token"):
        _check_prompt([])
    with raises_exactly("prompt_token_ids is empty: a request needs at least one prompt token"):
        _check_prompt(())


@pytest.mark.parametrize("bad,index,shown", [
    ([1, 2.0], 1, "2.0 (float)"), ([None], 0, "None (NoneType)"), ([1, "3"], 1, "'3' (str)"),
    ([1, [2]], 1, "[2] (list)"),
])
def test_non_integer_token(bad, index, shown):
    with raises_exactly(f"prompt_token_ids[{index}] is {shown}, not an integer token id"):
        _check_prompt(bad)


@pytest.mark.parametrize("bad,index,value", [([1, 2, -1], 2, -1), ([-5], 0, -5),
                                             ([3, -2**40], 1, -2**40)])
def test_negative_token(bad, index, value):
    with raises_exactly(f"prompt_token_ids[{index}] = {value} is negative: token ids are >= 0"):
        _check_prompt(bad)


def test_negative_numpy_like_scalar():
    with raises_exactly("prompt_token_ids[1] = -3 is negative: token ids are >= 0"):
        _check_prompt([1, NumpyLikeInt(-3)])


def test_token_beyond_vocab():
    with raises_exactly("prompt_token_ids[1] = 32000 is out of vocabulary: the model's "
                        "vocab_size is 32000, so token ids are 0..31999"):
        _check_prompt([5, 32000, 7], 32000)


def test_token_beyond_vocab_on_the_slow_path():
    with raises_exactly("prompt_token_ids[2] = 40000 is out of vocabulary: the model's "
                        "vocab_size is 32000, so token ids are 0..31999"):
        _check_prompt([5, True, 40000], 32000)


@pytest.mark.parametrize("big", [2**31, 2**63, 2**70])
def test_token_beyond_int32(big):
    with raises_exactly(f"prompt_token_ids[1] = {big} is too large: vLLM keeps token ids in "
                        "int32 (< 2**31 = 2147483648)"):
        _check_prompt([1, big])


@pytest.mark.parametrize("prompt,kind", [("hello", "str"), (b"\x01\x02", "bytes")])
def test_text_instead_of_token_ids(prompt, kind):
    with raises_exactly(f"prompt_token_ids is a {kind}, not a sequence of token ids: "
                        "tokenize the prompt first"):
        _check_prompt(prompt)


def test_unordered_container():
    with raises_exactly("prompt_token_ids is a set, which has no order: pass a list of token ids"):
        _check_prompt({1, 2})


def test_not_a_sequence():
    with raises_exactly("prompt_token_ids must be a sequence of token ids, got int"):
        _check_prompt(5)


def test_prompt_longer_than_max_model_len():
    msg = ("prompt_token_ids has 8 tokens, max_model_len is 8: at most 7 prompt tokens fit "
           "(one position is kept for the sampled token)")
    with raises_exactly(msg):
        make_request("r", [1] * 8, max_model_len=8)
    with raises_exactly(msg):
        make_request("r", [1] * 8, config=SimpleNamespace(max_model_len=8, get_vocab_size=lambda: 100))


def test_pooling_prompt_may_fill_max_model_len_but_not_more():
    with raises_exactly("prompt_token_ids has 9 tokens, more than max_model_len 8"):
        make_request("r", [1] * 9, max_model_len=8, pooling_params=object())


def test_config_supplies_vocab_and_length():
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64,
                                                               get_vocab_size=lambda: 100))
    with raises_exactly("prompt_token_ids[0] = 100 is out of vocabulary: the model's "
                        "vocab_size is 100, so token ids are 0..99"):
        make_request("r", [100], config=vllm_config)
    # explicit keywords win over the config
    with raises_exactly("prompt_token_ids[0] = 50 is out of vocabulary: the model's "
                        "vocab_size is 50, so token ids are 0..49"):
        make_request("r", [50], config=vllm_config, vocab_size=50)


def test_config_of_the_wrong_kind():
    with raises_exactly("config must be a VllmConfig or ModelConfig, got dict", VllmCompatError):
        make_request("r", [1], config={"max_model_len": 8})


@pytest.mark.parametrize("name", ["vocab_size", "max_model_len"])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_limits(name, bad):
    with raises_exactly(f"{name} must be a positive integer, got {bad!r}", VllmCompatError):
        make_request("r", [1], **{name: bad})


@pytest.mark.parametrize("bad", [0, -16, 1.5, "16", True, None])
def test_bad_block_size(bad):
    with raises_exactly(f"block_size must be a positive integer, got {bad!r}", VllmCompatError):
        _check_block_size(bad)


def test_errors_are_value_errors_too():
    with pytest.raises(ValueError):
        _check_prompt([])


# ---------------------------------------------------------------- fast path == reference

items = st.one_of(
    st.integers(0, 2**31 - 1), st.integers(0, 300), st.integers(-2**33, 2**33),
    st.booleans(), st.floats(allow_nan=False), st.none(),
    st.integers(-5, 2**32).map(NumpyLikeInt), st.just(Tok.BOS),
)


def _outcome(fn, *args):
    try:
        out = fn(*args)
    except InvalidPromptError as exc:
        return "error", str(exc)
    assert all(type(t) is int for t in out)
    return "ok", out


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(items, min_size=1, max_size=40), vocab=st.one_of(st.none(), st.integers(1, 2**32)))
def test_fast_path_agrees_with_the_reference(ids, vocab):
    assert _outcome(_check_prompt, ids, vocab) == _outcome(_check_slow, list(ids), vocab)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(-2**40, 2**40), min_size=1, max_size=60))
def test_fast_check_is_exact_for_ints(ids):
    assert _fast_ok(ids) == all(0 <= t < 2**31 for t in ids)


@pytest.mark.parametrize("odd", [True, False, 1.0, NumpyLikeInt(1), Tok.BOS, "1", None, 2**31, -1])
@pytest.mark.parametrize("pos", [0, 1, 5])
def test_fast_check_rejects_anything_but_small_exact_ints(odd, pos):
    ids = [7, 8, 9, 10, 11, 12]
    ids[pos] = odd
    assert not _fast_ok(ids)
