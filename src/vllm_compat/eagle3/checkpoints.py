"""Training checkpoints: atomic saves, the newest one found, and the checks that make a
resume exact (the same data order and schedule as the run that wrote it).

Shared by offline training (shards) and online training (states extracted while training):
a checkpoint does not say where the states came from, because both feed the same samples
in the same order, so either can resume the other's run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import TrainingCheckpointError

CHECKPOINTS = "checkpoints"

# what must match for a resume to see the same data order and learning rates
IDENTITY_KEYS = ("num_samples", "world_size", "batch_size")


def _checkpoints(out: Path) -> list[Path]:
    return sorted((out / CHECKPOINTS).glob("step-*.pt"))


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    """``write(file)`` into ``path.tmp``, fsync it, rename it over ``path``, fsync the
    directory: a kill at any point leaves either the old file or the complete new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save_checkpoint(out: Path, state: dict[str, Any], keep: int) -> Path:
    """Atomic (see :func:`_atomic_write`); older checkpoints beyond ``keep`` are deleted only
    after the new one is durable, so the latest complete checkpoint always survives a kill."""
    d = out / CHECKPOINTS
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{state['step']:08d}.pt"
    _atomic_write(path, lambda f: torch.save(state, f))
    for old in _checkpoints(out)[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)  # never unpickle objects
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file, whatever torch says
        raise TrainingCheckpointError(
            f"{path} is not a readable training checkpoint ({type(exc).__name__}: {exc}); "
            "delete it to resume from the previous one, or start over with resume=False") from exc


def prepare_resume(out: Path, resume: bool, rank: int) -> list[Path]:
    """The checkpoints to resume from (newest last). Rank 0 removes what an interrupted save
    left, and every checkpoint when starting over (a later resume must not pick them up)."""
    found = _checkpoints(out)
    if rank == 0:
        for stale in (out / CHECKPOINTS).glob("*.tmp"):  # a save that a kill interrupted
            stale.unlink(missing_ok=True)
        if found and not resume:
            for old in found:
                old.unlink()
    return found if resume else []


def check_resumable(path: Path, state: dict[str, Any], *, num_samples: int, world_size: int,
                    batch_size: int, seed: int, total_steps: int, epochs: int) -> None:
    """Refuse a checkpoint whose run had another data order or schedule."""
    if (state["num_samples"], state["world_size"], state["batch_size"]) != (num_samples, world_size, batch_size):
        raise TrainingCheckpointError(
            f"{path} was written for {state['num_samples']} samples, world size {state['world_size']}, "
            f"batch size {state['batch_size']}; now {num_samples}, {world_size}, {batch_size}: the data "
            "order would differ, so resuming would not be exact (start over with resume=False / --no-resume)"
        )
    was = (state.get("seed", seed), state.get("total_steps", total_steps))
    if was != (seed, total_steps):
        raise TrainingCheckpointError(
            f"{path} was written for seed {was[0]} and a {was[1]}-step schedule; now seed "
            f"{seed} and {total_steps} steps (epochs={epochs}): the data order or learning rates "
            "would differ, so resuming would not be exact (start over with resume=False / --no-resume)")
