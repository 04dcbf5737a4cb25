"""The bug vllm_compat exists for: a Request without ``block_hasher`` + prefix caching.

Raw vLLM fails exactly as upstream does (the table in README "Why"); the same scenario
through vllm_compat passes. If these raw tests stop failing, the shim's tests would no
longer prove anything, so they assert the failure, not just "something happened".
"""

from __future__ import annotations

import inspect

import pytest
from packaging.version import Version

import vllm_compat as vc

from .driver import Run, run_until_done
from .oracle import oracle_fn
from .test_scheduler import BLOCK, sp, tokens


@oracle_fn("a raw vLLM Request (test_missing_hasher.raw_request)")
def raw_request(rid: str, ids: list[int]):
    """What fork code does: construct vLLM's Request directly, with no block hasher."""
    from vllm.v1.request import Request

    kw = dict(request_id=rid, prompt_token_ids=ids, sampling_params=sp(4), pooling_params=None)
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:  # removed in 0.17
        kw["eos_token_id"] = 2
    return Request(**kw)


def expected_raw_failure(v: Version):
    if v < Version("0.26.0"):
        return AssertionError  # assert len(request.block_hashes) >= num_full_blocks
    if v < Version("0.33.0"):
        return IndexError  # new_block_hashes[i] out of range
    return None  # 0.33: cache_blocks clamps to the hashes it has -> silently never cached


@pytest.fixture
def sched(model_dir):
    cfg = vc.make_vllm_config(model_dir, block_size=BLOCK, enable_prefix_caching=True,
                              num_gpu_blocks=64)
    return vc.make_scheduler(cfg)


def test_raw_request_without_hasher_fails_as_upstream(sched, vllm_version):
    sched.add_request(raw_request("a", tokens(62)))
    exc = expected_raw_failure(vllm_version)
    if exc is None:
        run = run_until_done(sched)
        sched.add_request(raw_request("b", tokens(62)))
        run_until_done(sched, run)
        assert run.first_computed["b"] == 0, "0.33+: hasher-less requests are never cached"
        return
    with pytest.raises(exc) as info:
        run_until_done(sched)
    frames = [(e.path.name, e.name) for e in info.traceback]
    assert ("block_pool.py", "cache_full_blocks") in frames


def test_same_scenario_through_vllm_compat_passes(sched):
    run = Run()
    for rid in ("a", "b"):
        sched.add_request(vc.make_request(rid, tokens(62), sampling_params=sp(4), eos_token_id=2,
                                          block_hasher=vc.block_hasher_for(sched)))
        run_until_done(sched, run)
    assert run.finished == {"a", "b"} and run.first_computed["b"] == 48


def test_default_make_request_attaches_a_hasher(sched):
    # No block_hasher argument at all: one is attached (block size 16, sha256).
    req = vc.make_request("a", tokens(62), sampling_params=sp(4))
    assert len(req.block_hashes) == 3
    sched.add_request(req)
    assert run_until_done(sched).finished == {"a"}


def test_attach_block_hasher_repairs_a_raw_request(sched):
    run = Run()
    for rid in ("a", "b"):
        req = raw_request(rid, tokens(62))
        vc.attach_block_hasher(req, vc.block_hasher_for(sched))
        assert len(req.block_hashes) == 3
        sched.add_request(req)
        run_until_done(sched, run)
    assert run.first_computed["b"] == 48


def test_explicit_opt_out_reproduces_the_upstream_behaviour(sched, vllm_version):
    req = vc.make_request("a", tokens(62), sampling_params=sp(4), block_hasher=None)
    assert req.block_hashes == []
    sched.add_request(req)
    exc = expected_raw_failure(vllm_version)
    if exc is None:
        run_until_done(sched)
    else:
        with pytest.raises(exc):
            run_until_done(sched)
