"""A dataset extracted in work units, so that many replicas can write it and a dead one costs
one unit: the split, one unit's extraction, and the merged manifest the trainer reads.

Layout of the output directory::

    units.json                         the split (written first; a resume must find the same)
    units/unit-00000/manifest.json     unit 0: its own dataset (ShardWriter), records [0, U)
    units/unit-00000/shard-00000.safetensors ...
    units/unit-00001/...
    manifest.json                      written last by merge_units(): every unit's shards,
                                       in unit order; HiddenStatesDataset reads the whole

Unit ``k`` holds the records ``[k * U, (k + 1) * U)`` of the ``prepare`` output (``U`` =
``samples_per_unit``), so the split depends only on the records and ``U``, not on how many
replicas run or which one takes which unit. A unit is written under
``units/unit-0000k.partial-<id>`` and renamed to ``units/unit-0000k`` once every file in it
is durable; a finished unit is a directory with that name. A replica that dies leaves a
partial directory, which the retry (or the next run) deletes and recomputes: resuming costs
at most one unit per dead replica.

Each unit is extracted from an idle engine (the extractor drains at the end of every
``extract`` call), with its prompts in record order. Batching is then a function of the
unit alone, so the same unit gives the same bytes whichever replica computes it, after
whatever units: a run over N replicas with kills and resumes writes the same shards as one
replica straight through (on the same hardware and engine settings, KV-cache size
included). The cost is the engine's drain at every unit boundary: the last steps of a unit
run with fewer tokens than the batch holds, about one step's worth of tokens per unit
(``max_num_batched_tokens / tokens per unit``, ~3 % for 512k-token units at 16k-token
steps).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..locking import atomic_write_bytes
from .data import (
    MANIFEST,
    BackgroundShardWriter,
    DatasetFormatError,
    Manifest,
    ShardWriter,
    read_manifest,
)
from .prepare import PREPARED

PLAN = "units.json"
UNITS = "units"
PLAN_FORMAT = "vllm-compat-eagle3-units"
_PARTIAL = ".partial-"


@dataclass(frozen=True)
class WorkUnit:
    """Records ``[start, stop)`` of the ``prepare`` output; ``offset``: the byte where record
    ``start`` begins in ``prepared.jsonl`` (a replica reads only its unit)."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def name(self) -> str:
        return f"unit-{self.index:05d}"


def scan_records(records_dir: str | os.PathLike[str], samples_per_unit: int
                 ) -> tuple[int, int, list[WorkUnit]]:
    """``(records, bytes, units)`` of ``records_dir/prepared.jsonl``: one pass over the bytes
    (no JSON parsing), recording where each unit's first record starts."""
    if samples_per_unit < 1:
        raise ValueError(f"samples_per_unit must be >= 1, got {samples_per_unit}")
    path = Path(records_dir) / PREPARED
    if not path.is_file():
        raise FileNotFoundError(f"{path}: extraction in units reads a prepare output directory")
    starts: list[int] = []
    n = pos = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                if n % samples_per_unit == 0:
                    starts.append(pos)
                n += 1
            pos += len(line)
    units = [WorkUnit(k, k * samples_per_unit, min(n, (k + 1) * samples_per_unit), off)
             for k, off in enumerate(starts)]
    return n, pos, units


def read_unit_records(records_dir: str | os.PathLike[str], unit: WorkUnit
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, loss_mask)`` of the unit's records, read from its byte offset."""
    out = []
    with open(Path(records_dir) / PREPARED, "rb") as f:
        f.seek(unit.offset)
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            out.append((torch.tensor(row["input_ids"], dtype=torch.int64),
                        torch.tensor(row["loss_mask"], dtype=torch.bool)))
            if len(out) == unit.stop - unit.start:
                break
    if len(out) != unit.stop - unit.start:
        raise DatasetFormatError(f"{records_dir}: {unit.name} expected {unit.stop - unit.start} "
                                 f"records from byte {unit.offset}, found {len(out)} (changed?)")
    return out


@dataclass(frozen=True)
class UnitSpec:
    """What every unit's dataset is: the same for every replica and every run."""

    hidden_size: int
    aux_layer_ids: tuple[int, ...]
    final_layer_id: int
    dtype: str
    samples_per_shard: int
    target: dict[str, Any]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def layer_ids(self) -> list[int]:
        return [*self.aux_layer_ids, self.final_layer_id]


def write_plan(output_dir: str | os.PathLike[str], records_dir: str | os.PathLike[str],
               samples_per_unit: int, spec: UnitSpec) -> list[WorkUnit]:
    """Split the records into units and record the split in ``units.json``; an existing
    ``units.json`` must describe the same split and dataset (else
    :class:`DatasetFormatError`: a resume would mix two datasets)."""
    out = Path(output_dir)
    n, size, units = scan_records(records_dir, samples_per_unit)
    spec_json: dict[str, Any] = dict(asdict(spec), aux_layer_ids=list(spec.aux_layer_ids))
    plan = {"format": PLAN_FORMAT, "format_version": 1,
            "records": str(Path(records_dir).resolve()), "num_records": n, "records_bytes": size,
            "samples_per_unit": samples_per_unit, "spec": spec_json,
            "units": [[u.start, u.stop, u.offset] for u in units]}
    path = out / PLAN
    if path.is_file():
        have = json.loads(path.read_text())
        if have != plan:
            diff = sorted(k for k in plan if have.get(k) != plan[k])
            raise DatasetFormatError(
                f"{path} describes another split or dataset (differs in {diff}); use a new "
                "output directory, or the same records, samples_per_unit and settings")
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(plan, indent=1).encode())
    (out / UNITS).mkdir(exist_ok=True)
    return units


