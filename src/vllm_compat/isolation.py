"""Run a function in a fresh process and get its result back: one vLLM engine per process.

An engine torn down inside a process leaves state behind that the next engine in the same
process trips over: vLLM's process-wide CUDA-graph pool handle, compiled code that dynamo
keeps, the caching allocator's pools, environment variables, and memory still being
released while the next engine measures its own. A process that exits gives all of it back.
:func:`run_isolated` runs ``fn(*args, **kwargs)`` in a process started with
``multiprocessing``'s ``spawn`` method and returns its (pickled) result, or raises
:class:`IsolatedCallError` carrying the child's exception type, message and traceback text::

    from vllm_compat.isolation import run_isolated

    stats = run_isolated(measure_one_config, args=(config,))

``fn`` must be importable by name in a new interpreter (a module-level function; not a
lambda or a closure), and its arguments and result picklable. The child's stdout and
stderr are this process's. A child that dies without a result (a segfault, a CUDA abort,
the kernel's OOM killer, ``os._exit``) raises :class:`IsolatedProcessDiedError`, naming the
signal or the exit code.

No process is left behind: the child leads its own process group, so whatever it started
(vLLM's engine-core and worker processes, compile workers) is killed with it once it has
ended, before :func:`run_isolated` returns; a thread in the child kills that group when this
process goes away (a lost pipe), so a killed caller does not leave a GPU held either. The
child's own process group also keeps a terminal's Ctrl-C away from it: the caller's
``KeyboardInterrupt`` ends the call and takes the child down.

This module imports neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, Sequence

from .errors import VllmCompatError

__all__ = ["IsolatedCallError", "IsolatedProcessDiedError", "IsolatedTimeoutError",
           "run_isolated"]

# After the result is in, how long the child may take to exit on its own (vLLM's shutdown,
# atexit handlers) before its process group is killed.
EXIT_GRACE_S = 120.0
# How long to wait for the killed group's processes to be gone (GPU memory is released
# when they exit).
REAP_TIMEOUT_S = 30.0


class IsolatedCallError(VllmCompatError, RuntimeError):
    """``fn`` raised in its process. ``exc_type``: the exception's qualified name (e.g.
    ``"torch.OutOfMemoryError"``); ``message``: its text; ``traceback``: the child's traceback
    as text; ``name``: what the call was (``run_isolated(name=)``)."""

    def __init__(self, name: str, exc_type: str, message: str, traceback_text: str = "",
                 *, exitcode: int | None = None, pid: int | None = None) -> None:
        self.name, self.exc_type, self.message = name, exc_type, message
        self.traceback, self.exitcode, self.pid = traceback_text, exitcode, pid
        super().__init__(f"{name}: {exc_type}: {message}")

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.name, self.exc_type, self.message, self.traceback,
                           self.exitcode, self.pid))


class IsolatedProcessDiedError(IsolatedCallError):
    """The process ended without a result: killed by a signal (``exc_type`` is its name,
    ``SIGSEGV``, ``SIGABRT``, ``SIGKILL``...) or exited (``exc_type`` ``"exit code N"``)."""


class IsolatedTimeoutError(IsolatedProcessDiedError):
    """No result within ``timeout`` seconds; the process and its group were killed."""


def _rebuild(cls: type, *fields: Any) -> IsolatedCallError:
    name, exc_type, message, tb, exitcode, pid = fields
    return cls(name, exc_type, message, tb, exitcode=exitcode, pid=pid)


def run_isolated(fn: Callable[..., Any], args: Sequence[Any] = (),
                 kwargs: Mapping[str, Any] | None = None, *, name: str | None = None,
                 timeout: float | None = None) -> Any:
    """``fn(*args, **kwargs)`` in a new spawned process; its return value, or
    :class:`IsolatedCallError` (``fn`` raised), :class:`IsolatedProcessDiedError` (the process
    died), :class:`IsolatedTimeoutError` (``timeout`` seconds passed). When this returns or
    raises, the child and every process it started have exited."""
    label: str = name or getattr(fn, "__qualname__", None) or repr(fn)
    ctx = multiprocessing.get_context("spawn")
    task_r, task_w = ctx.Pipe(duplex=False)
    result_r, result_w = ctx.Pipe(duplex=False)
    life_r, life_w = ctx.Pipe(duplex=False)
    # daemon=False: a daemonic process may not start processes, and vLLM starts its engine
    # core and workers as processes
    proc = ctx.Process(target=_child_main, args=(task_r, result_w, life_r),
                       name=f"vllm-compat isolated: {label}"[:100], daemon=False)
    proc.start()
    for end in (task_r, result_w, life_r):  # the child's: its death then shows as EOF here
        end.close()
    assert proc.pid is not None  # started
    exited = _ExitWatch(proc.pid)
    try:
        try:
            # pickled here: an unpicklable fn or argument fails in the caller
            task_w.send((fn, tuple(args), dict(kwargs or {})))
        except (BrokenPipeError, ConnectionResetError):  # the child is already gone
            pass
        task_w.close()
        msg = _receive(proc, exited, result_r, label, timeout)
        exited.wait(EXIT_GRACE_S)
    finally:
        _end_group(proc, exited)
        for end in (task_w, result_r, life_w):
            end.close()
    return _unpack(msg, proc, label)


# --------------------------------------------------------------------------- caller side


class _ExitWatch:
    """Whether the child has exited, without reaping it (so its pid, the id of its process
    group, stays taken until the group is killed). Neither multiprocessing's sentinel nor
    the result pipe can tell: a process the child forked (vLLM forks its engine core unless
    CUDA is initialised) inherits their write ends and keeps them open."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:  # Linux 5.3+: readable once the process has exited
            self.fd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.fd = None

    def waitables(self) -> list[Any]:
        return [] if self.fd is None else [self.fd]

    def done(self) -> bool:
        if self.fd is not None:
            return bool(wait([self.fd], timeout=0))
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # already reaped
            return True

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.fd is not None:
                wait([self.fd], timeout=left)
            else:
                time.sleep(min(0.05, left))
        return True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _receive(proc: Any, exited: _ExitWatch, conn: Connection, name: str,
             timeout: float | None) -> Any:
    """The child's message, or None when it ended without one."""
    deadline = None if timeout is None else time.monotonic() + timeout
    poll_s = None if exited.fd is not None else 0.05
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise IsolatedTimeoutError(name, "timeout", f"no result within {timeout:g} s; the "
                                       f"process (pid {proc.pid}) was killed", pid=proc.pid)
        step = poll_s if left is None else left if poll_s is None else min(poll_s, left)
        wait([conn, *exited.waitables()], timeout=step)
        # the result first: a child that sent it and exited shows both at once
        if conn.poll():
            try:
                return conn.recv()
            except EOFError:  # closed without a message: it is dying
                return None
        if exited.done():
            return None


def _end_group(proc: Any, exited: _ExitWatch) -> None:
    """Kill the child if it still runs (an error or an interrupt in the caller), then
    whatever is left of its process group; reap it and wait until the group is gone."""
    try:
        if not exited.done():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.join()
    finally:
        exited.close()
    deadline = time.monotonic() + REAP_TIMEOUT_S
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies do not count: their
    memory, GPU memory included, is released). Reads /proc where there is one."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _unpack(msg: Any, proc: Any, name: str) -> Any:
    if msg is None:
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                what = signal.Signals(-code).name
            except ValueError:
                what = f"signal {-code}"
            text = f"the process (pid {proc.pid}) was killed by {what} before it returned"
        else:
            what = f"exit code {code}"
            text = f"the process (pid {proc.pid}) exited with code {code} before it returned"
        raise IsolatedProcessDiedError(name, what, text, exitcode=code, pid=proc.pid)
    if msg[0] == "ok":
        return msg[1]
    _, exc_type, message, tb = msg
    raise IsolatedCallError(name, exc_type, message, tb, exitcode=proc.exitcode, pid=proc.pid)


# --------------------------------------------------------------------------- child side


def _child_main(task_r: Connection, result_w: Connection, life_r: Connection) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # lead a group: everything started from here is killed with it
    threading.Thread(target=_die_with_parent, args=(life_r, os.getpgid(0) == os.getpid()),
                     daemon=True, name="vllm-compat parent watch").start()
    try:
        fn, args, kwargs = task_r.recv()  # unpickled here: an import error is reported too
        task_r.close()
        # a plain pickle: tensors go by value, not as shared memory this exiting process
        # would take along (multiprocessing's own pickler shares torch storages)
        out = pickle.dumps(("ok", fn(*args, **kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        sys.stderr.flush()
        out = pickle.dumps(("error", _qualname(type(exc)), str(exc), tb))
    result_w.send_bytes(out)
    result_w.close()


def _die_with_parent(life_r: Connection, leader: bool) -> None:
    """The caller holds the other end and never writes: EOF means it is gone."""
    with contextlib.suppress(EOFError, OSError):
        life_r.recv_bytes()
    if leader:  # never the caller's group, should setpgid have failed
        with contextlib.suppress(OSError):
            os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _qualname(cls: type) -> str:
    mod = cls.__module__
    return cls.__qualname__ if mod == "builtins" else f"{mod}.{cls.__qualname__}"
