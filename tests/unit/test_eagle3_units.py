"""Extraction in work units (what replicas write): the deterministic split, one unit's
extraction, resume after a dead writer, and the merged manifest the trainer reads.

The extractor is the transformers reference on a tiny Llama on the CPU: a real forward,
one prompt at a time (vLLM does not run on this machine's CPU). The Ray driver over these
functions is tested in test_eagle3_distributed.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from vllm_compat.eagle3 import units as U
from vllm_compat.eagle3.data import DatasetFormatError, HiddenStatesDataset
from vllm_compat.eagle3.extract_step import extract_dataset
from vllm_compat.eagle3.hf_reference import TransformersExtractor
from vllm_compat.testing.models import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama and 11 prepared records (blank lines between some, as prepare may leave)."""
    d = tmp_path_factory.mktemp("units")
    target = build_model("llama", d / "target", dtype=torch.float32, vocab_size=64,
                         hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32)
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(11):
        n = int(torch.randint(3, 12, (1,), generator=g))
        ids = torch.randint(0, 64, (n,), generator=g).tolist()
        lines.append(json.dumps({"line": i + 1, "input_ids": ids, "loss_mask": [1] * n}) + "\n")
        if i in (2, 7):
            lines.append("\n")
    (d / "prep").mkdir()
    (d / "prep" / "prepared.jsonl").write_text("".join(lines))
    return {"target": target, "prep": d / "prep", "dir": d}


def _spec(tiny, dtype="float32", per=2):
    from vllm_compat.target import read_target
    t = read_target(tiny["target"])
    return U.UnitSpec(t.hidden_size, (1, 2, 3), t.num_hidden_layers, dtype, per,
                      t.manifest_entry())


def _files(d: Path) -> dict[str, bytes]:
    """Every shard and manifest under ``d`` by relative path (lock files aside)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_the_split_depends_only_on_the_records_and_the_unit_size(tiny, tmp_path):
    n, size, units = U.scan_records(tiny["prep"], 4)
    assert n == 11 and size == (tiny["prep"] / "prepared.jsonl").stat().st_size
    assert [(u.start, u.stop) for u in units] == [(0, 4), (4, 8), (8, 11)]
    assert U.scan_records(tiny["prep"], 4) == (n, size, units)  # deterministic
    rows = [json.loads(x) for x in (tiny["prep"] / "prepared.jsonl").read_text().splitlines() if x]
    for u in units:  # each unit reads exactly its records, from its byte offset
        got = U.read_unit_records(tiny["prep"], u)
        assert [ids.tolist() for ids, _ in got] == [r["input_ids"] for r in rows[u.start:u.stop]]
    assert [(u.start, u.stop) for u in U.scan_records(tiny["prep"], 5)[2]] == [(0, 5), (5, 10), (10, 11)]
    with pytest.raises(ValueError):
        U.scan_records(tiny["prep"], 0)

    spec = _spec(tiny)
    assert U.write_plan(tmp_path / "out", tiny["prep"], 4, spec) == units
    assert U.write_plan(tmp_path / "out", tiny["prep"], 4, spec) == units  # a resume: same plan
    with pytest.raises(DatasetFormatError, match="samples_per_unit"):
        U.write_plan(tmp_path / "out", tiny["prep"], 5, spec)
    with pytest.raises(DatasetFormatError, match="spec"):
        U.write_plan(tmp_path / "out", tiny["prep"], 4, _spec(tiny, dtype="bfloat16"))
    assert U.read_plan(tmp_path / "out")[:2] == (units, spec)


def test_units_in_any_order_merge_to_the_single_machine_dataset(tiny, tmp_path):
    """Units written in reverse order, merged: the same samples, in record order, as
    extract_dataset on one machine; the trainer's reader takes the merged manifest."""
    spec = _spec(tiny)
    out = tmp_path / "units"
    units = U.write_plan(out, tiny["prep"], 4, spec)
    with TransformersExtractor(tiny["target"], spec.layer_ids) as ex:
        for u in reversed(units):
            res = U.write_unit(ex, tiny["prep"], out, u, spec)
            assert res["samples"] == u.stop - u.start and U.is_finished(out, u)
        assert U.write_unit(ex, tiny["prep"], out, units[0], spec) == {"unit": 0, "skipped": True}
    merged = U.merge_units(out)
    assert merged.num_samples == 11 and len(merged.shards) == 2 + 2 + 2
    assert merged.shards[0]["file"] == "units/unit-00000/shard-00000.safetensors"
    ds = HiddenStatesDataset(out, verify="full")
    extract_dataset(tiny["target"], tiny["prep"], tmp_path / "single", [1, 2, 3],
                    backend="transformers", dtype=torch.float32, samples_per_shard=2, progress=False)
    ref = HiddenStatesDataset(tmp_path / "single")
    assert len(ds) == len(ref) == 11
    for a, b in zip(ds, ref):
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["hidden_states"], b["hidden_states"])
    assert ds.manifest.layer_ids == ref.manifest.layer_ids == [1, 2, 3, 4]


