"""Extraction over two vLLM replicas on one GPU through Ray, the code path of N nodes: two
engines share the GPU (``num_gpus=0.5`` each, a fixed KV cache each), one is killed
(SIGKILL) while it writes a unit, Ray restarts it, its unit is written again; then the
whole job is resumed after a finished unit is lost. Every shard, unit manifest and the merged
manifest must equal, byte for byte, those of one replica straight through.

Needs Ray on the GPU host (``pip install 'vllm-compat[ray]'``). About 2.5 minutes on an
H200 (five engine starts of a tiny Llama, eager).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from . import _models as M

pytestmark = pytest.mark.gpu

N_RECORDS, PER_SHARD, PER_UNIT = 192, 4, 32
KV_BYTES = 1 << 30  # per engine: fixed, so two engines fit one GPU and schedule the same
ENGINE = dict(enforce_eager=True, max_model_len=M.MAX_LEN, max_num_batched_tokens=512,
              gpu_memory_utilization=0.2, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ray = pytest.importorskip("ray")
    d = tmp_path_factory.mktemp("scale-out")
    target = M.build("llama", str(d / "target"))
    g = torch.Generator().manual_seed(5)
    (d / "prep").mkdir()
    with open(d / "prep" / "prepared.jsonl", "w") as f:
        for i in range(N_RECORDS):  # 16..1000 tokens: most prompts span several 512-token steps
            n = int(torch.randint(16, M.MAX_LEN - 23, (1,), generator=g))
            ids = torch.randint(3, M.VOCAB, (n,), generator=g).tolist()
            f.write(json.dumps({"line": i + 1, "input_ids": ids, "loss_mask": [1] * n}) + "\n")
    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield {"target": target, "prep": d / "prep", "dir": d}
    ray.shutdown()


def _extract(setup, out: Path, replicas: int, on_event=None):
    from vllm_compat.eagle3.distributed import extract_distributed
    t0 = time.perf_counter()
    m = extract_distributed(setup["target"], setup["prep"], out, replicas=replicas,
                            gpus_per_replica=0.5, dtype=torch.bfloat16,
                            samples_per_shard=PER_SHARD, samples_per_unit=PER_UNIT,
                            staggered_start=True, on_event=on_event, **ENGINE)
    return m, round(time.perf_counter() - t0, 1)


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_two_replicas_killed_and_resumed_write_one_replicas_bytes(setup):
    from vllm_compat.eagle3.data import HiddenStatesDataset
    from vllm_compat.testing.replicas import ReplicaKiller

    one = setup["dir"] / "one"
    m1, t_one = _extract(setup, one, 1)
    assert m1.num_samples == N_RECORDS and len(HiddenStatesDataset(one, verify="full")) == N_RECORDS
    ref = _files(one)

    two = setup["dir"] / "two"
    killer = ReplicaKiller(two, replica=1)
    m2, t_two = _extract(setup, two, 2, killer)
    died = killer.of("replica_died")
    done = killer.of("unit_done")
    M.record("scale_out:two_replicas_kill", seconds_one_replica=t_one, seconds_two_replicas=t_two,
             killed=killer.killed, died=died, restarted=[e for e in killer.of("replica_ready")
                                                         if e.get("restarted")],
             units_by_replica={r: sorted(e["unit"] for e in done if e["replica"] == r) for r in (0, 1)},
             units=len(done), tokens=m2.num_tokens)
    assert killer.killed.get("shards_then", 0) >= 1, "replica 1 was not killed mid-unit"
    assert [(e["replica"], e["unit"]) for e in died] == [(1, killer.killed["unit"])]
    assert sorted(e["unit"] for e in done) == list(range(N_RECORDS // PER_UNIT))
    files = _files(two)
    differ = sorted(k for k in ref if files.get(k) != ref[k])
    assert set(files) == set(ref) and not differ, differ[:10]

    # the whole job died later: a finished unit lost, a partial one left; running it again
    # recomputes only that unit, on a replica that starts fresh
    shutil.rmtree(two / "units" / "unit-00003")
    os.makedirs(two / "units" / "unit-00004.partial-dead")
    (two / "manifest.json").unlink()
    killer.events.clear()
    _, t_resume = _extract(setup, two, 2, killer)
    M.record("scale_out:driver_resume", seconds=t_resume,
             units=sorted(e["unit"] for e in killer.of("unit_done")))
    assert sorted(e["unit"] for e in killer.of("unit_done")) == [3]
    assert _files(two) == ref
