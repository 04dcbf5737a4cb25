"""A text corpus that ships with Python: the standard library's own ``.py`` files.

:func:`build_corpus` collects the ``.py`` files under the running interpreter's stdlib
directory (``sysconfig.get_paths()["stdlib"]``, never ``site-packages`` / ``dist-packages``),
in sorted order, and splits them *by file* into train and held-out sets: a file is held out
when the SHA-256 of its relative path (plus an optional salt) falls below
``eval_fraction`` -- the same split on every machine with the same Python version,
independent of file order or count.

Written to ``output_dir``:

- ``train_docs.jsonl`` / ``eval_docs.jsonl``: one file per line, ``{"path", "text"}``
  (the target model is trained on whole files);
- ``train.jsonl`` / ``eval.jsonl``: the files cut at line boundaries into chunks of at most
  ``chunk_chars`` characters, in ``prepare``'s completion format
  (``{"prompt": "", "completion": chunk, "path", "chunk"}``: every token is trained on);
- ``train.txt``: the training files' text, for tokenizer training;
- ``corpus_report.json``: file counts, bytes, chunks, skipped files by reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRAIN_DOCS = "train_docs.jsonl"
EVAL_DOCS = "eval_docs.jsonl"
TRAIN_CHUNKS = "train.jsonl"
EVAL_CHUNKS = "eval.jsonl"
TRAIN_TEXT = "train.txt"
REPORT = "corpus_report.json"
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})


@dataclass
class CorpusReport:
    root: str
    python_version: str
    eval_fraction: float
    salt: str
    include_tests: bool
    chunk_chars: int
    files_train: int = 0
    files_eval: int = 0
    bytes_train: int = 0
    bytes_eval: int = 0
    chunks_train: int = 0
    chunks_eval: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    eval_paths_sample: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike[str] | None = None, *, include_tests: bool = True) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every ``.py`` file under ``root``, sorted by the
    relative path; ``site-packages``, ``dist-packages`` and ``__pycache__`` are skipped,
    and test directories (``test``, ``tests``, ``idle_test``) unless ``include_tests``."""
    base = Path(root) if root is not None else stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = Path(dirpath).relative_to(base)
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS
                             and (include_tests or d not in TEST_DIRS))
        for name in filenames:
            if name.endswith(".py"):
                p = Path(dirpath) / name
                if p.is_file():
                    out.append(((rel_dir / name).as_posix(), p))
    out.sort(key=lambda x: x[0])
    return out


def is_heldout(rel_path: str, eval_fraction: float, salt: str = "") -> bool:
    """Deterministic per-file split: the first 8 bytes of SHA-256(salt + path) as a number in [0, 1)."""
    h = hashlib.sha256((salt + rel_path).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64 < eval_fraction


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` at line ends into pieces of at most ``max_chars`` characters (a longer
    line is cut inside); whitespace-only pieces are dropped. Joining the pieces gives
    ``text`` back except for the dropped whitespace."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    chunks: list[str] = []
    cur: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:  # a very long line: flush, then cut it
            if cur:
                chunks.append("".join(cur))
                cur, size = [], 0
            chunks.append(line[:max_chars])
            line = line[max_chars:]
        if size + len(line) > max_chars and cur:
            chunks.append("".join(cur))
            cur, size = [], 0
        cur.append(line)
        size += len(line)
    if cur:
        chunks.append("".join(cur))
    return [c for c in chunks if c.strip()]


def _read(path: Path, max_file_bytes: int) -> tuple[str | None, str | None]:
    """``(text, None)`` or ``(None, skip reason)``."""
    try:
        data = path.read_bytes()
    except OSError:
        return None, "unreadable"
    if len(data) > max_file_bytes:
        return None, "too_large"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"  # the stdlib's tests ship deliberately mis-encoded files
    if "\x00" in text:
        return None, "binary"
    if not text.strip():
        return None, "empty"
    return text, None


def build_corpus(
    output_dir: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    eval_fraction: float = 0.05,
    salt: str = "",
    include_tests: bool = True,
    chunk_chars: int = 2048,
    max_file_bytes: int = 1 << 20,
    max_files: int | None = None,
) -> CorpusReport:
    """Write the train / held-out files of the stdlib (or of ``root``) into ``output_dir``.

    ``max_files`` keeps the first files in sorted order (tests). At least one file is held
    out: if the hash puts none there, the file with the smallest hash is."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    base = Path(root) if root is not None else stdlib_root()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = CorpusReport(root=str(base), python_version=sys.version.split()[0], eval_fraction=eval_fraction,
                       salt=salt, include_tests=include_tests, chunk_chars=chunk_chars)
    files = stdlib_files(base, include_tests=include_tests)
    if max_files is not None:
        files = files[:max_files]
    docs: list[tuple[str, str]] = []
    skipped: dict[str, int] = {}
    for rel, path in files:
        text, why = _read(path, max_file_bytes)
        if text is None:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            docs.append((rel, text))
    if len(docs) < 2:
        raise ValueError(f"{base}: {len(docs)} usable .py files, need at least 2 (one to hold out)")
    held = {rel for rel, _ in docs if is_heldout(rel, eval_fraction, salt)}
    if not held:
        held = {min((rel for rel, _ in docs),
                    key=lambda r: hashlib.sha256((salt + r).encode()).digest())}
    if len(held) == len(docs):
        raise ValueError("every file was held out; lower eval_fraction")
    tmp = {name: out / (name + ".tmp") for name in (TRAIN_DOCS, EVAL_DOCS, TRAIN_CHUNKS, EVAL_CHUNKS, TRAIN_TEXT)}
    with tmp[TRAIN_DOCS].open("w") as td, tmp[EVAL_DOCS].open("w") as ed, \
            tmp[TRAIN_CHUNKS].open("w") as tc, tmp[EVAL_CHUNKS].open("w") as ec, \
            tmp[TRAIN_TEXT].open("w") as tt:
        for rel, text in docs:
            ev = rel in held
            (ed if ev else td).write(json.dumps({"path": rel, "text": text}) + "\n")
            chunks = chunk_text(text, chunk_chars)
            for i, c in enumerate(chunks):
                (ec if ev else tc).write(json.dumps({"prompt": "", "completion": c, "path": rel, "chunk": i}) + "\n")
            n_bytes = len(text.encode())
            if ev:
                rep.files_eval += 1
                rep.bytes_eval += n_bytes
                rep.chunks_eval += len(chunks)
            else:
                rep.files_train += 1
                rep.bytes_train += n_bytes
                rep.chunks_train += len(chunks)
                tt.write(text if text.endswith("\n") else text + "\n")
    for name, p in tmp.items():
        os.replace(p, out / name)
    rep.skipped = dict(sorted(skipped.items()))
    rep.eval_paths_sample = sorted(held)[:20]
    (out / REPORT).write_text(json.dumps(rep.to_json(), indent=1))
    return rep


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
