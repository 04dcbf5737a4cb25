"""Requests built through vllm_compat drive the real vLLM Scheduler on CPU."""

from __future__ import annotations

import pytest

import vllm_compat as vc

from .driver import BLOCK, FAKE_TOKEN, Run, free_blocks, run_until_done, sp, step, tokens


@pytest.fixture
def make_sched(model_dir):
    def make(prefix_caching: bool = True, **kw):
        cfg = vc.make_vllm_config(model_dir, block_size=BLOCK, enable_prefix_caching=prefix_caching,
                                  num_gpu_blocks=64, **kw)
        return vc.make_scheduler(cfg)

    return make


def add(sched, rid, ids, max_tokens=4):
    req = vc.make_request(rid, ids, sampling_params=sp(max_tokens), eos_token_id=2,
                          block_hasher=vc.block_hasher_for(sched))
    sched.add_request(req)
    return req


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching-on", "caching-off"])
def test_one_request_allocates_then_frees_all_blocks(make_sched, prefix_caching):
    sched = make_sched(prefix_caching)
    total = free_blocks(sched)
    req = add(sched, "a", tokens(3 * BLOCK + 14))  # 62 tokens: 3 full blocks + 14
    run = Run()
    step(sched, run)
    assert total - free_blocks(sched) == 4  # ceil(62 / 16) blocks for the prompt
    run_until_done(sched, run)
    assert run.finished == {"a"}
    assert run.outputs["a"] == [FAKE_TOKEN] * 4
    assert free_blocks(sched) == total
    # 62 prompt + 4 outputs = 66 tokens -> 4 full blocks hashed (one filled during decode)
    assert len(req.block_hashes) == 4


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching-on", "caching-off"])
def test_second_request_hits_the_prefix_cache(make_sched, prefix_caching):
    sched = make_sched(prefix_caching)
    run = Run()
    add(sched, "a", tokens(62))
    run_until_done(sched, run)
    add(sched, "b", tokens(48) + tokens(20, start=700))  # same 3 full blocks, other tail
    run_until_done(sched, run)
    assert run.finished == {"a", "b"}
    assert run.first_computed["b"] == (48 if prefix_caching else 0)


def test_several_requests_sharing_a_prefix(make_sched):
    sched = make_sched(True)
    total = free_blocks(sched)
    shared = tokens(2 * BLOCK)
    run = Run()
    add(sched, "r0", shared + tokens(20, start=300))
    step(sched, run)  # r0's prompt is computed (and its full blocks cached) in this step
    for i in range(1, 5):
        add(sched, f"r{i}", shared + tokens(20 + i, start=300 + 50 * i))
    run_until_done(sched, run)
    assert run.finished == {f"r{i}" for i in range(5)}
    assert run.first_computed == {"r0": 0, **{f"r{i}": 32 for i in range(1, 5)}}
    # Shared blocks are allocated once: 5 requests of 3-4 blocks each would need >= 16.
    assert run.max_blocks_in_use < 16
    assert free_blocks(sched) == total


def test_chunked_prefill_finishes_with_all_hashes(make_sched):
    sched = make_sched(True, max_num_batched_tokens=32, max_model_len=1024)
    req = add(sched, "long", tokens(100), max_tokens=3)
    run = run_until_done(sched)
    assert run.finished == {"long"}
    assert run.steps >= 4 + 2  # 100 prompt tokens in chunks of 32, then 2 decode steps
    assert run.outputs["long"] == [FAKE_TOKEN] * 3
    assert len(req.block_hashes) == req.num_tokens // BLOCK


def test_hasher_follows_the_scheduler_block_size(make_sched):
    sched = make_sched(True)
    h = vc.block_hasher_for(sched)
    assert h.block_size == BLOCK and h.hash_algo == "sha256"


@pytest.mark.parametrize("eos", [2, None], ids=["eos-2", "no-eos"])
def test_eos_token_stops_the_request_on_every_release(make_sched, eos):
    """eos_token_id moved from Request (<= 0.16) to SamplingParams (0.17+); both must stop."""
    sched = make_sched(True)
    sched.add_request(vc.make_request("e", tokens(20), sampling_params=sp(10), eos_token_id=eos,
                                      block_hasher=vc.block_hasher_for(sched)))
    produced, reason = [], None
    while sched.has_unfinished_requests():
        so = vc.schedule(sched)
        out = vc.make_model_runner_output(list(so.num_scheduled_tokens), [[2]])  # the model emits 2
        for eco in vc.update_from_output(sched, so, out).values():
            for o in eco.outputs:
                produced += o.new_token_ids
                reason = o.finish_reason if o.finish_reason is not None else reason
    assert str(reason).lower().endswith("stop" if eos == 2 else "length")
    assert len(produced) == (1 if eos == 2 else 10)
