"""StepPipeline: two model steps in flight against the real Scheduler and UniProcExecutor.

What the extractor does at TP=1: step N+1 is scheduled and launched
before step N's sampled tokens are waited for. The scheduler (``Scheduler``, or
``AsyncScheduler`` as with vLLM's ``async_scheduling``) and the executor are vLLM's own; the
worker is a stand-in with the real contract (``execute_model`` returns None and keeps state,
``sample_tokens`` must follow before the next ``execute_model``; the V1 runner raises
"State error" otherwise) that also keeps the runner's per-request state: it adds requests
from ``scheduled_new_reqs`` and frees them from ``finished_req_ids``.

Prefill-only requests (``max_tokens=1``), chunked by a small token budget, as in extraction.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import vllm_compat as vc

from .driver import (BLOCK, FAKE_TOKEN, SecondPhaseByAlias, free_blocks, make_async,
                     real_executor, sp, tokens)

BUDGET = 64  # tokens per step: the prompts below span 1 to 4 steps
LENGTHS = (5, 17, 64, 100, 33, 150, 1, 48, 77, 20, 129, 64)


class RunnerStandIn(SecondPhaseByAlias):
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.pending = None
        self.live: set[str] = set()      # the runner's request states
        self.calls: list[str] = []

    def execute_model(self, so):
        self.calls.append("execute_model")
        if self.pending is not None:  # the V1 runner's guard, same message
            raise RuntimeError("State error: sample_tokens() must be called after "
                               "execute_model() returns None.")
        self.live -= set(so.finished_req_ids)
        self.live |= {r.req_id for r in so.scheduled_new_reqs}
        if not so.total_num_scheduled_tokens:
            return vc.make_model_runner_output([], [])
        # which requests finish their prompt in this step: decided now, as the forward is
        ids, sampled = list(so.num_scheduled_tokens), []
        for rid in ids:
            req = self.scheduler.requests[rid]
            sampled.append([FAKE_TOKEN] if req.num_computed_tokens >= req.num_prompt_tokens else [])
        self.pending = vc.make_model_runner_output(ids, sampled)
        return None

    def sample_tokens(self, grammar_output):
        self.calls.append("sample_tokens")
        out, self.pending = self.pending, None
        return make_async(out)  # what the V2 runner always returns

    def rank(self):
        return 0

    def shutdown(self):
        pass


def _setup(model_dir, async_scheduling: bool):
    cfg = vc.make_vllm_config(model_dir, block_size=BLOCK, enable_prefix_caching=False,
                              num_gpu_blocks=128, max_num_batched_tokens=BUDGET,
                              enable_chunked_prefill=True, async_scheduling=async_scheduling)
    sched = vc.make_scheduler(cfg)
    # 0.26 / 0.33: make_scheduler could not build an AsyncScheduler (its __init__ forwards
    # *args, **kwargs, so the required block_size was not seen and not passed)
    assert (type(sched).__name__ == "AsyncScheduler") == async_scheduling
    worker = RunnerStandIn(sched)
    ex = real_executor(worker)
    # 0.11.2-0.25: a non-blocking call hands AsyncModelRunnerOutputs to this thread, which
    # the executor's __init__ (skipped here) makes under async scheduling
    ex.async_output_thread = ThreadPoolExecutor(1)
    for i, n in enumerate(LENGTHS):
        sched.add_request(vc.make_request(f"r{i}", tokens(n, start=50 * i), sampling_params=sp(1),
                                          block_hasher=vc.block_hasher_for(sched)))
    return sched, worker, ex


def _drive(pipe, sched, worker) -> dict:
    """Run every request to the end; what each step's ``between`` saw, per request."""
    chunks: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    most = 0
    for _ in range(200):
        if not (pipe.in_flight or sched.has_unfinished_requests()):
            break
        pipe.fill()
        most = max(most, pipe.in_flight)
        fs = pipe.finish()
        for rid, n in (fs.value or {}).items():
            chunks.setdefault(rid, []).append(n)
        for eco in fs.engine_outputs.values():
            for o in eco.outputs:
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    else:
        raise AssertionError("did not finish in 200 steps")
    # one more (empty) step hands the last finished ids to the worker, as the next
    # extraction's first step would
    pipe.launch()
    pipe.drain()
    return {"chunks": chunks, "outputs": outputs, "steps": pipe.num_steps, "most_in_flight": most}


def _run(model_dir, depth: int, async_scheduling: bool, pipeline_cls=vc.StepPipeline):
    sched, worker, ex = _setup(model_dir, async_scheduling)
    total = free_blocks(sched)
    # what the extractor's collect sees: the tokens each request has in this step
    pipe = pipeline_cls(sched, ex, depth=depth,
                        between=lambda so: dict(so.num_scheduled_tokens))
    r = _drive(pipe, sched, worker)
    r.update(worker=worker, free_delta=total - free_blocks(sched), sched=sched)
    return r


@pytest.fixture(autouse=True)
def _two_phase(info):
    if not info.probes["two_phase_step"]:
        pytest.skip("0.10.2: execute_model is the whole step, nothing can be in flight")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_two_steps_in_flight_schedule_every_prompt_token_once(model_dir, async_scheduling):
    lock = _run(model_dir, 1, async_scheduling)
    pipe = _run(model_dir, 2, async_scheduling)
    expect = {f"r{i}": n for i, n in enumerate(LENGTHS)}
    for r in (lock, pipe):
        assert {k: sum(v) for k, v in r["chunks"].items()} == expect  # no token twice or lost
        assert r["outputs"] == {k: [FAKE_TOKEN] for k in expect}    # each finished, one token
        assert r["free_delta"] == 0                                  # every KV block back
        assert r["worker"].live == set()                             # the runner freed them all
        assert not r["sched"].has_unfinished_requests()
    # the same chunks in the same steps: pipelining changes when, not what, is computed
    assert pipe["chunks"] == lock["chunks"]
    assert pipe["steps"] == lock["steps"]
    assert (lock["most_in_flight"], pipe["most_in_flight"]) == (1, 2)  # really pipelined


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_has_unscheduled_tokens_agrees_with_schedule(model_dir, async_scheduling):
    """True exactly while ``schedule()`` still finds prompt tokens (no update in between, as
    when steps are in flight): the waiting queues differ by release, the answer must not, and
    waiting requests without a free slot do not count."""
    sched, _, _ = _setup(model_dir, async_scheduling)
    ad = vc.adapter()
    for _ in range(50):
        if not ad.has_unscheduled_tokens(sched):
            break
        assert vc.schedule(sched).total_num_scheduled_tokens > 0
    else:
        raise AssertionError("still unscheduled tokens after 50 steps")
    assert vc.schedule(sched).total_num_scheduled_tokens == 0
    # every running prompt is fully scheduled; the rest wait for a free slot (max_num_seqs),
    # which only an update frees: a predicate that counts them as schedulable fails above
    assert all(r.num_computed_tokens >= r.num_tokens for r in sched.running)
    assert len(sched.running) == sched.max_num_running_reqs < len(LENGTHS)


class _SkipsEmptySteps(vc.StepPipeline):
    """A broken pipeline: does not execute a step that scheduled nothing."""

    def launch(self):
        so = vc.schedule(self.scheduler)
        if so.total_num_scheduled_tokens:  # only steps with tokens reach the worker
            step = vc.adapter().launch_model_step(
                self.executor, so, lambda s: vc.grammar_output(self.scheduler, s),
                self.between)
            self.num_steps += 1
            self._queue.append(step)
        return so


def test_a_pipeline_that_skips_empty_steps_leaks_runner_state(model_dir):
    """Empty steps carry finished-request ids: dropping them leaves the runner's request
    state behind (the V2 runner's per-request slots run out on a long extraction)."""
    r = _run(model_dir, 2, True, pipeline_cls=_SkipsEmptySteps)
    assert r["worker"].live  # what the real StepPipeline's test above rules out


def test_launching_before_sampling_hits_the_runner_guard(model_dir):
    """Why launch() calls sample_tokens before the next execute_model: the other order is
    the "State error" of the V1 runner (the V2 runner corrupts its state silently)."""
    sched, worker, ex = _setup(model_dir, True)
    ex.execute_model(vc.schedule(sched))
    with pytest.raises(RuntimeError, match="State error"):
        ex.execute_model(vc.schedule(sched))
