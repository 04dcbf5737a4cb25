"""The many-hosts placement of online training: engine replicas as Ray actors on a real
local Ray cluster (CPU), the trainer fed through Ray's object store.

Same guarantees as the other placements (tests/unit/test_eagle3_online.py): the run equals
offline training on the same records (per-step metrics, data order, final weights within
1e-6), no state bytes under the output directory, and at most ``queue_depth`` units in
flight per trainer. The replicas run the transformers backend of
:class:`~vllm_compat.extract.HiddenStatesExtractor` on a tiny Llama (a real forward; vLLM
cannot run one on this CPU).
"""

from __future__ import annotations

import sys
import time

import pytest

pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

from test_eagle3_online import (  # the same tiny target, records and helpers
    TOTAL,
    assert_same_run,
    cfg,
    offline_bf16,  # noqa: F401 - fixture
    online,
    state_rows,
    tiny,  # noqa: F401 - fixture
)

from vllm_compat.eagle3 import training as T
from vllm_compat.eagle3.cli import main as cli_main
from vllm_compat.eagle3.online import train_online
from vllm_compat.eagle3.online_args import OnlineConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEPTH = 2  # units in flight per trainer
UNIT_STEPS = 2  # 12 steps: 6 online units


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def replicas(**kw) -> OnlineConfig:
    return online(**{"placement": "replicas", "engine_replicas": 2, "queue_depth": DEPTH,
                     "unit_steps": UNIT_STEPS, **kw})


@pytest.fixture(scope="module")
def slow_trainer_run(tiny, cluster):  # noqa: F811
    """A run whose trainer is slower than its two replicas (each step >= 0.15 s), so the
    replicas would run ahead without back-pressure."""
    out = tiny["dir"] / "online-replicas"
    events: list[dict] = []
    step = T.train_step

    def slow_step(*a, **k):
        time.sleep(0.15)
        return step(*a, **k)

    T.train_step = slow_step
    try:
        assert train_online(cfg(tiny, out), replicas(), on_event=events.append).step == TOTAL
    finally:
        T.train_step = step
    return out, events


