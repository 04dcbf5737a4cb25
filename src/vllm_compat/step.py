"""One model step that always ends in the final ``ModelRunnerOutput``."""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, Callable

from .detect import adapter

if TYPE_CHECKING:  # vLLM's classes, for the type checker only
    from .adapters.vllm_types import ModelRunnerOutput, Scheduler, SchedulerOutput



def run_model_step(worker_or_runner: Any, scheduler_output: SchedulerOutput,
                   grammar_output: Any = None, *,
                   scheduler: Scheduler | None = None) -> ModelRunnerOutput:
    """Run a model step on a Worker, model runner (V1 or V2) or Executor.

    0.10: ``execute_model`` is the whole step. 0.11+: ``execute_model`` returns None and
    ``sample_tokens(grammar_output)`` must follow (the V1 runner raises "State error" on
    the next step otherwise; the V2 runner silently corrupts its state). Futures and
    ``AsyncModelRunnerOutput`` are resolved. Pass ``scheduler`` to have the grammar
    bitmask computed the way ``EngineCore`` does.
    """
    ad = adapter()
    if grammar_output is None and scheduler is not None:
        grammar_output = ad.grammar_output(scheduler, scheduler_output)
    return ad.run_model_step(worker_or_runner, scheduler_output, grammar_output)


def resolve_output(output: Any) -> Any:
    """A concrete value from a Future, an ``AsyncModelRunnerOutput`` or a plain value."""
    return adapter().resolve_output(output)


@dataclasses.dataclass
class FinishedStep:
    """A step whose output is in and whose scheduler update is done."""
    scheduler_output: Any
    model_output: Any      # the final ModelRunnerOutput
    engine_outputs: Any    # what update_from_output returned
    value: Any             # what StepPipeline's ``between`` returned (None for an empty step)


class StepPipeline:
    """Model steps kept in flight, the way ``EngineCore.step_with_batch_queue`` keeps them.

    ``launch()`` schedules one step, runs ``execute_model`` (which only launches the forward
    on 0.11+), calls ``between(scheduler_output)`` while the runner still holds the step's
    state (the aux hidden states, say), then ``sample_tokens`` without waiting for its
    output. ``finish()`` waits for the oldest step's output and updates the scheduler.
    With ``depth=2`` step N+1 is scheduled and launched before step N's sampled tokens are
    waited for, so the accelerator never idles between two forwards; vLLM does the same with
    ``async_scheduling`` (its scheduler then schedules N+1 before it has seen N's output, as
    under pipeline parallelism). ``depth=1`` is the plain lockstep loop. On 0.10.2
    ``execute_model`` is the whole step, so nothing overlaps there.

    Empty steps (nothing scheduled) are executed too: their scheduler output carries the
    ids of finished requests, which the workers must see to free their state.
    """

    def __init__(self, scheduler: Scheduler, executor: Any, *, depth: int = 2,
                 between: Callable[[Any], Any] | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        # every step method resolved now, before the first schedule(): a drifted executor is
        # refused here, never between a scheduled step and its output
        adapter().check_step_target(executor)
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self.between = between
        self._queue: collections.deque[Any] = collections.deque()
        self.num_steps = 0            # steps that scheduled tokens
        self.max_step_tokens = 0
        # wall seconds per phase, summed: schedule, execute_model (+ between + the
        # sample_tokens call), waiting for outputs, update_from_output
        self.phase_s = dict.fromkeys(("schedule", "launch", "wait", "update"), 0.0)

    @property
    def in_flight(self) -> int:
        return len(self._queue)

    def has_unscheduled_tokens(self) -> bool:
        return bool(adapter().has_unscheduled_tokens(self.scheduler))

    def launch(self) -> Any:
        """Schedule and launch one step; returns its ``SchedulerOutput``."""
        if len(self._queue) >= self.depth:
            raise RuntimeError(f"{len(self._queue)} steps in flight already (depth {self.depth})")
        ad = adapter()
        t0 = time.perf_counter()
        so = ad.schedule(self.scheduler)
        t1 = time.perf_counter()
        n = int(so.total_num_scheduled_tokens)
        if n:
            self.num_steps += 1
            self.max_step_tokens = max(self.max_step_tokens, n)
        step = ad.launch_model_step(
            self.executor, so, functools.partial(ad.grammar_output, self.scheduler),
            self.between if n else None)
        self._queue.append(step)
        t2 = time.perf_counter()
        self.phase_s["schedule"] += t1 - t0
        self.phase_s["launch"] += t2 - t1
        return so

    def finish(self) -> FinishedStep:
        """Wait for the oldest step in flight, update the scheduler with its output."""
        if not self._queue:
            raise RuntimeError("no step in flight")
        step = self._queue.popleft()
        t0 = time.perf_counter()
        out = step.result()
        t1 = time.perf_counter()
        eo = adapter().update_from_output(self.scheduler, step.scheduler_output, out)
        self.phase_s["wait"] += t1 - t0
        self.phase_s["update"] += time.perf_counter() - t1
        return FinishedStep(step.scheduler_output, out, eo, step.value)

    def fill(self) -> None:
        """Launch steps while fewer than ``depth`` are in flight and prompt tokens are left
        to schedule (at least one when nothing is in flight and requests are unfinished)."""
        if not self._queue and self.scheduler.has_unfinished_requests():
            self.launch()
        while len(self._queue) < self.depth and self.has_unscheduled_tokens():
            self.launch()

    def drain(self) -> list[FinishedStep]:
        """Finish every step in flight (oldest first)."""
        return [self.finish() for _ in range(len(self._queue))]
