"""Drive a real vLLM Scheduler to completion with fabricated model outputs.

The fabricated part is only the model: every request whose prompt (and outputs so far)
is fully computed after ``schedule()`` gets one sampled token; a request still mid-prefill
gets ``[]``, exactly as vLLM's runner discards partial-prefill samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import vllm_compat as vc

from . import reference
from .oracle import oracle_fn

FAKE_TOKEN = 7  # any id that is not eos (2) in the tiny config
BLOCK = 16


def tokens(n: int, start: int = 100) -> list[int]:
    return [10 + (start + i) % 1000 for i in range(n)]


def sp(max_tokens: int):
    """The user's own SamplingParams (test-side)."""
    return reference.sampling_params(max_tokens=max_tokens, temperature=0.0)


class SecondPhaseByAlias:
    """A stand-in worker's second phase under the name the user declared for vLLM's
    (``VLLM_COMPAT_ALIASES=sample_tokens=<new>``): a build that renamed it calls the worker by
    the new name, as its real workers would have it."""

    def __getattr__(self, name: str):
        from vllm_compat import aliases

        if name != "sample_tokens" and aliases.current().get("sample_tokens") == name:
            return self.sample_tokens
        raise AttributeError(name)


def real_executor(worker):
    """vLLM's UniProcExecutor around ``worker``; __init__ (which loads a model) skipped."""
    ex = object.__new__(reference.uniproc_executor_class())
    ex.driver_worker = worker
    return ex


def make_async(output):
    class Pending(reference.async_model_runner_output_class()):  # what async scheduling hands back
        def get_output(self):
            return output

        def get_kv_connector_output(self):  # abstract from 0.33 (salvages KV output on failure)
            return getattr(output, "kv_connector_output", None)

    return Pending()


@dataclass
class Run:
    steps: int = 0
    # req_id -> num_computed_tokens when the request was first scheduled (prefix-cache hit)
    first_computed: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    # req_id -> tokens scheduled per step (chunked prefill shows up as several entries)
    chunks: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    max_blocks_in_use: int = 0


@oracle_fn("the scheduler's block pool (driver.free_blocks)")
def free_blocks(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def step(scheduler, run: Run) -> None:
    so = vc.schedule(scheduler)
    for new in so.scheduled_new_reqs:
        run.first_computed.setdefault(new.req_id, new.num_computed_tokens)
    total = _total_blocks(scheduler)
    run.max_blocks_in_use = max(run.max_blocks_in_use, total - free_blocks(scheduler))
    req_ids = list(so.num_scheduled_tokens)
    for rid, n in so.num_scheduled_tokens.items():
        run.chunks.setdefault(rid, []).append(n)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([FAKE_TOKEN] if done else [])
    out = vc.make_model_runner_output(req_ids, sampled)
    engine_outputs = vc.update_from_output(scheduler, so, out)
    for eco in engine_outputs.values():
        for o in eco.outputs:
            run.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                run.finished.add(o.request_id)
    run.steps += 1


@oracle_fn("the scheduler's block pool (driver.step)")
def _total_blocks(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # minus the null block


def run_until_done(scheduler, run: Run | None = None, max_steps: int = 200) -> Run:
    run = run or Run()
    while scheduler.has_unfinished_requests():
        step(scheduler, run)
        if run.steps > max_steps:
            raise AssertionError(f"scheduler did not finish within {max_steps} steps")
    # One more schedule() lets the scheduler drop finished requests' bookkeeping.
    vc.schedule(scheduler)
    return run
