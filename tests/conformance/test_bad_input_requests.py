"""Request-level bad input: vllm_compat's exact message, and what raw vLLM does.

Each case asserts the message make_request / make_block_hasher gives on this release, and
then feeds the same input to the raw vLLM path (Request(...) or get_request_block_hasher
straight into a real Scheduler) to show the guard is not redundant: raw vLLM takes every
one of these inputs without a word and fails later, far from the cause, or never.
"""

from __future__ import annotations

import importlib.util
import signal
from typing import Any

import pytest

import vllm_compat as vc
from vllm_compat.errors import VllmCompatError
from vllm_compat.requests import InvalidPromptError

from .driver import Run, step
from .engine_path import hash_fn
from . import reference

MAX_MODEL_LEN = 64
VOCAB = 1024  # the tiny Llama config's vocab_size


def exactly(message: str):
    import re

    return "^" + re.escape(message) + "$"


@pytest.fixture
def cfg(model_dir):
    return vc.make_vllm_config(model_dir, block_size=16, max_model_len=MAX_MODEL_LEN,
                               max_num_batched_tokens=MAX_MODEL_LEN, num_gpu_blocks=64)


def sp(max_tokens: int = 4):
    return reference.sampling_params(max_tokens=max_tokens, temperature=0.0)


def raw_request(rid: str, ids: list[Any], hasher):
    """What fork code does: vLLM's Request constructor, no checks of its own."""
    return reference.raw_request(request_id=rid, prompt_token_ids=ids, sampling_params=sp(),
                                 pooling_params=None, block_hasher=hasher)


def raw_outcome(cfg, ids: list[Any], max_steps: int = 20) -> tuple[str, Any]:
    """Build the raw Request (it never refuses) and drive a real Scheduler with it."""
    sched = vc.make_scheduler(cfg)
    req = raw_request("raw", ids, vc.block_hasher_for(sched))  # constructing never fails
    sched.add_request(req)
    run = Run()
    try:
        while sched.has_unfinished_requests() and run.steps < max_steps:
            step(sched, run)
    except Exception as exc:  # noqa: BLE001 - the late failure is the result
        return "error", exc
    if sched.has_unfinished_requests():
        return "stuck", req
    return "finished", run


# ---------------------------------------------------------------- empty prompt


def test_empty_prompt(cfg):
    with pytest.raises(InvalidPromptError,
                       match=exactly("prompt_token_ids is empty: a request needs at least one prompt token")):
        vc.make_request("r", [], sampling_params=sp())
    kind, what = raw_outcome(cfg, [])
    # Raw: Request([]) is accepted; schedule() then dies inside the prefix cache lookup
    # (0.10.2-0.33: "ValueError: Stop argument for islice() must be None or an integer").
    assert kind in ("error", "stuck"), (kind, what)
    if kind == "error":
        assert "prompt" not in str(what).lower()  # nothing points at the cause


# ---------------------------------------------------------------- prompt too long


def test_prompt_longer_than_max_model_len(cfg):
    ids = list(range(3, 3 + MAX_MODEL_LEN + 16))
    msg = (f"prompt_token_ids has {len(ids)} tokens, max_model_len is {MAX_MODEL_LEN}: at most "
           f"{MAX_MODEL_LEN - 1} prompt tokens fit (one position is kept for the sampled token)")
    for kw in (dict(config=cfg), dict(config=cfg.model_config), dict(max_model_len=MAX_MODEL_LEN)):
        with pytest.raises(InvalidPromptError, match=exactly(msg)):
            vc.make_request("r", ids, sampling_params=sp(), **kw)
    kind, what = raw_outcome(cfg, ids)
    # Raw: accepted; the scheduler computes max_model_len tokens, then either trips
    # `assert num_tokens_scheduled > 0` in update_from_output (0.10-0.26 seen) or keeps
    # the request RUNNING forever without scheduling it again (0.33).
    assert kind in ("error", "stuck"), (kind, what)


def test_prompt_of_exactly_max_model_len(cfg):
    ids = list(range(3, 3 + MAX_MODEL_LEN))
    with pytest.raises(InvalidPromptError, match="at most 63 prompt tokens fit"):
        vc.make_request("r", ids, sampling_params=sp(), config=cfg)
    # one token shorter is fine, and runs
    sched = vc.make_scheduler(cfg)
    sched.add_request(vc.make_request("ok", ids[:-1], sampling_params=sp(), config=cfg,
                                      block_hasher=vc.block_hasher_for(sched)))
    run = Run()
    while sched.has_unfinished_requests():
        step(sched, run)
    assert run.finished == {"ok"}


# ---------------------------------------------------------------- token ids out of range


