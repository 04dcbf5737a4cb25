"""``collective_rpc`` with one reply shape on every executor and release."""

from __future__ import annotations

from typing import Any, Callable

from .detect import adapter


def collective_rpc(target: Any, method: str | Callable[..., Any], *, args: tuple = (),
                   kwargs: dict[str, Any] | None = None, timeout: float | None = None,
                   rank: int | None = None) -> Any:
    """Call ``method`` on every worker of ``target`` (LLM, engine, engine core or executor).

    Returns a list with one plain value per rank, or, with ``rank=``, that rank's bare
    value. Futures and ``AsyncModelRunnerOutput`` replies are resolved, whatever the
    executor (UniProc ``single_value``, MP ``unique_reply_rank``) or release did.
    """
    return adapter().collective_rpc(target, method, args=args, kwargs=kwargs, timeout=timeout,
                                    rank=rank)


def runner_flavour(obj: Any) -> str:
    """'v1' or 'v2' for a worker, runner or executor; '' when it cannot be told."""
    return adapter().runner_flavour(obj)
