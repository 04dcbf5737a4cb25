"""Build a real ``vllm.v1.request.Request`` on every supported release."""

from __future__ import annotations

import marshal
import operator
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .detect import adapter
from .errors import VllmCompatError
from .hashing import make_block_hasher

if TYPE_CHECKING:  # vLLM's classes, for the type checker only
    from .adapters.vllm_types import Request, SamplingParams


# the module (the package's `detect` attribute is the function of the same name)
_detect = sys.modules[adapter.__module__]


class InvalidPromptError(VllmCompatError, ValueError):
    """``prompt_token_ids`` cannot become a valid request (empty, too long, bad token id).

    A ``ValueError`` too, like the error vLLM's own input processor raises for an empty or
    too-long prompt.
    """


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


AUTO: Any = _Auto()
"""Default for ``block_hasher``: build one with ``block_size`` / ``hash_algo``."""

# vLLM's model runners keep token ids in int32 tensors (InputBatch.token_ids_cpu, every
# release): an id at or above 2**31 cannot reach the model even without a known vocab.
TOKEN_ID_LIMIT = 2**31


# ------------------------------------------------------------------ prompt validation
#
# The common input is a list of plain Python ints. It is checked in one C-level pass:
# ``marshal.dumps(ids, 2)`` writes a list as b"[" + 4-byte length + one record per item,
# and an *exact* int in [-2**31, 2**31) as the 5-byte record b"i" + 4 bytes little-endian
# (version 2 never writes back-references). So every record is b"i" (every item is an
# exact int: no bool, float, numpy/torch scalar or int subclass, any of which would hash
# differently from the engine's ints) iff bytes 5, 10, 15, ... are all b"i" (a record of
# another length would put a non-b"i" byte on that grid), and every id is >= 0 iff the
# high byte of each record (bytes 9, 14, ...) is below 0x80. About 13 ns per token on
# the dev box (bench/README.md); sum() + array("Q") cost the same and miss bool / IntEnum,
# min() + max() cost 31 ns and miss numpy scalars, the old array("q") + min + max +
# tolist() 92.
# Anything that fails the fast check goes through _check_slow, which converts what can
# be converted and otherwise names the first bad position; tests check both paths agree.


def _fast_ok(ids: list) -> bool:
    """True when every item of the non-empty list ``ids`` is an exact int in [0, 2**31)."""
    try:
        data = marshal.dumps(ids, 2)
    except Exception:  # noqa: BLE001 - e.g. ValueError for an object marshal cannot write
        return False  # (torch scalar, int subclass, ...): the slow path names it
    return data[5::5] == b"i" * len(ids) and data[9::5].isascii()


def _as_list(prompt_token_ids: Any) -> list:
    """A fresh list of the caller's items (a copy: the Request must not alias their list)."""
    if isinstance(prompt_token_ids, (str, bytes, bytearray)):
        raise InvalidPromptError(
            f"prompt_token_ids is a {type(prompt_token_ids).__name__}, not a sequence of "
            "token ids: tokenize the prompt first"
        )
    tolist = getattr(prompt_token_ids, "tolist", None)
    if tolist is not None:  # numpy array, torch tensor, array.array: C-fast, plain ints
        ndim = getattr(prompt_token_ids, "ndim", 1)
        if ndim != 1:
            raise InvalidPromptError(
                f"prompt_token_ids must be 1-D, got shape {tuple(prompt_token_ids.shape)}"
            )
        return tolist()
    if isinstance(prompt_token_ids, (set, frozenset, dict)):
        raise InvalidPromptError(
            f"prompt_token_ids is a {type(prompt_token_ids).__name__}, which has no order: "
            "pass a list of token ids"
        )
    try:
        return list(prompt_token_ids)
    except TypeError:
        raise InvalidPromptError(
            f"prompt_token_ids must be a sequence of token ids, got "
            f"{type(prompt_token_ids).__name__}"
        ) from None


def _token(i: int, t: Any) -> int:
    """Item ``i`` as a plain int (numpy/torch scalars via ``__index__``), or an error."""
    if type(t) is int:
        return t
    try:
        return int(operator.index(t))  # int(): a bool / IntEnum becomes a plain int
    except TypeError:
        raise InvalidPromptError(
            f"prompt_token_ids[{i}] is {t!r} ({type(t).__name__}), not an integer token id"
        ) from None


def _range_error(i: int, t: int, vocab_size: int | None) -> InvalidPromptError:
    if t < 0:
        return InvalidPromptError(f"prompt_token_ids[{i}] = {t} is negative: token ids are >= 0")
    if vocab_size is not None and t >= vocab_size:
        return InvalidPromptError(
            f"prompt_token_ids[{i}] = {t} is out of vocabulary: the model's vocab_size is "
            f"{vocab_size}, so token ids are 0..{vocab_size - 1}"
        )
    return InvalidPromptError(
        f"prompt_token_ids[{i}] = {t} is too large: vLLM keeps token ids in int32 "
        f"(< 2**31 = {TOKEN_ID_LIMIT})"
    )


def _check_slow(ids: list, vocab_size: int | None) -> list[int]:
    """The reference check: every item converted to a plain int, the first bad one named."""
    limit = TOKEN_ID_LIMIT if vocab_size is None else min(vocab_size, TOKEN_ID_LIMIT)
    out = []
    for i, t in enumerate(ids):
        t = _token(i, t)
        if t < 0 or t >= limit:
            raise _range_error(i, t, vocab_size)
        out.append(t)
    return out


def _check_prompt(prompt_token_ids: Sequence[int], vocab_size: int | None = None,
                  max_prompt_len: int | None = None, max_model_len: int | None = None) -> list[int]:
    """A validated copy of the prompt as plain Python ints (see the notes above)."""
    ids = prompt_token_ids.copy() if type(prompt_token_ids) is list else _as_list(prompt_token_ids)
    n = len(ids)
    if not n:
        raise InvalidPromptError(
            "prompt_token_ids is empty: a request needs at least one prompt token"
        )
    if max_prompt_len is not None and n > max_prompt_len:
        raise InvalidPromptError(_too_long(n, max_prompt_len, max_model_len))
    if not _fast_ok(ids):
        return _check_slow(ids, vocab_size)
    if vocab_size is not None and max(ids) >= vocab_size:
        i = next(i for i, t in enumerate(ids) if t >= vocab_size)
        raise _range_error(i, ids[i], vocab_size)
    return ids


def _too_long(n: int, max_prompt_len: int, max_model_len: int | None) -> str:
    if max_model_len is not None and max_prompt_len < max_model_len:
        return (f"prompt_token_ids has {n} tokens, max_model_len is {max_model_len}: at most "
                f"{max_prompt_len} prompt tokens fit (one position is kept for the sampled token)")
    return f"prompt_token_ids has {n} tokens, more than max_model_len {max_prompt_len}"


def _model_limits(config: Any) -> tuple[int | None, int | None]:
    """``(max_model_len, vocab_size)`` of a VllmConfig or ModelConfig (duck-typed)."""
    mc = getattr(config, "model_config", None) or config
    max_len = getattr(mc, "max_model_len", None)
    get_vocab = getattr(mc, "get_vocab_size", None)
    if max_len is None or get_vocab is None:
        raise VllmCompatError(
            f"config must be a VllmConfig or ModelConfig, got {type(config).__name__}"
        )
    return int(max_len), int(get_vocab())


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VllmCompatError(f"{name} must be a positive integer, got {value!r}")
    return value


# ------------------------------------------------------------------ make_request


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    sampling_params: SamplingParams | None = None,
    pooling_params: Any = None,
    eos_token_id: int | None = None,
    block_hasher: Callable[[Any], list[bytes]] | None = AUTO,
    block_size: int = 16,
    hash_algo: str = "sha256",
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    config: Any = None,
    validate: bool = True,
    **extra: Any,
) -> Request:
    """A real ``Request`` for the installed vLLM, built with keywords for that release.

    - ``prompt_token_ids``: a list (or tuple, numpy array, tensor) of token ids. It is
      copied and checked: not empty, every id an integer in ``[0, vocab_size)`` (``< 2**31``
      without a vocab size), numpy/torch scalars turned into plain ints (they would hash
      differently). Errors are :class:`InvalidPromptError` naming the first bad position.
    - ``vocab_size`` / ``max_model_len``, or ``config`` (a ``VllmConfig`` or ``ModelConfig``
      to read both from): when known, ids must be below ``vocab_size`` and a generating
      request's prompt at most ``max_model_len - 1`` tokens (one position stays for the
      sampled token; a pooling request may use all ``max_model_len``). vLLM's engine
      rejects both too; a bare ``Request`` takes them silently.
    - ``validate=False`` skips all of that (the ids are used as given, not copied): for
      callers whose ids are known-good plain ints, e.g. straight from a tokenizer.
    - ``sampling_params`` defaults to ``SamplingParams(max_tokens=1)``; the caller's object
      is copied, never mutated.
    - ``eos_token_id`` goes where the release reads it: the Request (<= 0.16) and the
      sampling params' stop set (all releases, as the engine's input processor does).
    - ``block_hasher``: by default a hasher for ``block_size`` / ``hash_algo`` is attached
      (vLLM's own, ``init_none_hash`` done). Pass a hasher (e.g. ``block_hasher_for(scheduler)``)
      to match an engine, or ``None`` to opt out: then, with prefix caching on, vLLM
      0.10-0.32 crash in ``schedule()`` and 0.33-0.34 silently never cache the request.
    - ``extra`` keywords go to ``Request`` unchanged; one this release lacks is an error.
    """
    if validate:
        if config is not None:
            cfg_len, cfg_vocab = _model_limits(config)
            max_model_len = cfg_len if max_model_len is None else max_model_len
            vocab_size = cfg_vocab if vocab_size is None else vocab_size
        max_prompt_len = None
        if max_model_len is not None:
            _check_positive("max_model_len", max_model_len)
            # The engine's input processor rejects prompt_len == max_model_len for a
            # generating request from vLLM 0.11 on (0.10.2 capped it after one token);
            # a pooling request produces no token.
            max_prompt_len = max_model_len if pooling_params is not None else max_model_len - 1
        if vocab_size is not None:
            _check_positive("vocab_size", vocab_size)
        ids = _check_prompt(prompt_token_ids, vocab_size, max_prompt_len, max_model_len)
    else:
        ids = prompt_token_ids if type(prompt_token_ids) is list else list(prompt_token_ids)
    if block_hasher is AUTO:
        block_hasher = make_block_hasher(block_size, hash_algo)
    cached = _detect._cached  # adapter() without taking its lock on every request
    ad = cached[1] if cached is not None else adapter()
    return ad.new_request(
        request_id, ids, sampling_params=sampling_params, pooling_params=pooling_params,
        eos_token_id=eos_token_id, block_hasher=block_hasher, **extra,
    )
