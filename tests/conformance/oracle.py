"""The conformance tests' own raw-vLLM reference code (the "oracle"), kept apart from the API.

A test compares vllm_compat with what vLLM itself does, computed by calling vLLM directly
(``engine_path``, ``hash_probe``, raw Requests). On a build whose internals drifted, that raw
code can break while vllm_compat copes (it found a moved symbol, say). Such a failure is the
test's, not the library's: wrapped in :func:`oracle`, it is reported as an expected failure,
"oracle needs updating for this build", instead of failing like a library bug.

Only when the build did drift: on an installed vLLM with no drift at all (every tested
release), the oracle must work, and its failure fails the test. A ``VllmCompatError`` raised
inside is vllm_compat's and always fails.

In a child process (a fresh-process probe, run with :func:`child_main`) there is no test to
mark: the failure is printed as ``RESULT {"oracle_error": ...}`` and the parent test, through
:func:`check_child`, reports it the same way.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any, Callable, Iterator, NoReturn, TypeVar

import pytest

from vllm_compat.errors import VllmCompatError

ORACLE_OUTDATED = "oracle needs updating for this build"

F = TypeVar("F", bound=Callable[..., Any])
_drift_reason: list[str | None] = []


def build_drift() -> str | None:
    """Why this build differs from what the oracle was written for, or None (cached)."""
    if not _drift_reason:
        import vllm_compat

        info = vllm_compat.detect()
        report = vllm_compat.check_drift()
        why = []
        if info.newer_than_tested:
            why.append(f"vLLM {info.version} is newer than the newest tested release")
        if report.items:
            why.append(report.summary())
        _drift_reason.append("; ".join(why) or None)
    return _drift_reason[0]


class OracleFailure(Exception):
    """The oracle failed in a child process; the parent test decides (see :func:`check_child`)."""


_in_child: list[bool] = [False]


def oracle_failed(what: str, exc: BaseException) -> NoReturn:
    if isinstance(exc, (VllmCompatError, OracleFailure)):
        raise exc
    message = f"{what} raised {type(exc).__name__}: {exc}"
    if _in_child[0]:
        raise OracleFailure(message) from exc
    outdated(message, exc)


def outdated(message: str, exc: BaseException | None = None) -> NoReturn:
    """Report an oracle failure: expected on a drifted build, a test failure otherwise."""
    why = build_drift()
    if why is None:
        if exc is not None:
            raise exc
        raise AssertionError(f"the oracle failed on a build without drift: {message}")
    pytest.xfail(f"{ORACLE_OUTDATED}: {message} ({why})")


def child_main(main: Callable[[], None]) -> None:
    """Run a fresh-process probe: an oracle failure inside becomes ``RESULT {"oracle_error"}``."""
    _in_child[0] = True
    try:
        main()
    except OracleFailure as exc:
        print("RESULT " + json.dumps({"oracle_error": str(exc)}))


def check_child(result: dict[str, Any]) -> dict[str, Any]:
    """A child's result, once its oracle is known to have worked (else reported as outdated)."""
    if "oracle_error" in result:
        outdated(f"in a child process: {result['oracle_error']}")
    return result


@contextlib.contextmanager
def oracle(what: str) -> Iterator[None]:
    """Run raw-vLLM reference code; on a drifted build its failure is the oracle's."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - sorted out by oracle_failed
        oracle_failed(what, exc)


def oracle_fn(what: str) -> Callable[[F], F]:
    """:func:`oracle` around every call of a reference helper."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with oracle(what):
                return fn(*args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap
