"""One model step that always ends in the final ``ModelRunnerOutput``."""

from __future__ import annotations

from typing import Any

from .detect import adapter


def run_model_step(worker_or_runner: Any, scheduler_output: Any, grammar_output: Any = None, *,
                   scheduler: Any = None) -> Any:
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