def test_replicas_give_offline_training_losses_order_and_weights(offline_bf16, slow_trainer_run):  # noqa: F811
    out, events = slow_trainer_run
    assert_same_run(offline_bf16, out)
    # both replicas worked (round robin over the units), in their own processes
    ready = [e for e in events if e["event"] == "replica_ready"]
    extracted = [e for e in events if e["event"] == "unit_extracted"]
    assert len(ready) == 2 and len({e["pid"] for e in ready}) == 2
    assert {e["pid"] for e in extracted} == {e["pid"] for e in ready}
    assert sorted(e["unit"] for e in extracted) == list(range(TOTAL // UNIT_STEPS))


def test_at_most_queue_depth_units_in_flight(slow_trainer_run):
    """Counted from the replicas' own clocks: a unit's extraction starts (in the replica's
    process) only after the trainer took the last step of the unit ``DEPTH`` places before
    it; and the replicas did run ahead up to the bound (the trainer is the slower side)."""
    _, events = slow_trainer_run
    started = {e["unit"]: e["started"] for e in events if e["event"] == "unit_extracted"}
    taken = {e["unit"]: e["time"] for e in events if e["event"] == "unit_taken"}
    units = sorted(started)
    assert sorted(taken) == units
    in_flight = []
    for k in units:  # units started on a replica and not yet taken by the trainer, at k's start
        in_flight.append(sum(1 for j in units if started[j] <= started[k] and taken[j] > started[k]))
    assert max(in_flight) == DEPTH, in_flight
    for k in units[DEPTH:]:
        assert started[k] >= taken[k - DEPTH], (k, started[k], taken[k - DEPTH])


def test_no_state_bytes_under_the_output_directory(tiny, offline_bf16, slow_trainer_run):  # noqa: F811
    out, _ = slow_trainer_run
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    names = sorted(str(p.relative_to(out)) for p in files)
    logs = [n for n in names if not n.startswith(("checkpoints/", "final/"))]
    assert set(logs) <= {"train_config.json", "metrics.csv", "data_order.csv", "metrics.png", ".lock"}, logs
    rows_ = state_rows(tiny["dir"] / "ds-bf16")
    assert [(str(p), i) for p, data in files.items() for i, r in enumerate(rows_) if r in data] == []


def test_options_are_checked_and_ray_is_optional(tiny, tmp_path, capsys, monkeypatch):  # noqa: F811
    args = ["eagle3", "train", str(tiny["prep"]), "--target", tiny["target"], "--vocab", str(tiny["vocab"]),
            "-o", str(tmp_path / "cli"), "--online", "--backend", "transformers"]
    for extra, message in (
            (["--engine-replicas", "0"], "engine_replicas >= 1"),
            (["--engine-replicas", "2", "--engine-devices", "1"], "choose one placement"),
            (["--engine-replicas", "2", "--cache", str(tmp_path / "c")], "--cache is not available"),
            (["--ray-address", "auto"], "needs engine_replicas >= 1 (CLI --engine-replicas N)")):
        assert cli_main(args + extra) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert cli_main(["eagle3", "train", str(tiny["prep"]), "--target", tiny["target"], "--vocab",
                     str(tiny["vocab"]), "-o", str(tmp_path / "x"), "--engine-replicas", "2"]) == 2
    assert "only with --online" in capsys.readouterr().err
    # without Ray: a usage error naming the extra, before anything loads
    monkeypatch.setitem(sys.modules, "ray", None)
    assert cli_main(args + ["--engine-replicas", "2"]) == 2
    assert "pip install 'vllm-compat[ray]'" in capsys.readouterr().err
    from vllm_compat.eagle3.ray_engines import ray_module

    with pytest.raises(ImportError, match=r"pip install 'vllm-compat\[ray\]'"):
        ray_module()
    assert not (tmp_path / "cli").exists() and not (tmp_path / "c").exists()


def _child(cfg_kw: dict, online_kw: dict, pid_file: str) -> None:
    """A trainer in its own process, a driver of the test's Ray cluster: each step >= 0.3 s;
    the replicas' pids go to ``pid_file``."""
    import torch

    torch.set_num_threads(1)
    from vllm_compat.eagle3 import training

    step = training.train_step

    def slow_step(*a, **k):
        time.sleep(0.3)
        return step(*a, **k)

    training.train_step = slow_step

    def note(e: dict) -> None:
        if e["event"] == "replica_ready":
            with open(pid_file, "a") as f:
                f.write(f"{e['pid']}\n")

    train_online(training.TrainConfig(**cfg_kw), OnlineConfig(**online_kw), on_event=note)


def test_sigkill_of_the_trainer_ends_its_replicas_and_the_rerun_resumes(tiny, offline_bf16, cluster, tmp_path):  # noqa: F811
    """Killed after step 4, the rerun resumes from the step-3 checkpoint, in the middle of
    the online unit of steps 2-3 (extracted again from step 2), to the offline run. Ray
    ends the killed trainer's replicas (it owned them)."""
    import multiprocessing
    import os
    import signal
    from pathlib import Path

    from test_online_resume_after_kill import _checkpoint_steps, _exited, _kw, _last_logged_step

    out, pids = tmp_path / "killed", tmp_path / "replicas.pid"
    address = ray.get_runtime_context().gcs_address
    c = _kw(cfg(tiny, out))
    o = _kw(replicas(ray_address=address))
    ctx = multiprocessing.get_context("forkserver")
    p = ctx.Process(target=_child, args=(c, o, str(pids)))
    p.start()
    deadline = time.monotonic() + 300
    while p.is_alive() and time.monotonic() < deadline and _last_logged_step(out / T.METRICS_CSV) < 4:
        time.sleep(0.005)
    os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL and _checkpoint_steps(out) == [3]
    assert 4 <= _last_logged_step(out / T.METRICS_CSV) < TOTAL
    engines = [int(x) for x in Path(pids).read_text().split()]
    assert len(engines) == 2
    deadline = time.monotonic() + 60
    while not all(_exited(e) for e in engines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_exited(e) for e in engines), f"replicas {engines} outlived their trainer"
    events: list[dict] = []
    assert train_online(cfg(tiny, out), replicas(ray_address=address), on_event=events.append).step == TOTAL
    assert_same_run(offline_bf16, out)
    # the resume re-extracted the unit of steps 2-3 from its first step
    assert next((e["first"], e["end"]) for e in events if e["event"] == "unit_submitted") == (2, 4)


def _rank(rank: int, port: int, cfg_kw: dict, online_kw: dict | None) -> None:
    """One torchrun-like rank (gloo on the CPU): offline training, or online with replicas."""
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from vllm_compat.eagle3 import training

    if online_kw is None:
        training.train(training.TrainConfig(**cfg_kw))
    else:
        train_online(training.TrainConfig(**cfg_kw), OnlineConfig(**online_kw))


def _ranks(cfg_kw: dict, online_kw: dict | None) -> None:
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("forkserver")
    procs = [ctx.Process(target=_rank, args=(r, port, cfg_kw, online_kw)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]


def test_two_ranks_each_fed_by_its_replica_equal_offline_ddp(tiny, offline_bf16, cluster, tmp_path):  # noqa: F811
    """Two gloo ranks, each with one replica of its own, train on the samples offline DDP
    training reads (each rank its share of the epoch order): the same run."""
    from safetensors.torch import load_file
    from test_eagle3_online import rows
    from test_online_resume_after_kill import _kw

    address = ray.get_runtime_context().gcs_address
    _ranks(_kw(cfg(tiny, tmp_path / "offline", tiny["dir"] / "ds-bf16")), None)
    _ranks(_kw(cfg(tiny, tmp_path / "online")),
           _kw(replicas(engine_replicas=1, ray_address=address)))
    a, b = tmp_path / "offline", tmp_path / "online"
    ra, rb = rows(a / T.METRICS_CSV), rows(b / T.METRICS_CSV)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [str(s) for s in range(1, TOTAL // 2 + 1)]
    assert max(abs(float(x[k]) - float(y[k])) for x, y in zip(ra, rb) for k in x) <= 1e-6
    assert rows(a / T.DATA_ORDER_CSV) == rows(b / T.DATA_ORDER_CSV)
    assert all(len(r["samples"].split()) == 4 for r in rows(b / T.DATA_ORDER_CSV))  # 2 ranks x 2
    wa, wb = load_file(str(a / "final" / "draft.safetensors")), load_file(str(b / "final" / "draft.safetensors"))
    assert max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa) <= 1e-6
