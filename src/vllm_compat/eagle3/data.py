"""Hidden-state dataset on disk: safetensors shards plus a ``manifest.json``.

One sample is a dict of tensors:

- ``input_ids``     int64 ``[T]``
- ``loss_mask``     bool  ``[T]`` (True on tokens the draft is trained to predict)
- ``hidden_states`` ``[T, n_aux + 1, H]``: the auxiliary layers in ``aux_layer_ids`` order,
  then the final layer ``L`` (the target's last decoder output, *before* its final norm).

Any other tensor in a sample is stored and returned as is. Layer ids follow vLLM's
convention: id ``k`` is the state *entering* decoder layer ``k``; ``L`` is the final state.

FP8 datasets (``dtype`` ``float8_e4m3fn``, manifest ``format_version`` 2, so that readers of
version 1 refuse them rather than train on unscaled values) store ``hidden_states`` in FP8
with ``hidden_states_scale`` float32 ``[T, n_aux + 1]`` beside it
(:mod:`vllm_compat.extract.fp8`); :class:`HiddenStatesDataset` hands the states back decoded.

Crash safety (docs/reliability-data.md). The writer is append-only and holds the directory's
lock (:mod:`vllm_compat.locking`). Every file is written to ``<name>.tmp``, fsynced, renamed,
and the directory fsynced. A shard is committed in four steps: its bytes are written to
``<name>.tmp`` and fsynced (its digest, :func:`sha256_tree`, computed beside the write), the
manifest records it as ``pending`` (name, sample and token counts, size, digest), the file is
renamed to its name,
the manifest moves it to ``shards``. So at any instant, a crash included, the shard files
present are the committed shards plus possibly the pending one (complete: it is renamed only
after its fsync); a reader ignores the pending shard, and a resumed writer keeps it when its
bytes match the recorded sha256 (otherwise deletes it) and removes stale ``*.tmp`` files.

Reading checks every shard against the manifest when the dataset is opened (presence, size,
safetensors header: keys, dtypes, shapes, sample and token counts) and each sample's hidden
states for NaN/Inf when it is read; errors name the file. Names in the manifest must stay
inside the directory (no ``..``, absolute paths or symlinks that lead out). Nothing is
unpickled: tensors go through safetensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import VllmCompatError
from ..extract import fp8
from ..locking import TMP_SUFFIX, OutputDirLock, atomic_write_bytes, lock_output_dir

log = logging.getLogger(__name__)

FORMAT = "vllm-compat-eagle3-hidden-states"
FORMAT_VERSION = 1
FP8_FORMAT_VERSION = 2  # FP8 states with scales: a version-1 reader must not take them
READABLE_VERSIONS = (FORMAT_VERSION, FP8_FORMAT_VERSION)
MANIFEST = "manifest.json"
REQUIRED_KEYS = ("input_ids", "loss_mask", "hidden_states")
_SHARD_NAME = re.compile(r"shard-\d{5,}\.safetensors")
_KEY = re.compile(r"(\d+)\.(.+)")
_MAX_HEADER = 100 << 20  # safetensors' own limit
# safetensors dtype codes -> torch names (as the manifest's "dtype")
_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
           "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
           "BF16": "bfloat16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}


class DatasetFormatError(VllmCompatError, ValueError):
    """A dataset directory or sample that does not follow the format above."""


class InvalidShardError(DatasetFormatError):
    """One file of the dataset is unreadable or disagrees with the manifest.

    ``str(err)`` is ``"<path>: <reason>"``; both are attributes too.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class UnsafePathError(DatasetFormatError):
    """A manifest names a file outside the dataset directory; never skipped."""


@dataclass(frozen=True)
class SkippedShard:
    """A shard ``HiddenStatesDataset(on_invalid="skip")`` left out, and why."""

    file: str
    reason: str


# --------------------------------------------------------------------------- files


def _member(directory: Path, name: Any, where: Path) -> Path:
    """``directory / name``, refusing names that lead outside ``directory``."""
    if not isinstance(name, str) or not name:
        raise DatasetFormatError(f"{where}: shard file name {name!r} is not a file name")
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        raise UnsafePathError(f"{where}: shard file {name!r} is outside the dataset directory")
    full = directory / p
    root = directory.resolve()
    real = full.resolve()
    if real != root and root not in real.parents:
        raise UnsafePathError(
            f"{where}: shard file {name!r} is a link to {real}, outside the dataset directory"
        )
    return full


