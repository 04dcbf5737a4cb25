"""The bug vllm_compat exists for: a Request without ``block_hasher`` + prefix caching.

Raw vLLM fails exactly as upstream does (the table in README "Why"); the same scenario
through vllm_compat passes. If these raw tests stop failing, the shim's tests would no
longer prove anything, so they assert the failure, not just "something happened".
"""

from __future__ import annotations

import pytest
from packaging.version import Version

import vllm_compat as vc

from . import reference
from .driver import BLOCK, Run, run_until_done, sp, tokens
from .oracle import oracle


def raw_request(rid: str, ids: list[int]):
    """What fork code does: construct vLLM's Request directly, with no block hasher."""
    return reference.raw_request(request_id=rid, prompt_token_ids=ids, sampling_params=sp(4),
                                 pooling_params=None)


def expected_raw_failure(v: Version):
    """Whether raw vLLM fails on a hasher-less request with prefix caching (what it raises
    is vLLM's business: where it was seen, in the comments)."""
    # < 0.26: AssertionError (assert len(request.block_hashes) >= num_full_blocks);
    # 0.26-0.32: IndexError (new_block_hashes[i] out of range)
    return v < Version("0.33.0")  # 0.33: cache_blocks clamps -> silently never cached


def _raw_failure_in_prefix_caching(info) -> None:
    # where it fails is the oracle's knowledge of vLLM: checked, and on a drifted build
    # reported as outdated instead of failing
    with oracle("the raw failure's place in vLLM (block_pool.cache_full_blocks)"):
        frames = [(e.path.name, e.name) for e in info.traceback]
        assert ("block_pool.py", "cache_full_blocks") in frames


@pytest.fixture
def sched(model_dir):
    cfg = vc.make_vllm_config(model_dir, block_size=BLOCK, enable_prefix_caching=True,
                              num_gpu_blocks=64)
    return vc.make_scheduler(cfg)


def test_raw_request_without_hasher_fails_as_upstream(sched, vllm_version):
    sched.add_request(raw_request("a", tokens(62)))
    if not expected_raw_failure(vllm_version):
        run = run_until_done(sched)
        sched.add_request(raw_request("b", tokens(62)))
        run_until_done(sched, run)
        assert run.first_computed["b"] == 0, "0.33+: hasher-less requests are never cached"
        return
    with pytest.raises(Exception) as info:
        run_until_done(sched)
    assert not isinstance(info.value, vc.VllmCompatError)
    _raw_failure_in_prefix_caching(info)


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
    if not expected_raw_failure(vllm_version):
        run_until_done(sched)
    else:
        with pytest.raises(Exception) as info:
            run_until_done(sched)
        _raw_failure_in_prefix_caching(info)
