"""Kill a replica of :func:`vllm_compat.eagle3.distributed.extract_distributed` while it
writes a unit: for tests of the resume path (ours, and yours on your cluster).

    killer = ReplicaKiller(output_dir, replica=1)
    extract_distributed(..., replicas=2, on_event=killer)
    killer.killed  # {"unit": ..., "pid": ..., "partial": ...}

On the first unit handed to ``replica`` (by the driver's ``unit_started`` event) a thread
waits until that unit's partial directory holds its first shard, then sends the replica's
process SIGKILL: the unit is half written, as when a node dies.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ..eagle3.units import UNITS


class ReplicaKiller:
    """An ``on_event`` callback that kills ``replica`` mid-unit once; ``events`` keeps every
    event the driver sent."""

    def __init__(self, output_dir: str | os.PathLike[str], replica: int = 1,
                 timeout_s: float = 300.0) -> None:
        self.dir = Path(output_dir)
        self.replica = replica
        self.timeout_s = timeout_s
        self.events: list[dict[str, Any]] = []
        self.killed: dict[str, Any] = {}
        self._armed = False

    def __call__(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if (event["event"] == "unit_started" and event["replica"] == self.replica
                and not self._armed and event.get("pid")):
            self._armed = True
            threading.Thread(target=self._kill, args=(event["unit"], event["pid"]),
                             daemon=True).start()

    def _kill(self, unit: int, pid: int) -> None:
        pattern = f"unit-{unit:05d}.partial-*/shard-00000.safetensors"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            found = list((self.dir / UNITS).glob(pattern))
            if found:
                os.kill(pid, signal.SIGKILL)
                self.killed.update(unit=unit, pid=pid, partial=str(found[0].parent),
                                   shards_then=len(list(found[0].parent.glob("shard-*"))))
                return
            time.sleep(0.001)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]
