"""Extraction over Ray replicas on a real local Ray cluster (CPU): two replicas, one killed
(SIGKILL) while it writes a unit, give the same files as one replica straight through; a
driver that died is resumed by running it again.

The replicas' extractor is the transformers reference on a tiny Llama (a real forward, one
prompt at a time): vLLM does not run on this machine's CPU. The GPU run of the same driver
with vLLM replicas is tests/gpu/test_scale_out_gpu.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from vllm_compat.eagle3 import units as U
from vllm_compat.eagle3.data import HiddenStatesDataset
from vllm_compat.eagle3.distributed import extract_distributed
from vllm_compat.testing.models import build_model
from vllm_compat.testing.replicas import ReplicaKiller

N_RECORDS, PER_UNIT = 40, 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    target = build_model("llama", d / "target", dtype=torch.float32, vocab_size=64,
                         hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32)
    g = torch.Generator().manual_seed(1)
    (d / "prep").mkdir()
    with open(d / "prep" / "prepared.jsonl", "w") as f:
        for i in range(N_RECORDS):
            n = int(torch.randint(4, 30, (1,), generator=g))
            f.write(json.dumps({"line": i + 1, "input_ids": torch.randint(0, 64, (n,), generator=g).tolist(),
                                "loss_mask": [1] * n}) + "\n")
    return {"target": target, "prep": d / "prep"}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _run(tiny, out, replicas, on_event=None):
    return extract_distributed(tiny["target"], tiny["prep"], out, [1, 2, 3], replicas=replicas,
                               backend="transformers", dtype=torch.float8_e4m3fn,
                               samples_per_shard=1, samples_per_unit=PER_UNIT, on_event=on_event)


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_a_replica_killed_mid_unit_is_restarted_and_the_bytes_equal_one_replicas(tiny, cluster, tmp_path):
    ref = tmp_path / "one"
    m = _run(tiny, ref, 1)
    assert m.num_samples == N_RECORDS and len(m.shards) == N_RECORDS
    assert len(HiddenStatesDataset(ref)) == N_RECORDS

    out = tmp_path / "two"
    killer = ReplicaKiller(out, replica=1)
    events, killed = killer.events, killer.killed
    m2 = _run(tiny, out, 2, killer)
    assert killed.get("pid") and killed["shards_then"] >= 1, "the replica was not killed mid-unit"
    died = [e for e in events if e["event"] == "replica_died"]
    assert [(e["replica"], e["unit"], e["restarting"]) for e in died] == [(1, killed["unit"], True)]
    done = [e for e in events if e["event"] == "unit_done"]
    assert sorted(e["unit"] for e in done) == list(range(N_RECORDS // PER_UNIT))
    # Ray restarts the killed replica; whether it is back before replica 0 has done the
    # rest is a matter of timing, but it never reports a unit from the killed process
    assert killed["pid"] not in {e["pid"] for e in done}
    assert [e["replica"] for e in events if e.get("restarted")] in ([], [1])
    assert m2.to_json() == m.to_json()
    assert _files(out) == _files(ref)  # every shard, unit manifest and the merged manifest

    # the whole job dies: a finished unit lost, a partial one left; running again resumes
    shutil.rmtree(out / "units" / "unit-00002")
    os.makedirs(out / "units" / "unit-00003.partial-dead")
    (out / "manifest.json").unlink()
    resumed = [e for e in events if e["event"] == "unit_done"]
    events.clear()
    _run(tiny, out, 2, killer)
    assert sorted(e["unit"] for e in events if e["event"] == "unit_done") == [2]
    assert _files(out) == _files(ref) and resumed
    events.clear()
    _run(tiny, out, 2, killer)  # nothing left: no replica starts, the manifest is rewritten
    assert events == [] and _files(out) == _files(ref)
    assert U.read_plan(out)[2]["num_records"] == N_RECORDS


def test_the_cli_extracts_over_replicas(tiny, cluster, tmp_path, capsys):
    from vllm_compat.eagle3.cli import main

    out = tmp_path / "cli"
    assert main(["eagle3", "extract", str(tiny["prep"]), "--target", tiny["target"], "-o", str(out),
                 "--aux-layer-ids", "1", "2", "3", "--backend", "transformers", "--dtype", "float32",
                 "--samples-per-shard", "4", "--replicas", "2", "--samples-per-unit", "16"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
        "samples": N_RECORDS, "shards": 4 + 4 + 2, "output": str(out)}
    assert [(u.start, u.stop) for u in U.read_plan(out)[0]] == [(0, 16), (16, 32), (32, 40)]
    assert HiddenStatesDataset(out).manifest.dtype == "float32"
