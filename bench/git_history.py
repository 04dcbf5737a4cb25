"""A module as it was before a change, read from git, so a benchmark can time the old code
beside the new in one process without a copy of it in the tree (``cpu_ttt_step.py``,
``cpu_shard_writer.py``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def before_change(marker: str, path: str) -> str | None:
    """The parent of the newest commit that added or removed ``marker`` in ``path``
    (``git log -S``), i.e. the code just before that change; None if no commit did."""
    revs = _git("log", "--format=%H", "-S", marker, "--", path).split()
    return f"{revs[0]}~1" if revs else None


def full_sha(rev: str) -> str:
    return _git("rev-parse", rev).strip()


def module_at(rev: str, path: str, name: str, package: str | None = None) -> ModuleType:
    """``path`` at ``rev`` as module ``name``; ``package`` lets its relative imports resolve."""
    src = _git("show", f"{rev}:{path}")
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = package
    sys.modules[name] = mod  # dataclasses look the module up while a class is built
    exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod
