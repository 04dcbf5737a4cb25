"""An HTTP server in a child process, for tests and benchmarks: ``serve-hidden-states`` (or
any command that answers ``GET /health``), on a free local port, stopped on exit.

::

    with ServerProcess.hidden_states(model_dir, "--backend", "transformers") as srv:
        srv.url              # http://127.0.0.1:<port>
        srv.openai_base      # http://127.0.0.1:<port>/v1
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any, Sequence

__all__ = ["ServerProcess", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``argv`` (with ``{port}`` replaced by a free port) run until :meth:`stop`; waits for
    ``/health`` to answer 200 (at most ``start_timeout`` seconds; the log is in the error)."""

    def __init__(self, argv: Sequence[str], *, log_path: str | os.PathLike[str],
                 start_timeout: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.url = f"http://127.0.0.1:{self.port}"
        self.openai_base = self.url + "/v1"
        self.log_path = Path(log_path)
        self.start_timeout = start_timeout
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @classmethod
    def hidden_states(cls, model: str, *args: str, log_path: str | os.PathLike[str],
                      python: str | None = None, **kw: Any) -> ServerProcess:
        """``vllm-compat serve-hidden-states MODEL *args`` on 127.0.0.1."""
        return cls([python or sys.executable, "-m", "vllm_compat.serve.cli", model, *args,
                    "--host", "127.0.0.1", "--port", "{port}"], log_path=log_path, **kw)

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.start_timeout:.0f} s:\n{self.log()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log(self, tail: int = 8000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGINT (uvicorn's graceful shutdown: the engine is closed), then SIGKILL."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