# --------------------------------------------------------------------------- manifest


def _shard_entry(d: Any, where: Path) -> dict[str, Any]:
    if not isinstance(d, dict) or not isinstance(d.get("file"), str):
        raise DatasetFormatError(f"{where}: shard entry {d!r} has no 'file'")
    for k in ("num_samples", "num_tokens"):
        if not isinstance(d.get(k), int) or isinstance(d.get(k), bool) or d[k] < 0:
            raise DatasetFormatError(f"{where}: shard {d['file']!r}: {k} must be an integer >= 0")
    return dict(d)


@dataclass
class Manifest:
    hidden_size: int
    aux_layer_ids: list[int]
    final_layer_id: int
    dtype: str = "bfloat16"
    shards: list[dict[str, Any]] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)  # e.g. name_or_path, vocab_size
    pending: dict[str, Any] | None = None  # the shard being committed (not part of the dataset)

    @property
    def num_samples(self) -> int:
        return sum(s["num_samples"] for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self.shards)

    @property
    def layer_ids(self) -> list[int]:
        """Layer id of each slot of ``hidden_states`` (aux layers, then the final layer)."""
        return [*self.aux_layer_ids, self.final_layer_id]

    @property
    def is_fp8(self) -> bool:
        """FP8 states with a ``hidden_states_scale`` per sample (:mod:`vllm_compat.extract.fp8`)."""
        return fp8.is_fp8(self.dtype)

    def to_json(self) -> dict[str, Any]:
        d = {
            "format": FORMAT, "format_version": FP8_FORMAT_VERSION if self.is_fp8 else FORMAT_VERSION,
            "hidden_size": self.hidden_size, "aux_layer_ids": self.aux_layer_ids,
            "final_layer_id": self.final_layer_id, "dtype": self.dtype,
            "num_samples": self.num_samples, "num_tokens": self.num_tokens,
            "target": self.target, "shards": self.shards,
        }
        if self.is_fp8:
            d["hidden_states_scale"] = {"dtype": "float32", "per": "token and layer",
                                        "decode": "hidden_states * hidden_states_scale[..., None]"}
        if self.pending is not None:
            d["pending"] = self.pending
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str | os.PathLike[str] = MANIFEST) -> Manifest:
        where = Path(where)
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("format_version") not in READABLE_VERSIONS:
            d = d if isinstance(d, dict) else {}
            raise DatasetFormatError(
                f"{where}: not a {FORMAT} v{FORMAT_VERSION}/v{FP8_FORMAT_VERSION} manifest "
                f"(format={d.get('format')!r}, version={d.get('format_version')!r})"
            )
        try:
            shards = d["shards"]
            if not isinstance(shards, list):
                raise DatasetFormatError(f"{where}: 'shards' must be a list")
            pending = d.get("pending")
            return cls(
                hidden_size=int(d["hidden_size"]), aux_layer_ids=[int(i) for i in d["aux_layer_ids"]],
                final_layer_id=int(d["final_layer_id"]), dtype=str(d.get("dtype", "bfloat16")),
                shards=[_shard_entry(s, where) for s in shards], target=dict(d.get("target") or {}),
                pending=None if pending is None else _shard_entry(pending, where),
            )
        except KeyError as e:
            raise DatasetFormatError(f"{where}: missing {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, DatasetFormatError):
                raise
            raise DatasetFormatError(f"{where}: malformed ({e})") from None


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DatasetFormatError(f"{directory}: no {MANIFEST} (not a dataset directory)")
    try:
        d = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise DatasetFormatError(f"{path}: not valid JSON ({e})") from None
    return Manifest.from_json(d, path)


def _check_shapes(shapes: dict[str, tuple[int, ...]], n_layers: int, hidden_size: int) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in shapes]
    if missing:
        raise DatasetFormatError(f"sample lacks {missing}")
    ids, mask, hs = shapes["input_ids"], shapes["loss_mask"], shapes["hidden_states"]
    t = ids[0] if len(ids) == 1 else -1
    if len(ids) != 1 or t == 0:
        raise DatasetFormatError(f"input_ids must be a non-empty 1-D tensor, got {ids}")
    if mask != (t,):
        raise DatasetFormatError(f"loss_mask shape {mask} != input_ids shape ({t},)")
    if hs != (t, n_layers, hidden_size):
        raise DatasetFormatError(
            f"hidden_states shape {hs} != (T, n_aux + 1, H) = ({t}, {n_layers}, {hidden_size})"
        )
    scale = shapes.get(fp8.SCALE_KEY)
    # (T, n): per token and layer; (n,): per sample and layer (earlier FP8 datasets)
    if scale is not None and scale not in ((t, n_layers), (n_layers,)):
        raise DatasetFormatError(
            f"{fp8.SCALE_KEY} shape {scale} != (T, n_aux + 1) = ({t}, {n_layers})")


