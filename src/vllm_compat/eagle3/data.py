"""Hidden-state dataset on disk: safetensors shards plus a ``manifest.json``.

One sample is a dict of tensors:

- ``input_ids``     int64 ``[T]``
- ``loss_mask``     bool  ``[T]`` (True on tokens the draft is trained to predict)
- ``hidden_states`` ``[T, n_aux + 1, H]``: the auxiliary layers in ``aux_layer_ids`` order,
  then the final layer ``L`` (the target's last decoder output, *before* its final norm).

Any other tensor in a sample is stored and returned as is. Layer ids follow vLLM's
convention: id ``k`` is the state *entering* decoder layer ``k``; ``L`` is the final state.

The writer is append-only and crash-safe: a shard is written to a temporary name and
renamed, then the manifest is rewritten the same way, so a reader (or a resumed writer)
only ever sees complete shards. Nothing is unpickled: tensors go through safetensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "vllm-compat-eagle3-hidden-states"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REQUIRED_KEYS = ("input_ids", "loss_mask", "hidden_states")


class DatasetFormatError(ValueError):
    """A dataset directory or sample that does not follow the format above."""


@dataclass
class Manifest:
    hidden_size: int
    aux_layer_ids: list[int]
    final_layer_id: int
    dtype: str = "bfloat16"
    shards: list[dict[str, Any]] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)  # e.g. name_or_path, vocab_size

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

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "hidden_size": self.hidden_size, "aux_layer_ids": self.aux_layer_ids,
            "final_layer_id": self.final_layer_id, "dtype": self.dtype,
            "num_samples": self.num_samples, "num_tokens": self.num_tokens,
            "target": self.target, "shards": self.shards,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        if d.get("format") != FORMAT or d.get("format_version") != FORMAT_VERSION:
            raise DatasetFormatError(
                f"not a {FORMAT} v{FORMAT_VERSION} manifest "
                f"(format={d.get('format')!r}, version={d.get('format_version')!r})"
            )
        return cls(
            hidden_size=int(d["hidden_size"]), aux_layer_ids=[int(i) for i in d["aux_layer_ids"]],
            final_layer_id=int(d["final_layer_id"]), dtype=d.get("dtype", "bfloat16"),
            shards=list(d["shards"]), target=dict(d.get("target") or {}),
        )


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DatasetFormatError(f"{directory}: no {MANIFEST} (not a dataset directory)")
    return Manifest.from_json(json.loads(path.read_text()))


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_sample(sample: dict[str, torch.Tensor], n_layers: int, hidden_size: int) -> None:
    """Raise :class:`DatasetFormatError` unless ``sample`` has the documented shapes."""
    missing = [k for k in REQUIRED_KEYS if k not in sample]
    if missing:
        raise DatasetFormatError(f"sample lacks {missing}")
    ids, mask, hs = sample["input_ids"], sample["loss_mask"], sample["hidden_states"]
    t = ids.shape[0] if ids.dim() == 1 else -1
    if ids.dim() != 1 or t == 0:
        raise DatasetFormatError(f"input_ids must be a non-empty 1-D tensor, got {tuple(ids.shape)}")
    if tuple(mask.shape) != (t,):
        raise DatasetFormatError(f"loss_mask shape {tuple(mask.shape)} != input_ids shape ({t},)")
    if tuple(hs.shape) != (t, n_layers, hidden_size):
        raise DatasetFormatError(
            f"hidden_states shape {tuple(hs.shape)} != (T, n_aux + 1, H) = ({t}, {n_layers}, {hidden_size})"
        )


class ShardWriter:
    """Append samples to a dataset directory; reopening an existing one continues it."""

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
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.samples_per_shard = samples_per_shard
        wanted = Manifest(hidden_size, list(aux_layer_ids), final_layer_id,
                          str(dtype).removeprefix("torch."), target=dict(target or {}))
        if (self.dir / MANIFEST).exists():
            have = read_manifest(self.dir)
            if (have.hidden_size, have.layer_ids) != (wanted.hidden_size, wanted.layer_ids):
                raise DatasetFormatError(
                    f"{self.dir} holds hidden_size={have.hidden_size} layers={have.layer_ids}; "
                    f"cannot append hidden_size={hidden_size} layers={wanted.layer_ids}"
                )
            self.manifest = have
        else:
            self.manifest = wanted
            self._write_manifest()
        self._pending: list[dict[str, torch.Tensor]] = []

    @property
    def num_samples(self) -> int:
        """Samples already on disk plus those buffered for the next shard."""
        return self.manifest.num_samples + len(self._pending)

    def add(self, sample: dict[str, torch.Tensor]) -> None:
        check_sample(sample, len(self.manifest.layer_ids), self.manifest.hidden_size)
        self._pending.append(sample)
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
                tensors[f"{i}.{k}"] = v.detach().cpu().contiguous()
        tmp = self.dir / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, self.dir / name)
        self.manifest.shards.append({
            "file": name, "num_samples": len(self._pending),
            "num_tokens": int(sum(s["input_ids"].shape[0] for s in self._pending)),
        })
        self._pending = []
        self._write_manifest()

    def close(self) -> Manifest:
        self.flush()
        return self.manifest

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_manifest(self) -> None:
        _atomic_write_text(self.dir / MANIFEST, json.dumps(self.manifest.to_json(), indent=1))


class HiddenStatesDataset(torch.utils.data.Dataset):
    """Random access over a dataset directory; keeps the most recently used shard open."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.manifest = read_manifest(self.dir)
        self._index: list[tuple[int, int]] = [
            (s, j) for s, shard in enumerate(self.manifest.shards) for j in range(shard["num_samples"])
        ]
        self._open: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard, j = self._index[i]
        if self._open is None or self._open[0] != shard:
            path = self.dir / self.manifest.shards[shard]["file"]
            self._open = (shard, safe_open(str(path), framework="pt"))
        f = self._open[1]
        prefix = f"{j}."
        sample = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
        check_sample(sample, len(self.manifest.layer_ids), self.manifest.hidden_size)
        return sample

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]

    def token_stream(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(input_ids, loss_mask)`` per sample without materialising hidden states."""
        for shard in self.manifest.shards:
            with safe_open(str(self.dir / shard["file"]), framework="pt") as f:
                for j in range(shard["num_samples"]):
                    yield f.get_tensor(f"{j}.input_ids"), f.get_tensor(f"{j}.loss_mask").to(torch.bool)