def read_plan(output_dir: str | os.PathLike[str]) -> tuple[list[WorkUnit], UnitSpec, dict[str, Any]]:
    plan = json.loads((Path(output_dir) / PLAN).read_text())
    if plan.get("format") != PLAN_FORMAT:
        raise DatasetFormatError(f"{output_dir}/{PLAN}: not a {PLAN_FORMAT} file")
    spec = dict(plan["spec"], aux_layer_ids=tuple(plan["spec"]["aux_layer_ids"]))
    units = [WorkUnit(k, a, b, off) for k, (a, b, off) in enumerate(plan["units"])]
    return units, UnitSpec(**spec), plan


def unit_dir(output_dir: str | os.PathLike[str], unit: WorkUnit) -> Path:
    return Path(output_dir) / UNITS / unit.name


def is_finished(output_dir: str | os.PathLike[str], unit: WorkUnit) -> bool:
    """The unit's directory exists (renamed into place only once complete and durable)."""
    return (unit_dir(output_dir, unit) / MANIFEST).is_file()


def remove_partials(output_dir: str | os.PathLike[str], unit: WorkUnit | None = None) -> list[str]:
    """Delete what dead writers left (of ``unit``, or of every unit); returns the names."""
    root = Path(output_dir) / UNITS
    pattern = f"{unit.name}{_PARTIAL}*" if unit is not None else f"unit-*{_PARTIAL}*"
    gone = []
    for p in sorted(root.glob(pattern)):
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p.name)
    return gone


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_unit(extractor: Any, records_dir: str | os.PathLike[str],
               output_dir: str | os.PathLike[str], unit: WorkUnit, spec: UnitSpec,
               max_queue: int = 64) -> dict[str, Any]:
    """Extract ``unit`` with ``extractor`` (``extract(prompts)`` yielding samples in input
    order, as :class:`~vllm_compat.extract.HiddenStatesExtractor`) into its own dataset
    directory, renamed into place once durable. Returns the unit's counts."""
    final = unit_dir(output_dir, unit)
    if (final / MANIFEST).is_file():
        return {"unit": unit.index, "skipped": True}
    remove_partials(output_dir, unit)  # a dead attempt's files
    tmp = final.with_name(f"{unit.name}{_PARTIAL}{uuid.uuid4().hex[:12]}")
    records = read_unit_records(records_dir, unit)
    writer = BackgroundShardWriter(ShardWriter(
        tmp, hidden_size=spec.hidden_size, aux_layer_ids=list(spec.aux_layer_ids),
        final_layer_id=spec.final_layer_id, dtype=spec.torch_dtype,
        samples_per_shard=spec.samples_per_shard, target=spec.target), max_queue=max_queue)
    try:
        for s in extractor.extract(ids.tolist() for ids, _ in records):
            ids, mask = records[s.index]
            writer.add({"input_ids": ids, "loss_mask": mask, **s.states()})
    finally:
        manifest = writer.close()
    if manifest.num_samples != len(records):
        raise RuntimeError(f"{unit.name}: {manifest.num_samples} samples written, "
                           f"{len(records)} records")
    try:
        os.rename(tmp, final)  # atomic; fails if another attempt finished first (same bytes)
    except OSError:
        if not (final / MANIFEST).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    _fsync_dir(final.parent)
    return {"unit": unit.index, "samples": manifest.num_samples, "tokens": manifest.num_tokens,
            "shards": len(manifest.shards), "busy_s": dict(writer.busy)}


def iter_unit_manifests(output_dir: str | os.PathLike[str], units: list[WorkUnit]
                        ) -> Iterator[tuple[WorkUnit, Manifest]]:
    for u in units:
        if not is_finished(output_dir, u):
            raise DatasetFormatError(f"{unit_dir(output_dir, u)}: {u.name} is not finished")
        yield u, read_manifest(unit_dir(output_dir, u))


def merge_units(output_dir: str | os.PathLike[str]) -> Manifest:
    """Write ``manifest.json``: every unit's shards in unit order (paths ``units/<unit>/<shard>``,
    sizes and digests as the units recorded them). Every unit must be finished and agree
    with the split's dataset description."""
    out = Path(output_dir)
    units, spec, _ = read_plan(out)
    merged = Manifest(spec.hidden_size, list(spec.aux_layer_ids), spec.final_layer_id,
                      spec.dtype, target=dict(spec.target))
    for u, m in iter_unit_manifests(out, units):
        if (m.hidden_size, m.layer_ids, m.dtype) != (spec.hidden_size, spec.layer_ids, spec.dtype):
            raise DatasetFormatError(f"{unit_dir(out, u)}: hidden_size={m.hidden_size} "
                                     f"layers={m.layer_ids} dtype={m.dtype}, the split says "
                                     f"{spec.hidden_size} {spec.layer_ids} {spec.dtype}")
        if m.num_samples != u.stop - u.start:
            raise DatasetFormatError(f"{unit_dir(out, u)}: {m.num_samples} samples, the split "
                                     f"says {u.stop - u.start}")
        for s in m.shards:
            merged.shards.append(dict(s, file=f"{UNITS}/{u.name}/{s['file']}"))
    atomic_write_bytes(out / MANIFEST, json.dumps(merged.to_json(), indent=1).encode())
    return merged