def check_sample(sample: dict[str, torch.Tensor], n_layers: int, hidden_size: int) -> None:
    """Raise :class:`DatasetFormatError` unless ``sample`` has the documented shapes."""
    _check_shapes({k: tuple(v.shape) for k, v in sample.items()}, n_layers, hidden_size)


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of a safetensors file, checked against the file's size (catches truncation
    without reading the tensors). Raises :class:`InvalidShardError`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise InvalidShardError(path, f"truncated: {size} bytes, not a safetensors file")
            n = int.from_bytes(f.read(8), "little")
            if n > _MAX_HEADER or 8 + n > size:
                raise InvalidShardError(
                    path, f"truncated: {size} bytes, shorter than its {n}-byte safetensors header")
            raw = f.read(n)
    except OSError as e:
        raise InvalidShardError(path, f"unreadable ({e.strerror})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
        end = 0
        for k, v in header.items():
            if k != "__metadata__":
                end = max(end, int(v["data_offsets"][1]))
                v["dtype"], v["shape"] = str(v["dtype"]), tuple(int(x) for x in v["shape"])
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise InvalidShardError(path, f"not a safetensors file (bad header: {e})") from None
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "has trailing bytes"
        raise InvalidShardError(path, f"{what}: {size} bytes, its safetensors header describes {8 + n + end}")
    header.pop("__metadata__", None)
    return header


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# A shard's digest: sha256 over the sha256 of each DIGEST_PIECE-byte piece of the file, the
# pieces hashed on a thread pool (hashlib releases the GIL). One sha256 runs at ~2 GB/s on
# one core; on an H200 host it bounded the writer at 0.61 of the disk (writer without
# hashing: 1.0). Manifests keep it as "sha256_tree" beside
# "sha256_piece"; "sha256" (whole file, earlier writers) is still checked where present.
DIGEST_PIECE = 16 << 20
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
_hash_pool: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _hash_pool
    if _hash_pool is None:
        _hash_pool = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="shard-sha256")
    return _hash_pool


def _pieces(chunks: Iterable[Any], piece: int) -> Iterator[list[memoryview]]:
    """The byte stream of ``chunks`` cut at every multiple of ``piece``."""
    cur: list[memoryview] = []
    room = piece
    for c in chunks:
        v = memoryview(c).cast("B")
        while len(v):
            take = min(room, len(v))
            cur.append(v[:take])
            v = v[take:]
            room -= take
            if room == 0:
                yield cur
                cur, room = [], piece
    if cur:
        yield cur


def _sha256_views(views: list[Any]) -> bytes:
    h = hashlib.sha256()
    for v in views:
        h.update(v)
    return h.digest()


def sha256_tree(chunks: Iterable[Any], piece: int = DIGEST_PIECE) -> str:
    """sha256 of the concatenated sha256 digests of each ``piece``-byte piece of the bytes."""
    return hashlib.sha256(b"".join(_pool().map(_sha256_views, _pieces(chunks, piece)))).hexdigest()


def _file_pieces(path: Path, piece: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(piece), b""):
            yield block


def _sha256_tree_file(path: Path, piece: int) -> str:
    # Executor.map takes its whole input at once: read a few pieces per call, not the file
    out: list[bytes] = []
    batch: list[bytes] = []
    for block in _file_pieces(path, piece):
        batch.append(block)
        if len(batch) == 2 * HASH_THREADS:
            out += _pool().map(_sha256_views, ([b] for b in batch))
            batch = []
    out += _pool().map(_sha256_views, ([b] for b in batch))
    return hashlib.sha256(b"".join(out)).hexdigest()