def test_token_id_at_or_above_vocab_size(cfg):
    assert cfg.model_config.get_vocab_size() == VOCAB
    ids = [5, 6, VOCAB, 7]
    msg = (f"prompt_token_ids[2] = {VOCAB} is out of vocabulary: the model's vocab_size is "
           f"{VOCAB}, so token ids are 0..{VOCAB - 1}")
    for kw in (dict(config=cfg), dict(config=cfg.model_config), dict(vocab_size=VOCAB)):
        with pytest.raises(InvalidPromptError, match=exactly(msg)):
            vc.make_request("r", ids, sampling_params=sp(), **kw)
    # Raw: the Request and the whole scheduler loop take it silently; the first thing to
    # notice is the model's embedding lookup on the device.
    kind, run = raw_outcome(cfg, ids)
    assert kind == "finished" and run.finished == {"raw"}


def test_negative_token_id(cfg):
    ids = [5, -1, 6]
    with pytest.raises(InvalidPromptError,
                       match=exactly("prompt_token_ids[1] = -1 is negative: token ids are >= 0")):
        vc.make_request("r", ids, sampling_params=sp())  # no vocab needed for this one
    kind, run = raw_outcome(cfg, ids)
    assert kind == "finished" and run.finished == {"raw"}  # raw: silently accepted


def test_numpy_scalars_hash_like_ints(cfg):
    np = pytest.importorskip("numpy")
    ids = list(range(100, 140))
    np_ids = list(np.array(ids, dtype=np.int64))  # what list(ndarray) gives
    h = vc.make_block_hasher(16)
    ours = vc.make_request("r", np_ids, sampling_params=sp(), block_hasher=h)
    assert all(type(t) is int for t in ours.prompt_token_ids)
    assert ours.block_hashes == vc.make_request("r", ids, sampling_params=sp(), block_hasher=h).block_hashes
    raw = raw_request("raw", np_ids, h)
    if type(raw.prompt_token_ids) is list:
        # Raw, 0.10-0.33: the numpy scalars are hashed as they are, so the prefix-cache keys
        # differ from the engine's (which receives plain ints) and prefix hits are silently lost.
        assert raw.block_hashes != ours.block_hashes
    else:
        # 0.34 copies the prompt into its int32 TokenBuffer, which makes them ints itself
        assert raw.block_hashes == ours.block_hashes


def test_validate_false_passes_the_list_through(cfg):
    ids = [5, 6, 7]
    req = vc.make_request("r", ids, sampling_params=sp(), validate=False)
    if type(raw_request("raw", ids, None).prompt_token_ids) is list:
        assert req.prompt_token_ids is ids
    else:  # 0.34 copies every prompt into its own int32 TokenBuffer
        assert req.prompt_token_ids == ids and type(req.prompt_token_ids) is not list
    checked = vc.make_request("r", ids, sampling_params=sp())
    assert checked.prompt_token_ids == ids and checked.prompt_token_ids is not ids


# ---------------------------------------------------------------- block hasher


@pytest.mark.parametrize("bad", [0, -16])
def test_block_size_not_positive(bad):
    with pytest.raises(VllmCompatError, match=exactly(f"block_size must be a positive integer, got {bad}")):
        vc.make_block_hasher(bad)
    with pytest.raises(VllmCompatError, match=exactly(f"block_size must be a positive integer, got {bad}")):
        vc.make_request("r", [1, 2, 3], block_size=bad)
    # Raw: get_request_block_hasher takes it, and the hasher never returns: with a step of
    # `bad` its `while True` loop never passes the prompt's end. Interrupted after 0.2 s.
    vc.make_block_hasher(16)  # NONE_HASH initialised, as in an engine
    raw_hasher = reference.request_block_hasher(bad, hash_fn("sha256"))
    req = raw_request("raw", [1, 2, 3], None)

    def stop(*_):
        raise TimeoutError

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(TimeoutError):
            raw_hasher(req)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _offered() -> list[str]:
    return reference.offered_hash_algorithms()


def test_unknown_hash_algorithm_lists_what_this_release_offers():
    offered = _offered()
    note = ""
    if importlib.util.find_spec("xxhash") is None and any(n.startswith("xxhash") for n in offered):
        note = " (the xxhash ones need the 'xxhash' package, which is not installed)"
    msg = f"unknown hash algorithm 'md5'; vLLM {reference.vllm_version()} supports {offered}{note}"
    with pytest.raises(VllmCompatError, match=exactly(msg)):
        vc.make_block_hasher(16, "md5")
    with pytest.raises(VllmCompatError, match=exactly(msg)):
        vc.make_request("r", [1, 2, 3], hash_algo="md5")
    # The list is exactly what this release accepts: every name is a hash function and a
    # valid CacheConfig setting...
    for name in offered:
        assert callable(hash_fn(name))
        assert reference.cache_config(prefix_caching_hash_algo=name).prefix_caching_hash_algo == name
    # ...and raw vLLM refuses an unknown one (whatever its exception) without saying what
    # would work.
    with pytest.raises(Exception) as raw:
        hash_fn("md5")
    assert not any(name in str(raw.value) for name in offered), raw.value


def test_hasher_is_reused_while_its_root_is_current():
    a = vc.make_block_hasher(16, "sha256")
    assert vc.make_block_hasher(16, "sha256") is a
    assert vc.make_block_hasher(32, "sha256") is not a
