"""The request/scheduler path behind vllm_compat.speculators, on the real vLLM Scheduler (CPU).

speculators 0.3/0.4's generator built prefill-only requests (``max_tokens=1``, greedy,
eos set) and drove vLLM's ``Scheduler`` itself; every vLLM minor broke that path
(block hasher, ``init_none_hash``, scheduler signature, step outputs). Here the same
workload goes through vllm_compat's API: ``make_request`` with the scheduler's hasher,
``make_scheduler``, ``schedule`` / ``update_from_output``. The model is the only thing
fabricated (see driver.py): nothing of vLLM is mocked.

What the generator relies on, checked on the installed release:

* >= 11 prompts of distinct lengths, more than ``max_num_seqs`` and chunked over several
  steps, are each scheduled for exactly their prompt length, in per-step chunks whose
  sum is the prompt (the per-request token attribution the extractor needs);
* every request finishes after its prefill with one sampled token, and every output
  maps back to its input index through the request id (never through a sort of the
  ids: string order puts ``req_10`` before ``req_2``, the speculators 0.4.x bug);
* blocks are all returned; with prefix caching on, full blocks are hashed with the
  engine's hasher and a repeated prompt hits the cache (so a caller that needs states
  for every token must turn caching off, as speculators 0.4.0 did).
"""

from __future__ import annotations

import pytest

import vllm_compat as vc

from . import reference
from .driver import FAKE_TOKEN, Run, free_blocks, run_until_done

BLOCK = 16
EOS = 2
# 13 distinct lengths: below, at and across block boundaries, some longer than the
# per-step token budget so they are chunked.
LENGTHS = [5, 16, 17, 33, 48, 1, 70, 9, 64, 31, 100, 2, 47]


def prompt(i: int, n: int) -> list[int]:
    # distinct content per prompt, no eos, inside the tiny config's vocabulary
    return [10 + (97 * i + 13 * j) % 1000 for j in range(n)]


def prefill_only_params():
    # test-side: what speculators passed
    return reference.sampling_params(max_tokens=1, temperature=0.0)


@pytest.fixture
def make_sched(model_dir):
    def make(prefix_caching: bool, **kw):
        kw.setdefault("max_num_seqs", 4)
        kw.setdefault("max_num_batched_tokens", 64)
        cfg = vc.make_vllm_config(model_dir, block_size=BLOCK, enable_prefix_caching=prefix_caching,
                                  num_gpu_blocks=128, max_model_len=512, **kw)
        return vc.make_scheduler(cfg)

    return make


def add_prompts(sched, prompts: list[list[int]], prefix: str = "req_0_") -> dict[str, int]:
    """Add prefill-only requests the way the generator does; returns request id -> input index."""
    hasher = vc.block_hasher_for(sched)
    index = {}
    for i, ids in enumerate(prompts):
        rid = f"{prefix}{i}"
        sched.add_request(vc.make_request(rid, ids, sampling_params=prefill_only_params(),
                                          eos_token_id=EOS, block_hasher=hasher))
        index[rid] = i
    return index


def run_logged(sched) -> Run:
    """driver.run_until_done: fabricated outputs, chunk sizes per request in ``Run.chunks``."""
    return run_until_done(sched, max_steps=500)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["caching-off", "caching-on"])
def test_prefill_only_batch_maps_back_to_input_order(make_sched, prefix_caching):
    sched = make_sched(prefix_caching)
    total = free_blocks(sched)
    prompts = [prompt(i, n) for i, n in enumerate(LENGTHS)]
    index = add_prompts(sched, prompts)
    log = run_logged(sched)

    assert log.finished == set(index)
    # every request was prefilled exactly once over its chunks, then sampled one token
    for rid, i in index.items():
        assert sum(log.chunks[rid]) == len(prompts[i]), (rid, log.chunks[rid])
        assert all(0 < c <= 64 for c in log.chunks[rid])
        assert log.outputs[rid] == [FAKE_TOKEN]
    # the batch really was split: more prompts than max_num_seqs, long ones chunked
    assert log.steps > len(prompts) // 4
    assert len(log.chunks["req_0_10"]) >= 2  # 100 tokens over a 64-token budget
    # outputs paired by request id -> index give input order and input lengths
    by_input = [None] * len(prompts)
    for rid in log.finished:
        by_input[index[rid]] = sum(log.chunks[rid])
    assert by_input == LENGTHS
    # ...while the speculators 0.4.x pairing (sorted string ids) would not
    sorted_lengths = [LENGTHS[index[r]] for r in sorted(index)]
    assert sorted_lengths != LENGTHS
    assert free_blocks(sched) == total


def test_hasher_covers_every_full_block_of_prefill_only_requests(make_sched):
    sched = make_sched(True)
    prompts = [prompt(i, n) for i, n in enumerate(LENGTHS)]
    hasher = vc.block_hasher_for(sched)
    reqs = []
    for i, ids in enumerate(prompts):
        r = vc.make_request(f"h_{i}", ids, sampling_params=prefill_only_params(),
                            eos_token_id=EOS, block_hasher=hasher)
        sched.add_request(r)
        reqs.append(r)
    run_until_done(sched)
    for r, n in zip(reqs, LENGTHS):
        # prompt + the one sampled token; no decode step follows (max_tokens=1)
        assert len(r.block_hashes) == (n + 1) // BLOCK, (r.request_id, n)


def test_repeated_prompt_hits_the_cache_only_with_caching_on(make_sched):
    for caching, expect in ((True, 48), (False, 0)):
        sched = make_sched(caching)
        run = Run()
        add_prompts(sched, [prompt(3, 60)], prefix="a_")
        run_until_done(sched, run)
        add_prompts(sched, [prompt(3, 60)], prefix="b_")
        run_until_done(sched, run)
        assert run.first_computed["b_0"] == expect


def test_abort_after_prefill_frees_everything(make_sched):
    """speculators 0.4's ending: after the last prefill, finish_requests(..., ABORTED)."""

    sched = make_sched(False, max_num_seqs=16, max_num_batched_tokens=512)
    total = free_blocks(sched)
    prompts = [prompt(i, n) for i, n in enumerate(LENGTHS)]
    index = add_prompts(sched, prompts)
    so = vc.schedule(sched)
    assert dict(so.num_scheduled_tokens) == {r: LENGTHS[i] for r, i in index.items()}
    sched.finish_requests(list(index), reference.request_status("FINISHED_ABORTED"))
    assert not sched.has_unfinished_requests()
    vc.schedule(sched)
    assert free_blocks(sched) == total