def test_a_dead_writers_partial_unit_is_recomputed_to_the_same_bytes(tiny, tmp_path):
    """A unit whose writer died (a partial directory with a shard in it) is not finished;
    the retry deletes it and writes the bytes an uninterrupted run writes."""
    spec = _spec(tiny, dtype="float8_e4m3fn")
    ref, out = tmp_path / "ref", tmp_path / "out"
    with TransformersExtractor(tiny["target"], spec.layer_ids, states_dtype=FP8) as ex:
        for d in (ref, out):
            U.write_plan(d, tiny["prep"], 4, spec)
        units = U.read_plan(ref)[0]
        for u in units:
            U.write_unit(ex, tiny["prep"], ref, u, spec)
        U.merge_units(ref)

        class Dies:  # the extractor of a replica killed after its first shard
            def extract(self, prompts):
                for i, s in enumerate(ex.extract(prompts)):
                    if i == 2:
                        raise KeyboardInterrupt("replica killed")
                    yield s

        U.write_unit(ex, tiny["prep"], out, units[0], spec)
        with pytest.raises(KeyboardInterrupt):
            U.write_unit(Dies(), tiny["prep"], out, units[1], spec)
        partial = [p for p in (out / "units").iterdir() if ".partial-" in p.name]
        assert [p.name.split(".")[0] for p in partial] == ["unit-00001"]
        assert (partial[0] / "shard-00000.safetensors").is_file()
        assert not U.is_finished(out, units[1])
        with pytest.raises(DatasetFormatError, match="unit-00001 is not finished"):
            U.merge_units(out)
        for u in units[1:]:  # the retry
            U.write_unit(ex, tiny["prep"], out, u, spec)
    assert not [p for p in (out / "units").iterdir() if ".partial-" in p.name]
    U.merge_units(out)
    assert _files(out) == _files(ref)
    man = json.loads((out / "manifest.json").read_text())
    assert man["dtype"] == "float8_e4m3fn" and man["format_version"] == 2
    assert HiddenStatesDataset(out)[5]["hidden_states"].dtype == torch.bfloat16


def test_merge_refuses_a_unit_that_disagrees_with_the_split(tiny, tmp_path):
    spec = _spec(tiny)
    out = tmp_path / "out"
    units = U.write_plan(out, tiny["prep"], 6, spec)
    with TransformersExtractor(tiny["target"], spec.layer_ids) as ex:
        for u in units:
            U.write_unit(ex, tiny["prep"], out, u, spec)
    m = json.loads((out / "units" / "unit-00001" / "manifest.json").read_text())
    m["shards"] = m["shards"][:-1]  # a unit missing a shard
    (out / "units" / "unit-00001" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatasetFormatError, match="unit-00001: 4 samples, the split says 5"):
        U.merge_units(out)
    assert not (out / "manifest.json").exists()
    assert U.remove_partials(out) == []
    os.makedirs(out / "units" / "unit-00000.partial-abc")
    assert U.remove_partials(out, units[1]) == [] and U.remove_partials(out) == ["unit-00000.partial-abc"]