def _digests_match(path: Path, entry: Mapping[str, Any]) -> bool:
    """Whether the file matches every digest its manifest entry records."""
    if "sha256" in entry and _sha256(path) != entry["sha256"]:
        return False
    return "sha256_tree" not in entry or _sha256_tree_file(
        path, int(entry.get("sha256_piece", DIGEST_PIECE))) == entry["sha256_tree"]


def check_shard(path: str | os.PathLike[str], entry: dict[str, Any], manifest: Manifest, *,
                full: bool = False) -> None:
    """Check one shard file against its manifest entry; raise :class:`InvalidShardError`.

    Always: size (when recorded), header, tensor names, dtypes and shapes, sample and token
    counts. ``full``: also the sha256 (when recorded) and NaN/Inf in every hidden state.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidShardError(path, f"listed in {MANIFEST} but missing")
    header = read_safetensors_header(path)
    size = path.stat().st_size
    if "bytes" in entry and entry["bytes"] != size:
        raise InvalidShardError(path, f"{size} bytes, {MANIFEST} says {entry['bytes']}")
    samples: dict[int, dict[str, dict[str, Any]]] = {}
    for k, v in header.items():
        m = _KEY.fullmatch(k)
        if m is None:
            raise InvalidShardError(path, f"unexpected tensor name {k!r} (expected '<sample>.<key>')")
        samples.setdefault(int(m.group(1)), {})[m.group(2)] = v
    if sorted(samples) != list(range(len(samples))):
        raise InvalidShardError(path, f"sample numbers {sorted(samples)} are not 0..{len(samples) - 1}")
    if len(samples) != entry["num_samples"]:
        raise InvalidShardError(path, f"holds {len(samples)} samples, {MANIFEST} says {entry['num_samples']}")
    n_layers, want_dtypes = len(manifest.layer_ids), {
        "input_ids": "int64", "loss_mask": "bool", "hidden_states": manifest.dtype}
    if manifest.is_fp8:
        want_dtypes[fp8.SCALE_KEY] = "float32"
    tokens = 0
    for j in range(len(samples)):
        s = samples[j]
        try:
            _check_shapes({k: v["shape"] for k, v in s.items()}, n_layers, manifest.hidden_size)
        except DatasetFormatError as e:
            raise InvalidShardError(path, f"sample {j}: {e}") from None
        for key, want in want_dtypes.items():
            if key not in s:
                raise InvalidShardError(path, f"sample {j}: no {key} ({manifest.dtype} states need it)")
            have = _DTYPES.get(s[key]["dtype"], s[key]["dtype"])
            if have != want:
                src = f"{MANIFEST} says" if key == "hidden_states" else "expected"
                raise InvalidShardError(path, f"sample {j}: {key} dtype {have}, {src} {want}")
        tokens += s["input_ids"]["shape"][0]
    if tokens != entry["num_tokens"]:
        raise InvalidShardError(path, f"holds {tokens} tokens, {MANIFEST} says {entry['num_tokens']}")
    if full:
        if not _digests_match(path, entry):
            raise InvalidShardError(path, f"sha256 differs from {MANIFEST} (the file changed after it was written)")
        with safe_open(str(path), framework="pt") as f:
            for j in range(len(samples)):
                hs = f.get_tensor(f"{j}.hidden_states")
                if manifest.is_fp8:  # a non-finite scale spoils its row: check the decoded values
                    hs = fp8.decode(hs, f.get_tensor(f"{j}.{fp8.SCALE_KEY}"), torch.float32)
                _check_finite(path, j, hs)


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN and no Inf. One ``aminmax`` pass (min and max carry any NaN
    or Inf): on the CPU about 8x faster than ``isfinite(t).all()`` on a bf16 sample's states,
    which has no vectorised bf16 kernel there (``python -m bench.cpu_finite_check``)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if t.element_size() == 1:
        t = t.to(torch.float16)  # no float8 kernels; fp8 NaN survives the cast
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _check_finite(path: Path, j: int, hs: torch.Tensor) -> None:
    if all_finite(hs):
        return
    if hs.element_size() == 1:
        hs = hs.to(torch.float16)
    bad = int((~torch.isfinite(hs)).sum())
    raise InvalidShardError(path, f"sample {j}: hidden_states has {bad} non-finite values (NaN/Inf)")


def _stray_shard_files(directory: Path, manifest: Manifest) -> list[Path]:
    """``*.safetensors`` files the manifest does not list (the pending shard excepted)."""
    known = {Path(s["file"]).as_posix() for s in manifest.shards}
    if manifest.pending is not None:
        known.add(Path(manifest.pending["file"]).as_posix())
    return sorted(p for p in directory.iterdir()
                  if p.name.endswith(".safetensors") and p.name not in known)


# --------------------------------------------------------------------------- writer


_CODES = {getattr(torch, name): code for code, name in _DTYPES.items() if hasattr(torch, name)}


def _safetensors_chunks(tensors: dict[str, torch.Tensor]) -> list[Any]:
    """A safetensors file as ``[prefix, tensor bytes, ...]`` (contiguous CPU tensors), without
    joining the tensors into one buffer: ``safetensors.torch.save`` copies every byte once more
    (2026-11-29: 0.66 s of a 1.3 s flush of 512 MiB on tmpfs). Same format: an 8-byte
    little-endian header length, the JSON header padded with spaces to 8 bytes, the data."""
    header: dict[str, Any] = {}
    bufs: list[Any] = []
    off = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        if n:
            bufs.append(t.reshape(-1).view(torch.uint8).numpy().data)
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)
    return [struct.pack("<Q", len(head)) + head, *bufs]


def _digest_of(chunks: list[Any], out: list[str]) -> None:
    """Thread body: the shard's :func:`sha256_tree`, computed beside the write."""
    out.append(sha256_tree(chunks))


class ShardWriter:
    """Append samples to a dataset directory; reopening an existing one continues it.

    Holds the directory's lock (:func:`vllm_compat.locking.lock_output_dir`) until
    :meth:`close`; another process opening a writer on it gets
    :class:`~vllm_compat.locking.OutputDirLockedError`. Shards are always
    ``samples_per_shard`` samples except the one :meth:`close` flushes, so a run killed and
    resumed (samples buffered in memory are recomputed) writes the same bytes as one that
    never stopped.

    ``dtype=torch.float8_e4m3fn``: samples may come encoded (``hidden_states`` FP8 with a
    ``hidden_states_scale``, as ``HiddenStatesExtractor(states_dtype=torch.float8_e4m3fn)``
    hands them out, encoded on the GPU) or in any float dtype, which :meth:`encode` turns
    into FP8 with a scale per token and layer (:mod:`vllm_compat.extract.fp8`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        hidden_size: int,
        aux_layer_ids: Sequence[int],
        final_layer_id: int,
        dtype: torch.dtype = torch.bfloat16,
        samples_per_shard: int = 256,
        target: dict[str, Any] | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.dtype = dtype
        self.fp8 = fp8.is_fp8(dtype)
        self.samples_per_shard = samples_per_shard
        self._lock: OutputDirLock | None = lock_output_dir(self.dir, "ShardWriter")
        try:
            wanted = Manifest(hidden_size, list(aux_layer_ids), final_layer_id,
                              str(dtype).removeprefix("torch."), target=dict(target or {}))
            if (self.dir / MANIFEST).exists():
                have = read_manifest(self.dir)
                if (have.hidden_size, have.layer_ids, have.dtype) != (
                        wanted.hidden_size, wanted.layer_ids, wanted.dtype):
                    raise DatasetFormatError(
                        f"{self.dir} holds hidden_size={have.hidden_size} layers={have.layer_ids} "
                        f"dtype={have.dtype}; cannot append hidden_size={hidden_size} "
                        f"layers={wanted.layer_ids} dtype={wanted.dtype}"
                    )
                self.manifest = have
                self._recover()
            else:
                self._remove_stale_tmp()
                self.manifest = wanted
                self._write_manifest()
        except BaseException:
            self._release()
            raise
        self._pending: list[dict[str, torch.Tensor]] = []

    def _remove_stale_tmp(self) -> None:
        for p in self.dir.iterdir():
            if p.name.endswith(TMP_SUFFIX) and (
                    p.name == MANIFEST + TMP_SUFFIX or _SHARD_NAME.fullmatch(p.name[:-len(TMP_SUFFIX)])):
                p.unlink()

    def _recover(self) -> None:
        """After a crash: drop temporary files, keep or drop the pending shard, and refuse to
        append to a dataset whose committed shards are missing or changed in size."""
        where = self.dir / MANIFEST
        for s in self.manifest.shards:
            path = _member(self.dir, s["file"], where)
            if not path.is_file():
                raise InvalidShardError(path, f"listed in {MANIFEST} but missing")
            if "bytes" in s and path.stat().st_size != s["bytes"]:
                raise InvalidShardError(path, f"{path.stat().st_size} bytes, {MANIFEST} says {s['bytes']}")
        self._remove_stale_tmp()
        p = self.manifest.pending
        if p is None:
            return
        path = _member(self.dir, p["file"], where)
        if path.is_file() and ("sha256" in p or "sha256_tree" in p) and _digests_match(path, p):
            self.manifest.shards.append(p)  # complete: renamed only after its fsync
        elif path.exists():
            path.unlink()
        self.manifest.pending = None
        self._write_manifest()

    @property
    def num_samples(self) -> int:
        """Samples already on disk plus those buffered for the next shard."""
        return self.manifest.num_samples + len(self._pending)

    def encode(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``sample`` as this dataset stores it: FP8 states encoded here if they are not yet.

        Checks the shapes; FP8 states without their scale, or FP8 states for a dataset of
        another dtype, are refused (:class:`DatasetFormatError`)."""
        check_sample(sample, len(self.manifest.layer_ids), self.manifest.hidden_size)
        hs = sample["hidden_states"]
        encoded = fp8.is_fp8(hs.dtype)
        if encoded and fp8.SCALE_KEY not in sample:
            raise DatasetFormatError(f"FP8 hidden_states without {fp8.SCALE_KEY}")
        if not self.fp8:
            if encoded or fp8.SCALE_KEY in sample:
                raise DatasetFormatError(
                    f"FP8 states (with {fp8.SCALE_KEY}) for a {self.manifest.dtype} dataset: open "
                    "the writer with dtype=torch.float8_e4m3fn, or extract in the model's dtype")
            return sample
        if encoded:
            return sample
        q, scale = fp8.encode(hs)
        return {**sample, "hidden_states": q, fp8.SCALE_KEY: scale}

    def add(self, sample: dict[str, torch.Tensor]) -> None:
        if self._lock is None:
            raise RuntimeError(f"ShardWriter for {self.dir} is closed")
        self._pending.append(self.encode(sample))
        if len(self._pending) >= self.samples_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        index = len(self.manifest.shards)
        name = f"shard-{index:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for i, s in enumerate(self._pending):
            for k, v in s.items():
                if k == "input_ids":
                    v = v.to(torch.int64)
                elif k == "loss_mask":
                    v = v.to(torch.bool)
                elif k == "hidden_states":
                    v = v.to(self.dtype)
                elif k == fp8.SCALE_KEY and self.fp8:
                    v = v.to(torch.float32)
                # views of one buffer (the extractor's per-step host tensor) are written as
                # they are: the bytes are streamed per tensor, nothing needs its own storage
                tensors[f"{i}.{k}"] = v.detach().cpu().contiguous()
        data = _safetensors_chunks(tensors)
        entry: dict[str, Any] = {
            "file": name, "num_samples": len(self._pending),
            "num_tokens": int(sum(s["input_ids"].shape[0] for s in self._pending)),
            "bytes": sum(len(c) for c in data),
        }
        # sha256 in a thread while the temporary file is written (H200 host, 2026-11-29: this
        # writer ran at 0.39 of the disk's speed with hash, then write, one after the other)
        digest: list[str] = []
        hasher = threading.Thread(target=_digest_of, args=(data, digest), name="shard-digest")
        hasher.start()

        def intent() -> None:
            hasher.join()
            if not digest:
                raise RuntimeError(f"hashing {name} failed")
            entry["sha256_tree"], entry["sha256_piece"] = digest[0], DIGEST_PIECE
            self.manifest.pending = entry
            self._write_manifest()

        try:
            # 1. the shard's bytes to <name>.tmp (durable), 2. the intent in the manifest,
            # 3. the rename (inside atomic_write_bytes), 4. the commit. A crash before 2 leaves
            # a stray .tmp (removed on resume); between 2 and 3 a pending shard without its file
            # (dropped on resume); after 3 a pending shard that matches its digest (kept).
            atomic_write_bytes(self.dir / name, data, before_rename=intent)
        finally:
            hasher.join()
        self.manifest.shards.append(entry)  # 4. commit
        self.manifest.pending = None
        self._write_manifest()
        self._pending = []

    def close(self) -> Manifest:
        try:
            if self._lock is not None:
                self.flush()
        finally:
            self._release()
        return self.manifest

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_manifest(self) -> None:
        atomic_write_bytes(self.dir / MANIFEST, json.dumps(self.manifest.to_json(), indent=1).encode())


class BackgroundShardWriter:
    """A :class:`ShardWriter` fed by a background thread through a bounded queue.

    Encoding, hashing and writing a shard then overlap the producer (an extraction loop)
    instead of stopping it every ``samples_per_shard`` samples. FIFO: the same shards with
    the same bytes, in the same order, with the same crash safety as the writer itself.
    Samples are checked in the caller's thread. A write error in the thread is raised by the
    next :meth:`add` or by :meth:`close`. ``max_queue`` bounds the samples waiting (memory);
    a full queue blocks :meth:`add`. Every file is durable when :meth:`close` returns (each
    shard and manifest write is fsync'ed, :func:`vllm_compat.locking.atomic_write_bytes`).

    FP8 datasets whose samples come unencoded (not encoded on the GPU by the extractor)
    are encoded by a thread of its own, so that encoding one sample overlaps writing the
    previous ones (torch releases the GIL). ``busy`` holds the seconds each thread worked:
    ``encode_s`` and ``write_s`` (writing includes hashing and fsync).
    """

    def __init__(self, writer: ShardWriter, max_queue: int = 64) -> None:
        import queue

        self.writer = writer
        self.error: BaseException | None = None
        self.busy = {"encode_s": 0.0, "write_s": 0.0}
        self._q: Any = queue.Queue(maxsize=max_queue)
        self._threads = [threading.Thread(target=self._write_loop, name="shard-writer", daemon=True)]
        self._in = self._q
        if writer.fp8:
            self._in = queue.Queue(maxsize=max_queue)
            self._threads.append(threading.Thread(target=self._encode_loop, name="shard-fp8-encode",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    @property
    def manifest(self) -> Manifest:
        return self.writer.manifest

    def add(self, sample: dict[str, torch.Tensor]) -> None:
        if self.error is not None:
            raise self.error
        check_sample(sample, len(self.writer.manifest.layer_ids), self.writer.manifest.hidden_size)
        self._in.put(sample)

    def _encode_loop(self) -> None:
        while True:
            sample = self._in.get()
            if sample is not None and self.error is None:  # after an error: drain, pass the end on
                try:
                    t0 = time.perf_counter()
                    sample = self.writer.encode(sample)
                    self.busy["encode_s"] += time.perf_counter() - t0
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                    self.error = e
                    continue
            elif sample is not None:
                continue
            self._q.put(sample)
            if sample is None:
                return

    def _write_loop(self) -> None:
        while True:
            sample = self._q.get()
            if sample is None:
                return
            if self.error is None:  # after an error: drain, so the producer never blocks
                try:
                    t0 = time.perf_counter()
                    self.writer.add(sample)
                    self.busy["write_s"] += time.perf_counter() - t0
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                    self.error = e

    def close(self) -> Manifest:
        """Write what is queued and the last shard; returns the manifest."""
        if self._threads[0].is_alive():
            self._in.put(None)  # the encoder, if any, passes it on once it has drained
            for t in self._threads:
                t.join()
        if self.error is not None:
            self.writer._release()  # the folder lock; the partial shard was never committed
            raise self.error
        t0 = time.perf_counter()
        manifest = self.writer.close()
        self.busy["write_s"] += time.perf_counter() - t0
        return manifest

    def __enter__(self) -> BackgroundShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- reader


ON_INVALID = ("raise", "skip")
VERIFY = ("header", "full")


class HiddenStatesDataset(torch.utils.data.Dataset):
    """Random access over a dataset directory; keeps the most recently used shard open.

    Opening checks every shard against the manifest (:func:`check_shard`): ``verify="header"``
    reads only each file's size and safetensors header; ``verify="full"`` also reads every
    tensor (sha256, NaN/Inf). Files the manifest does not list are errors too. With
    ``on_invalid="raise"`` (default) the first problem raises :class:`InvalidShardError`
    naming the file; with ``"skip"`` the bad shards are left out and listed in
    :attr:`skipped` (file and reason) and logged. A manifest that names a file outside the
    directory always raises :class:`UnsafePathError`. Samples read are checked for NaN/Inf
    (``check_finite``), raising :class:`InvalidShardError` with the file and sample number.

    FP8 datasets: a sample's ``hidden_states`` come back decoded into ``decode_dtype``
    (bfloat16 by default; ``hidden_states_scale`` is left out), so a trainer reads them as
    it reads a bf16 dataset. ``decode_dtype=None`` returns the stored tensors as they are.
    """

    def __init__(self, directory: str | os.PathLike[str], *, on_invalid: str = "raise",
                 verify: str = "header", check_finite: bool = True,
                 decode_dtype: torch.dtype | None = torch.bfloat16) -> None:
        if on_invalid not in ON_INVALID:
            raise ValueError(f"on_invalid must be one of {ON_INVALID}, got {on_invalid!r}")
        if verify not in VERIFY:
            raise ValueError(f"verify must be one of {VERIFY}, got {verify!r}")
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir)
        self.on_invalid = on_invalid
        self.check_finite = check_finite
        self.decode_dtype = decode_dtype
        self.skipped: list[SkippedShard] = []
        where = self.dir / MANIFEST
        paths = [_member(self.dir, s["file"], where) for s in self.manifest.shards]
        pending = self.manifest.pending
        if pending is not None:
            path = _member(self.dir, pending["file"], where)
            # not part of the dataset; but our writer renames it only once complete, so a
            # partial one means a non-atomic writer or a modified file
            if path.is_file() and "bytes" in pending and path.stat().st_size != pending["bytes"]:
                self._invalid(InvalidShardError(
                    path, f"uncommitted shard ('pending' in {MANIFEST}) has {path.stat().st_size} bytes, "
                          f"{MANIFEST} says {pending['bytes']}: written in place or modified"))
        seen: set[Path] = set()
        self._shards: list[tuple[Path, dict[str, Any]]] = []
        for path, entry in zip(paths, self.manifest.shards):
            try:
                if path.resolve() in seen:
                    raise InvalidShardError(path, f"listed twice in {MANIFEST}")
                seen.add(path.resolve())
                check_shard(path, entry, self.manifest, full=verify == "full")
            except InvalidShardError as e:
                self._invalid(e)
                continue
            self._shards.append((path, entry))
        for stray in _stray_shard_files(self.dir, self.manifest):
            self._invalid(InvalidShardError(stray, f"shard file not listed in {MANIFEST}"))
        self._index: list[tuple[int, int]] = [
            (s, j) for s, (_, entry) in enumerate(self._shards) for j in range(entry["num_samples"])
        ]
        self._open: tuple[int, Any] | None = None

    def _invalid(self, e: InvalidShardError) -> None:
        if self.on_invalid == "raise":
            raise e
        log.warning("skipping %s", e)
        self.skipped.append(SkippedShard(e.path, e.reason))

    def __len__(self) -> int:
        return len(self._index)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers: reopen shards lazily
        return {**self.__dict__, "_open": None}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard, j = self._index[i]
        path = self._shards[shard][0]
        if self._open is None or self._open[0] != shard:
            self._open = (shard, safe_open(str(path), framework="pt"))
        f = self._open[1]
        prefix = f"{j}."
        sample = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
        try:
            check_sample(sample, len(self.manifest.layer_ids), self.manifest.hidden_size)
        except DatasetFormatError as e:
            raise InvalidShardError(path, f"sample {j}: {e}") from None
        if self.manifest.is_fp8 and self.decode_dtype is not None:
            sample["hidden_states"] = fp8.decode(sample["hidden_states"], sample.pop(fp8.SCALE_KEY),
                                                 self.decode_dtype)
        if self.check_finite:
            _check_finite(path, j, sample["hidden_states"])
        return sample

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]

    def token_stream(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(input_ids, loss_mask)`` per sample without materialising hidden states."""
        for path, entry in self._shards:
            with safe_open(str(path), framework="pt") as f:
                for j in range(entry["num_samples"]):
                    yield f.get_tensor(f"{j}.input_ids"), f.get_tensor(f"{j}.loss_mask").to(torch.bool)
