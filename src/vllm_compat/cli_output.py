"""Output directories of the ``vllm-compat`` commands: ``<output>.partial`` until complete.

A step writes into ``<output>.partial`` and renames it to ``<output>`` when it returns, so a
directory under the name asked for is always a finished one. Rerunning the same command
after an interruption continues in ``<output>.partial`` (every step resumes); rerunning it
when ``<output>`` exists works in ``<output>`` (it resumes, or finds nothing left to do).
A run that fails on the user's input before writing anything leaves no ``.partial`` behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PARTIAL_SUFFIX", "describe_progress", "partial_output", "partial_path"]

PARTIAL_SUFFIX = ".partial"


def partial_path(output: str | os.PathLike[str]) -> Path:
    p = Path(os.path.normpath(output))  # "ds/" -> "ds"
    return p.with_name(p.name + PARTIAL_SUFFIX)


@contextlib.contextmanager
def partial_output(output: str | os.PathLike[str], *, keep_on_error: bool = True) -> Iterator[Path]:
    """The directory to write: ``output`` when it exists, else ``<output>.partial``, renamed
    to ``output`` when the block completes. On an exception a ``.partial`` this run created
    is removed unless ``keep_on_error`` and something was written into it (a resumable
    step's progress)."""
    final = Path(os.path.normpath(output))
    if final.exists():
        yield final
        return
    work = partial_path(final)
    created = not work.exists()
    try:
        yield work
    except BaseException as exc:
        from .cli_errors import is_user_error  # no cycle at import time

        user_mistake = isinstance(exc, Exception) and is_user_error(exc)
        if created and work.exists() and (user_mistake or not keep_on_error or _is_empty(work)):
            shutil.rmtree(work, ignore_errors=True)
        raise
    if work.exists():  # a step that wrote nothing (no output asked for) leaves the name free
        work.rename(final)


def _is_empty(path: Path) -> bool:
    return not any(p.name != ".lock" for p in path.iterdir()) if path.is_dir() else False


def describe_progress(output: str | os.PathLike[str]) -> str:
    """What an interrupted step left (in ``<output>.partial``, or in ``<output>`` when it
    worked there), for the Ctrl-C line."""
    work = partial_path(output)
    if not work.exists():
        work = Path(os.path.normpath(output))
    if not work.exists() or _is_empty(work):
        return "nothing was written"
    manifest = work / "manifest.json"
    if manifest.exists():
        try:
            shards = json.loads(manifest.read_text()).get("shards", [])
            n = sum(int(s.get("num_samples", 0)) for s in shards)
            return f"{n} samples in {len(shards)} complete shards are kept in {work}"
        except (OSError, ValueError, AttributeError):
            pass
    prepared = work / "prepared.jsonl"
    if prepared.exists():
        with prepared.open("rb") as f:
            n = sum(1 for _ in f)
        return f"{n} prepared records are kept in {work}"
    checkpoints = sorted((work / "checkpoints").glob("step-*.pt")) if (work / "checkpoints").is_dir() else []
    if checkpoints:
        return f"checkpoint {checkpoints[-1].stem} is kept in {work}"
    files = sum(1 for p in work.rglob("*") if p.is_file() and p.name != ".lock")
    return f"{files} finished files are kept in {work}"
