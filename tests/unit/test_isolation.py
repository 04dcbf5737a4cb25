"""``vllm_compat.isolation.run_isolated``: a function in a spawned process, its result or its
error back, and no process left behind however the call ends."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _isolation_helpers as H
from vllm_compat.isolation import (
    IsolatedCallError,
    IsolatedProcessDiedError,
    IsolatedTimeoutError,
    run_isolated,
)


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no memory, GPU memory included)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


def test_returns_the_result_of_a_call_in_another_process():
    pid, args, kwargs = run_isolated(H.pid_and_args, args=(1, [2, 3]), kwargs={"k": {"v": None}})
    assert pid != os.getpid() and not running(pid)
    assert args == (1, [2, 3]) and kwargs == {"k": {"v": None}}


def test_a_large_result_comes_back_whole():
    # more than a pipe holds: the caller must read while the child writes
    assert run_isolated(H.big_result, args=(8 << 20,)) == H.big_result(8 << 20)


def test_an_exception_comes_back_with_its_type_message_and_traceback():
    with pytest.raises(IsolatedCallError) as info:
        run_isolated(H.raise_value_error, args=("no such draft",), name="cell eagle3-k5")
    e = info.value
    assert type(e) is IsolatedCallError
    assert (e.exc_type, e.message, e.name) == ("ValueError", "no such draft", "cell eagle3-k5")
    assert str(e) == "cell eagle3-k5: ValueError: no such draft"
    assert 'raise ValueError(text)' in e.traceback and e.traceback.rstrip().endswith(
        "ValueError: no such draft")
    assert e.exitcode == 0 and not running(e.pid)
    with pytest.raises(IsolatedCallError) as info:
        run_isolated(H.raise_refused, args=("x",))
    assert info.value.exc_type == "_isolation_helpers.Refused"
    # the error survives pickling (it may travel on, e.g. out of a nested isolated call)
    again = pickle.loads(pickle.dumps(e))
    assert (type(again), again.exc_type, again.traceback) == (IsolatedCallError, e.exc_type, e.traceback)


@pytest.mark.parametrize("signum", [signal.SIGSEGV, signal.SIGABRT, signal.SIGKILL])
def test_a_child_killed_by_a_signal_is_an_error_naming_it(signum):
    with pytest.raises(IsolatedProcessDiedError) as info:
        run_isolated(H.kill_self, args=(int(signum),), name="crash")
    e = info.value
    assert e.exc_type == signum.name and e.exitcode == -int(signum)
    assert f"killed by {signum.name} before it returned" in e.message


def test_a_child_that_exits_without_a_result_is_an_error():
    with pytest.raises(IsolatedProcessDiedError, match="exited with code 3") as info:
        run_isolated(H.exit_with, args=(3,))
    assert info.value.exc_type == "exit code 3"


def test_what_cannot_be_pickled_fails_in_the_caller():
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        run_isolated(lambda: 1)


@pytest.mark.parametrize("then", ["return", "raise", "kill"])
def test_no_process_the_child_started_outlives_the_call(tmp_path, then):
    """vLLM's engine core and workers are processes the child starts: whether the child
    returns, raises or dies, they are gone when run_isolated returns."""
    pid_file = tmp_path / "grandchild"
    try:
        run_isolated(H.start_sleeper, args=(str(pid_file), then))
    except IsolatedCallError:
        assert then != "return"
    grandchild = int(pid_file.read_text())
    assert not running(grandchild)


def test_a_timeout_kills_the_child_and_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild"
    t0 = time.monotonic()
    with pytest.raises(IsolatedTimeoutError, match="no result within 3 s"):
        run_isolated(H.start_sleeper, args=(str(pid_file), "hang"), timeout=3)
    assert time.monotonic() - t0 < 30
    assert not running(int(pid_file.read_text()))


def test_a_killed_caller_takes_its_child_and_grandchild_along(tmp_path):
    """SIGKILL of the caller (a job's time limit): the child sees its lifeline close and
    kills its process group."""
    pid_file = tmp_path / "grandchild"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    caller = subprocess.Popen([sys.executable, "-c", "import _isolation_helpers as H; "
                               f"H.caller_of_a_hanging_call({str(pid_file)!r})"], env=env)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        assert running(grandchild)
        caller.kill()
        caller.wait()
        assert wait_gone(grandchild), "the grandchild outlived its killed caller"
    finally:
        caller.kill()
        if pid_file.exists():
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
