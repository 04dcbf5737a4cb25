"""Draft vocabulary: the most frequent loss-masked tokens, as vLLM's EAGLE-3 loader reads them.

- ``d2t`` int64 ``[draft_vocab]``: offsets, ``target_id = draft_id + d2t[draft_id]``
  (vLLM loads it into ``draft_id_to_target_id`` and scatters draft logits to
  ``arange(draft_vocab) + d2t``).
- ``t2d`` bool ``[target_vocab]``: True exactly on the target ids in the draft vocabulary
  (vLLM skips it when loading; speculators and validators use it).

Draft ids are assigned in increasing target-id order, so ``d2t`` is non-decreasing and
non-negative. When fewer distinct tokens were seen than ``draft_vocab_size`` the rest is
filled with the lowest unused target ids (as speculators does).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEFAULT_DRAFT_VOCAB_SIZE = 32000
VOCAB_FILE = "vocab.safetensors"


@dataclass
class VocabMapping:
    d2t: torch.Tensor  # int64 [draft_vocab]
    t2d: torch.Tensor  # bool [target_vocab]
    counts: torch.Tensor  # int64 [target_vocab]: loss-masked occurrences of each target id

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def draft_to_target_ids(self) -> torch.Tensor:
        return torch.arange(self.draft_vocab_size) + self.d2t

    @property
    def coverage(self) -> float:
        """Fraction of loss-masked target tokens that the draft vocabulary can emit."""
        total = int(self.counts.sum())
        return float(self.counts[self.t2d].sum()) / total if total else 0.0

    def target_to_draft_ids(self) -> torch.Tensor:
        """int64 ``[target_vocab]``: the draft id of each target id, -1 where it has none."""
        out = torch.full((self.target_vocab_size,), -1, dtype=torch.int64)
        out[self.draft_to_target_ids] = torch.arange(self.draft_vocab_size)
        return out

    def save(self, directory: str | os.PathLike[str]) -> Path:
        path = Path(directory) / VOCAB_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"d2t": self.d2t, "t2d": self.t2d, "counts": self.counts}, str(tmp))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> VocabMapping:
        p = Path(path)
        t = load_file(str(p / VOCAB_FILE if p.is_dir() else p))
        return cls(d2t=t["d2t"], t2d=t["t2d"], counts=t["counts"])


def count_tokens(
    stream: Iterable[tuple[torch.Tensor, torch.Tensor]], target_vocab_size: int
) -> torch.Tensor:
    """Occurrences of each target id at loss-masked positions of ``(input_ids, loss_mask)`` pairs."""
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    for ids, mask in stream:
        picked = ids[mask.to(torch.bool)].to(torch.int64)
        if picked.numel() and int(picked.max()) >= target_vocab_size:
            raise ValueError(f"token id {int(picked.max())} >= target vocab size {target_vocab_size}")
        counts += torch.bincount(picked, minlength=target_vocab_size)
    return counts


def build_mapping(counts: torch.Tensor, draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE) -> VocabMapping:
    """Top-``draft_vocab_size`` ids by count (ties: lower id first), capped at the target vocab."""
    target_vocab_size = int(counts.shape[0])
    size = min(draft_vocab_size, target_vocab_size)
    by_freq = sorted(Counter({i: int(c) for i, c in enumerate(counts.tolist()) if c}).items(),
                     key=lambda kv: (-kv[1], kv[0]))
    chosen = [i for i, _ in by_freq[:size]]
    if len(chosen) < size:  # pad with the lowest ids not yet chosen
        seen = set(chosen)
        chosen += [i for i in range(target_vocab_size) if i not in seen][: size - len(chosen)]
    ids = torch.tensor(sorted(chosen), dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return VocabMapping(d2t=ids - torch.arange(size), t2d=t2d, counts=counts.to(torch.int64))


def build_vocab(
    dataset_dir: str | os.PathLike[str],
    target_vocab_size: int,
    *,
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    output_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> VocabMapping:
    """Count loss-masked tokens of a dataset (hidden-state shards or ``prepare`` output) and map them."""
    from .prepare import iter_token_records

    stream = iter_token_records(dataset_dir)
    if progress:
        from tqdm import tqdm

        stream = tqdm(stream, desc="vocab", unit="sample")
    mapping = build_mapping(count_tokens(stream, target_vocab_size), draft_vocab_size)
    if output_dir is not None:
        mapping.save(output_dir)
    return mapping
