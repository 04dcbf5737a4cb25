"""What a result was measured with: the code (git commit, or a hash of the sources where there
is no git checkout) and the versions of vLLM, torch, CUDA and the GPUs. Benchmarks and the
GPU test runner write these into their results files."""

from __future__ import annotations

import hashlib
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any


def code_id(root: str | Path) -> str:
    """The git commit of ``root`` (``+dirty`` with uncommitted changes to tracked files);
    without git, ``sources-`` and a hash of the ``.py`` files under src/, tests/, tools/ and
    bench/ (a copied checkout has no ``.git``)."""
    root = Path(root)
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, check=True).stdout
        return head + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        h = hashlib.sha256()
        for d in ("src", "tests", "tools", "bench"):
            for f in sorted((root / d).rglob("*.py")):
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
        return "sources-" + h.hexdigest()[:16]


def versions() -> dict[str, Any]:
    """vLLM, torch, CUDA, transformers and the visible GPUs (what is installed)."""
    out: dict[str, Any] = {}
    try:
        import torch
    except ImportError:
        return out
    out.update(torch=torch.__version__, cuda=torch.version.cuda,
               gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    for name in ("vllm", "transformers"):  # installed versions, without importing them
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
