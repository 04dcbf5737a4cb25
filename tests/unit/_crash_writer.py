"""Writer side of test_shard_crash_safety.py (runs in a child process the test SIGKILLs).

``child_main`` writes a hidden-state dataset with the production :class:`ShardWriter` from
a deterministic state source (sample ``i`` is a pure function of ``i``), resuming from what
is on disk. Before every file-system call the writer makes in the dataset directory
(``os.open``, ``os.write``, ``os.fsync``, ``os.replace``, ``os.unlink``) it reports the call
to the test over a pipe and waits for the go-ahead: the test either lets the call run or
kills the process right there, so kill points land between any two calls, including between
the chunks of one file's write. The calls themselves are the real ones, unchanged.

Two broken things the test must catch: ``mode="in_place"`` is the same writer with
``atomic_write_bytes`` replaced by a plain in-place write (no temporary name, no rename);
``mode="no_intent"`` writes each file atomically but commits a shard the way the writer did
naively (rename the shard, then list it; no ``pending`` record first).
"""

from __future__ import annotations

import os

import torch

from vllm_compat import locking
from vllm_compat.eagle3 import data
from vllm_compat.eagle3.data import ShardWriter

NUM_SAMPLES = 21  # 10 full shards and a last one of 1 (written by close())
SAMPLES_PER_SHARD = 2
HIDDEN = 8
AUX = [1, 2]
FINAL = 4
CHUNK = 256  # bytes per os.write in the child, so a shard takes several writes


def sample(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * i + 1)
    t = 2 + (i * 7) % 5
    return {
        "input_ids": torch.randint(0, 1000, (t,), generator=g),
        "loss_mask": torch.rand(t, generator=g) > 0.3,
        "hidden_states": torch.randn(t, len(AUX) + 1, HIDDEN, generator=g),
        "index": torch.tensor([i]),  # which sample this is: duplicates or gaps show up
    }


def write_dataset(directory: str) -> None:
    with ShardWriter(directory, hidden_size=HIDDEN, aux_layer_ids=AUX, final_layer_id=FINAL,
                     dtype=torch.float32, samples_per_shard=SAMPLES_PER_SHARD,
                     target={"name_or_path": "deterministic-source"}) as w:
        for i in range(w.num_samples, NUM_SAMPLES):
            w.add(sample(i))


def write_in_place(path: str | os.PathLike[str], payload, before_rename=None) -> None:
    """The naive writer: straight into the final name (bytes or a list of buffers, like
    ``atomic_write_bytes``; its ``before_rename`` hook, the shard's intent, runs first)."""
    if before_rename is not None:
        before_rename()
    chunks = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while view:
                view = view[os.write(fd, view[:CHUNK]):]
    finally:
        os.close(fd)


def flush_without_intent(self: ShardWriter) -> None:
    if not self._pending:
        return
    name = f"shard-{len(self.manifest.shards):05d}.safetensors"
    tensors = {f"{i}.{k}": v for i, smp in enumerate(self._pending) for k, v in smp.items()}
    payload = b"".join(data._safetensors_chunks(tensors))  # the production bytes, minus the intent
    data.atomic_write_bytes(self.dir / name, payload)
    self.manifest.shards.append({
        "file": name, "num_samples": len(self._pending),
        "num_tokens": sum(int(smp["input_ids"].shape[0]) for smp in self._pending),
        "bytes": len(payload), "sha256_tree": data.sha256_tree([payload]),
        "sha256_piece": data.DIGEST_PIECE})
    self._pending = []
    self._write_manifest()


def _instrument(directory: str, conn) -> None:
    root = os.path.realpath(directory)
    fds: dict[int, str] = {}
    real = {n: getattr(os, n) for n in ("open", "write", "fsync", "replace", "unlink", "close")}

    def inside(path) -> str | None:
        p = os.path.realpath(os.fspath(path))
        return os.path.relpath(p, root) if p == root or p.startswith(root + os.sep) else None

    def step(event: str) -> None:
        conn.send(event)
        conn.recv()  # the test answers, or kills us before the call below runs

    def open_(path, flags, *a, **k):
        name = inside(path)
        if name is not None:
            step(f"open {name}")
        fd = real["open"](path, flags, *a, **k)
        if name is not None:
            fds[fd] = name
        return fd

    def write(fd, b):
        if fd in fds:
            step(f"write {fds[fd]}")
        return real["write"](fd, b)

    def fsync(fd):
        if fd in fds:
            step(f"fsync {fds[fd]}")
        return real["fsync"](fd)

    def replace(src, dst, *a, **k):
        if inside(dst) is not None:
            step(f"replace {inside(src)} {inside(dst)}")
        return real["replace"](src, dst, *a, **k)

    def unlink(path, *a, **k):
        if inside(path) is not None:
            step(f"unlink {inside(path)}")
        return real["unlink"](path, *a, **k)

    def close(fd):
        fds.pop(fd, None)
        return real["close"](fd)

    os.open, os.write, os.fsync, os.replace, os.unlink, os.close = (
        open_, write, fsync, replace, unlink, close)


def child_main(directory: str, conn, mode: str) -> None:
    torch.set_num_threads(1)
    locking.WRITE_CHUNK = CHUNK
    if mode == "in_place":
        data.atomic_write_bytes = write_in_place
    elif mode == "no_intent":
        ShardWriter.flush = flush_without_intent
    elif mode != "atomic":
        raise ValueError(mode)
    _instrument(directory, conn)
    try:
        write_dataset(directory)
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        conn.send(f"error {type(e).__name__}: {e}")
        raise SystemExit(3) from None
    conn.send("done")
