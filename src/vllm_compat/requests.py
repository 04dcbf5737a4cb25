"""Build a real ``vllm.v1.request.Request`` on every supported release."""

from __future__ import annotations

from array import array
from typing import Any, Callable, Sequence

from .detect import adapter
from .errors import VllmCompatError
from .hashing import make_block_hasher


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


AUTO: Any = _Auto()
"""Default for ``block_hasher``: build one with ``block_size`` / ``hash_algo``."""


def _check_prompt(prompt_token_ids: Sequence[int], vocab_size: int | None) -> list[int]:
    """Plain Python ints (numpy/torch scalars would hash differently), validated in C."""
    ids = list(prompt_token_ids)
    if not ids:
        raise VllmCompatError("prompt_token_ids is empty: a request needs at least one token")
    try:
        arr = array("q", ids)  # rejects floats, strings, None; accepts __index__ scalars
    except (TypeError, OverflowError):
        i, t = next((i, t) for i, t in enumerate(ids) if not _is_token(t))
        raise VllmCompatError(f"prompt_token_ids[{i}] is {t!r}, not an integer token id") from None
    if min(arr) < 0 or (vocab_size is not None and max(arr) >= vocab_size):
        i, t = next((i, t) for i, t in enumerate(arr)
                    if t < 0 or (vocab_size is not None and t >= vocab_size))
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise VllmCompatError(f"prompt_token_ids[{i}] = {t} is outside the vocabulary {bound}")
    return arr.tolist()


def _is_token(t: Any) -> bool:
    try:
        array("q", [t])
        return True
    except (TypeError, OverflowError):
        return False


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    *,
    sampling_params: Any = None,
    pooling_params: Any = None,
    eos_token_id: int | None = None,
    block_hasher: Callable[[Any], list[bytes]] | None = AUTO,
    block_size: int = 16,
    hash_algo: str = "sha256",
    vocab_size: int | None = None,
    **extra: Any,
) -> Any:
    """A real ``Request`` for the installed vLLM, built with keywords for that release.

    - ``sampling_params`` defaults to ``SamplingParams(max_tokens=1)``; the caller's object
      is copied, never mutated.
    - ``eos_token_id`` goes where the release reads it: the Request (<= 0.16) and the
      sampling params' stop set (all releases, as the engine's input processor does).
    - ``block_hasher``: by default a hasher for ``block_size`` / ``hash_algo`` is attached
      (vLLM's own, ``init_none_hash`` done). Pass a hasher (e.g. ``block_hasher_for(scheduler)``)
      to match an engine, or ``None`` to opt out: then, with prefix caching on, vLLM
      0.10-0.32 crash in ``schedule()`` and 0.33 silently never caches the request.
    - ``extra`` keywords go to ``Request`` unchanged; one this release lacks is an error.
    """
    ids = _check_prompt(prompt_token_ids, vocab_size)
    if block_hasher is AUTO:
        block_hasher = make_block_hasher(block_size, hash_algo)
    return adapter().new_request(
        request_id, ids, sampling_params=sampling_params, pooling_params=pooling_params,
        eos_token_id=eos_token_id, block_hasher=block_hasher, **extra,
    )
