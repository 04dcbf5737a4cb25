"""Safe output directories: one job per directory, and files that are whole or absent.

Locking: an exclusive ``flock`` on ``<dir>/.lock``.

:func:`lock_output_dir` is taken by every step that writes a directory (``eagle3 extract``,
:class:`~vllm_compat.eagle3.data.ShardWriter`, ``eagle3 train``, the speculators offline
generator). A second *process* asking for the same directory gets
:class:`OutputDirLockedError`, naming the directory and the owner's pid, host and job, which
the owner writes into the lock file.

The lock is the kernel's ``flock``: it goes away with the process however that process ends
(``SIGKILL`` included), so a lock file left behind by a dead job never blocks the next one;
its stale content is simply overwritten. A clean release deletes the file while still
holding the lock, and a job that locked a file which is no longer the one at ``<dir>/.lock``
retries, so two jobs never hold two different lock files. Within one process the lock is re-entrant (a step
that holds it may open a ``ShardWriter`` on the same directory); a forked child does not
inherit it. ``flock`` is reliable on local file systems; on NFS it depends on the client.

:func:`atomic_write_bytes` writes a file so that a crash at any point leaves the old file (or
none) or the complete new one under its name, never a partial one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .errors import VllmCompatError

__all__ = ["LOCK_FILE", "OutputDirLock", "OutputDirLockedError", "atomic_write_bytes",
           "lock_output_dir"]

LOCK_FILE = ".lock"
TMP_SUFFIX = ".tmp"
WRITE_CHUNK = 1 << 20  # bytes per os.write
# Start the disk's writeback every this many bytes of a file being written (0: never), so the
# disk writes while the rest is still copied into the page cache; otherwise nothing reaches
# the disk until the fsync (the kernel's background writeback waits for gigabytes of dirty
# pages) and the disk idles during every shard's copy. VLLM_COMPAT_WRITEBACK_KICK_MIB=0
# turns it off. Linux only (os.posix_fadvise DONTNEED starts writeback, does not wait).
WRITEBACK_KICK_BYTES = int(float(os.environ.get("VLLM_COMPAT_WRITEBACK_KICK_MIB", "32")) * (1 << 20))

_held: dict[str, list[int]] = {}  # realpath of the directory -> [fd, holders in this process]
_mutex = threading.Lock()


class OutputDirLockedError(VllmCompatError, RuntimeError):
    """The output directory is locked by another running job."""

    def __init__(self, directory: str | os.PathLike[str], owner: dict[str, Any]) -> None:
        self.directory = str(directory)
        self.owner = owner
        pid = owner.get("pid", "unknown")
        host = owner.get("host", "unknown host")
        job = owner.get("job") or "unknown job"
        super().__init__(
            f"{self.directory}: output directory is in use by another running job "
            f"(pid {pid} on {host}: {job}); wait for it to finish or use a different output directory"
        )


def _read_owner(path: str) -> dict[str, Any]:
    """What the holder wrote into the lock file (it writes just after locking: wait a little)."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                text = os.read(fd, 65536)
            finally:
                os.close(fd)
            owner = json.loads(text)
            if isinstance(owner, dict):
                return owner
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            return {}
        time.sleep(0.02)


def _lock_file(path: str, directory: Path) -> int:
    """An fd holding the flock of the file now at ``path``."""
    while True:
        # O_NOFOLLOW: a planted symlink must not make us write elsewhere
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputDirLockedError(directory, _read_owner(path)) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # the holder released and removed it meanwhile: lock the current file


class OutputDirLock:
    """``with OutputDirLock(dir, "eagle3 extract"): ...`` or :func:`lock_output_dir`."""

    def __init__(self, directory: str | os.PathLike[str], job: str | None = None) -> None:
        self.directory = Path(directory)
        self.job = job
        self._key: str | None = None

    @property
    def held(self) -> bool:
        return self._key is not None

    def acquire(self) -> OutputDirLock:
        if self._key is not None:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.directory)
        with _mutex:
            entry = _held.get(key)
            if entry is not None:
                entry[1] += 1
            else:
                path = os.path.join(key, LOCK_FILE)
                fd = _lock_file(path, self.directory)
                info = json.dumps({
                    "pid": os.getpid(), "host": socket.gethostname(),
                    "job": self.job or shlex.join(sys.argv), "argv": list(sys.argv),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, info, 0)
                _held[key] = [fd, 1]
        self._key = key
        return self

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None:
            return
        with _mutex:
            entry = _held.get(key)
            if entry is None:  # forgotten after a fork
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                try:
                    os.unlink(os.path.join(key, LOCK_FILE))  # still locked: see _lock_file
                except OSError:
                    pass
                finally:
                    os.close(entry[0])  # releases the flock

    def __enter__(self) -> OutputDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()


def lock_output_dir(directory: str | os.PathLike[str], job: str | None = None) -> OutputDirLock:
    """Lock ``directory`` (created if missing) for this process; raise
    :class:`OutputDirLockedError` if another process holds it. Release with ``.release()``
    (or use it as a context manager); it is also released when the object is collected and
    when the process ends."""
    return OutputDirLock(directory, job).acquire()


def _forget_inherited_locks() -> None:
    global _mutex
    _mutex = threading.Lock()  # another thread may have held it at the fork
    # A forked child shares the parent's open file description: closing our copy keeps the
    # parent's lock (flock is released only when every copy is closed, or by LOCK_UN, which
    # we never call), and the child is not an owner.
    for fd, _ in _held.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_inherited_locks)


def _fsync_dir(directory: str | os.PathLike[str]) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _coalesced(chunks: Any) -> Any:
    """The buffers as byte views, small neighbours joined up to ``WRITE_CHUNK`` (a shard holds
    three small tensors per sample: one system call each would be wasted)."""
    small = bytearray()
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        if len(view) >= WRITE_CHUNK:
            if small:
                yield memoryview(bytes(small))
                small.clear()
            yield view
            continue
        small += view
        if len(small) >= WRITE_CHUNK:
            yield memoryview(bytes(small))
            small.clear()
    if small:
        yield memoryview(bytes(small))


def atomic_write_bytes(path: str | os.PathLike[str], data: Any,
                       before_rename: Callable[[], None] | None = None) -> None:
    """Make ``path`` hold ``data`` (bytes, or a sequence of byte buffers written one after the
    other, so large tensors need not be joined into one copy first): written to
    ``<path>.tmp``, fsynced, renamed over ``path``, then the directory fsynced. A crash leaves
    either the old file (or none) or the new one, never a partial file under ``path`` (a
    partial ``<path>.tmp`` may remain). ``before_rename`` runs once the temporary file is
    durable and before it is renamed (a shard's manifest intent, see ``ShardWriter``)."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    kick = WRITEBACK_KICK_BYTES if hasattr(os, "posix_fadvise") else 0
    written = kicked = 0
    try:
        for view in _coalesced(chunks):
            while view:
                n = os.write(fd, view[:WRITE_CHUNK])
                view = view[n:]
                written += n
                if kick and written - kicked >= kick:
                    os.posix_fadvise(fd, kicked, written - kicked, os.POSIX_FADV_DONTNEED)
                    kicked = written
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    if before_rename is not None:
        try:
            before_rename()
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    os.replace(tmp, path)
    _fsync_dir(path.parent)
