"""Hidden-state files as vLLM's extract_hidden_states connectors write them.

One safetensors file per prompt, as ``ExampleHiddenStatesConnector`` (vLLM 0.22.1+) writes
it: ``token_ids`` int64 ``[T]`` and ``hidden_states`` ``[T, K, H]`` in the model's dtype, the
``K`` layers in the order requested. hs-connectors 0.9's ``FP8HiddenStatesConnector``
writes ``hidden_states`` as float8_e4m3fn and adds ``hidden_states_scales`` float32
``[T, 1, 1]``: one scale per token, the row's largest ``|x|`` over all layers and features
divided by 448, computed from the model-dtype states in float32 (:func:`quantize_per_token`,
byte for byte hs-connectors' ``quantize_tensor_to_fp8``).

The lock protocol (vLLM 0.22.1+): before a file's path is handed to the client,
``<file>.lock`` is created and held with ``flock(LOCK_EX)``; the lock is released (its
descriptor closed) once the file is completely written. The reader takes the lock
(speculators polls ``LOCK_EX | LOCK_NB``; vLLM's ``load_hidden_states`` blocks on
``LOCK_SH``), reads the file and deletes the lock file. :class:`HiddenStatesFiles` keeps
that protocol and one more promise: a request that is cancelled (its client went away)
leaves neither its file nor its lock file behind, and no lock is ever left held.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["FORMATS", "SCALES_KEY", "HiddenStatesFiles", "Reservation", "hidden_states_payload",
           "quantize_per_token", "save_hidden_states"]

log = logging.getLogger(__name__)

SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY
FORMATS = ("model", "fp8")  # ExampleHiddenStatesConnector / FP8HiddenStatesConnector
FP8 = torch.float8_e4m3fn


def quantize_per_token(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``states`` ``[T, ...]`` -> (float8_e4m3fn like ``states``, float32 scale ``[T, 1, ...]``):
    one scale per token over every other dimension, ``amax / 448`` (at least 1e-12)."""
    x = states.float()
    amax = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
    scale = (amax / torch.finfo(FP8).max).clamp(min=1e-12)
    return (x / scale).to(FP8), scale


def hidden_states_payload(token_ids: Any, states: torch.Tensor, fmt: str = "model"
                          ) -> dict[str, torch.Tensor]:
    """The tensors of one file: ``token_ids`` (int64) and ``hidden_states`` (+ scales for FP8)."""
    if fmt not in FORMATS:
        raise ValueError(f"hidden-states format must be one of {FORMATS}, got {fmt!r}")
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).contiguous()
    if states.dim() != 3 or states.shape[0] != ids.shape[0]:
        raise ValueError(f"hidden states of shape {tuple(states.shape)} do not fit "
                         f"{ids.shape[0]} token ids (expected [T, layers, hidden])")
    if fmt == "fp8":
        q, scale = quantize_per_token(states)
        return {"token_ids": ids, "hidden_states": q.contiguous(), SCALES_KEY: scale}
    return {"token_ids": ids, "hidden_states": states.contiguous()}


def save_hidden_states(path: str | os.PathLike[str], token_ids: Any, states: torch.Tensor,
                       fmt: str = "model", *, atomic: bool = False) -> None:
    """Write one file. ``atomic``: through a temporary name and a rename in the same
    directory, so a crash never leaves a truncated file under the final name."""
    from safetensors.torch import save_file

    tensors = hidden_states_payload(token_ids, states, fmt)
    path = os.fspath(path)
    if not atomic:
        save_file(tensors, path)
        return
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        save_file(tensors, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@dataclass
class Reservation:
    """A file whose path is handed out: its lock file is held until the write ends."""
    path: str
    lock_fd: int | None
    mu: threading.Lock = field(default_factory=threading.Lock)
    submitted: bool = False
    finished: bool = False
    discarded: bool = False


class HiddenStatesFiles:
    """``<directory>/<name>.safetensors`` files written by a pool of threads (vLLM's default
    of 8), each guarded by ``<file>.lock`` while it is written (see the module doc)."""

    def __init__(self, directory: str | os.PathLike[str], fmt: str = "model", *,
                 num_threads: int = 8, use_lock: bool = True) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"hidden-states format must be one of {FORMATS}, got {fmt!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fmt = fmt
        self.use_lock = use_lock
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="vllm-compat-hs-save")

    def reserve(self, name: str) -> Reservation:
        """The path for ``name``, its lock held (created before the path leaves the server)."""
        path = str(self.directory / f"{name}.safetensors")
        fd = None
        if self.use_lock:
            fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        return Reservation(path, fd)

    def write(self, res: Reservation, token_ids: Any, states: torch.Tensor,
              on_done: Callable[[bool], None] | None = None) -> None:
        """Write in the pool; ``on_done(ok)`` runs in the writer thread when the file is
        complete (or the write failed) and the lock is released."""
        with res.mu:
            if res.discarded:
                return
            res.submitted = True
        self._pool.submit(self._write, res, token_ids, states, on_done)

    def _write(self, res: Reservation, token_ids: Any, states: torch.Tensor,
               on_done: Callable[[bool], None] | None) -> None:
        ok = False
        try:
            save_hidden_states(res.path, token_ids, states, self.fmt)
            ok = True
        except Exception:  # a full disk, a removed directory: the request's file is lost
            log.exception("writing %s failed", res.path)
            _remove(res.path)
        finally:
            with res.mu:
                res.finished = True
                self._release(res)
                if res.discarded:  # its client went away while it was written
                    _remove(res.path, res.path + ".lock")
            if on_done is not None:
                on_done(ok)

    def discard(self, res: Reservation) -> None:
        """The client will never read ``res``: remove its file and lock file, now or as
        soon as a write in progress ends; release the lock."""
        with res.mu:
            if res.discarded:
                return
            res.discarded = True
            if res.submitted and not res.finished:
                return  # the writer thread cleans up when it is done
            self._release(res)
            _remove(res.path, res.path + ".lock")

    @staticmethod
    def _release(res: Reservation) -> None:
        if res.lock_fd is not None:
            os.close(res.lock_fd)  # releases LOCK_EX
            res.lock_fd = None

    def close(self) -> None:
        """Wait for the writes in progress."""
        self._pool.shutdown(wait=True)


def _remove(*paths: str) -> None:
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass
