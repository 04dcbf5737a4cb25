"""Online training survives SIGKILL: killed at three points and rerun with the same
command, it continues from its last checkpoint, with the same data order, to the same
weights as a run that never stopped (and as offline training on the same records).

The three points: (1) while the first online unit is being extracted, before any step is
logged; (2) after step 4, so the rerun resumes from the step-3 checkpoint in the middle of
an online unit (steps 0-3 form one unit: it is extracted again from step 0 and steps 0-2
are dropped, so its batching is that of the uninterrupted run); (3) in the middle of the
step-9 checkpoint's write (the torn bytes stay in the temporary file; the rerun resumes
from step 6). With ``--cache``, a kill while a cache unit is half written leaves a partial
unit that the rerun deletes and writes again, to the same bytes as offline extraction.

Comparisons: every logged metric, the data order and the final weights within 1e-6, the
offline resume tests' tolerance (fp32 on one thread; in practice bit-identical). Killed
runs are processes forked from a forkserver with torch imported; the kill is a real
SIGKILL. The extractor is the transformers backend on a tiny Llama (vLLM cannot run a
forward on this CPU).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _kill_points import slow_collate, tear_nth_torch_save
from test_eagle3_online import (  # the same tiny target, records and helpers
    TOTAL,
    assert_same_run,
    cfg,
    offline_dataset,
    online,
    tiny,  # noqa: F401 - fixture
)
from vllm_compat.eagle3 import units as U
from vllm_compat.eagle3.online import train_online
from vllm_compat.eagle3.training import CHECKPOINTS, METRICS_CSV, load_checkpoint, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ctx():
    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(["torch", "vllm_compat.eagle3.online", "vllm_compat.extract.hf_engine"])
    return c


@pytest.fixture(scope="module")
def reference(tiny):  # noqa: F811
    out = tiny["dir"] / "uninterrupted"
    assert train_online(cfg(tiny, out), online()).step == TOTAL
    return out


def _child(cfg_kw: dict, online_kw: dict, opts: dict) -> None:
    torch.set_num_threads(1)
    from vllm_compat.eagle3 import training as T
    from vllm_compat.eagle3.online import OnlineConfig, train_online
    from vllm_compat.extract import hf_engine

    if opts.get("slow_step"):  # each prompt's forward takes >= this long
        step = hf_engine.TransformersEngine.step

        def slow(self):
            time.sleep(opts["slow_step"])
            return step(self)

        hf_engine.TransformersEngine.step = slow
    if opts.get("slow_batch"):  # each training step takes >= this long
        slow_collate(T, opts["slow_batch"])
    if opts.get("engine_pid"):  # where the split placement's engine process runs
        from vllm_compat.eagle3 import split_engine

        init = split_engine.SplitEngine.__init__

        def record_pid(self, *a, **k):
            init(self, *a, **k)
            Path(opts["engine_pid"]).write_text(str(self._proc.pid))

        split_engine.SplitEngine.__init__ = record_pid
    if opts.get("crash_on_save"):  # the n-th torch.save writes half its bytes, then SIGKILL
        tear_nth_torch_save(opts["crash_on_save"])
    train_online(T.TrainConfig(**cfg_kw), OnlineConfig(**online_kw))


def _last_logged_step(path: Path) -> int:
    try:
        lines = [x for x in path.read_text().split("\n")[1:-1] if x]
        return int(lines[-1].split(",")[0]) if lines else 0
    except (FileNotFoundError, ValueError):
        return 0


def _checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name[5:13]) for p in (out / CHECKPOINTS).glob("step-*.pt"))


def _run(ctx, cfg_kw: dict, online_kw: dict, opts: dict, until=None) -> int:
    """Run the child; ``until(out)`` true -> SIGKILL it. Returns its exit code."""
    p = ctx.Process(target=_child, args=(cfg_kw, online_kw, opts))
    p.start()
    deadline = time.monotonic() + 300
    while until is not None and p.is_alive() and time.monotonic() < deadline:
        if until():
            os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    p.join(300)
    assert p.exitcode is not None, "the training child hung"
    return p.exitcode


def _kw(c) -> dict:
    return {k: getattr(c, k) for k in c.__dataclass_fields__}


def test_sigkill_at_three_points_then_rerun_equals_an_uninterrupted_run(tiny, reference, ctx, tmp_path):  # noqa: F811
    out = tmp_path / "killed"
    c, o = _kw(cfg(tiny, out)), _kw(online())
    # 1. during the first unit's extraction: the engine has started (memory plan written),
    #    no step logged yet
    code = _run(ctx, c, o, {"slow_step": 0.05},
                until=lambda: (out / "memory_plan.json").is_file() and (out / METRICS_CSV).is_file())
    assert code == -signal.SIGKILL and _last_logged_step(out / METRICS_CSV) == 0
    assert _checkpoint_steps(out) == []
    # 2. after step 4: resumes from step 3, inside the online unit of steps 0-3
    code = _run(ctx, c, o, {"slow_batch": 0.05}, until=lambda: _last_logged_step(out / METRICS_CSV) >= 4)
    assert code == -signal.SIGKILL and _checkpoint_steps(out) == [3]
    # 3. in the middle of the step-9 save (the rerun saves 6, then 9)
    code = _run(ctx, c, o, {"crash_on_save": 2})
    assert code == -signal.SIGKILL and _last_logged_step(out / METRICS_CSV) == 9
    assert _checkpoint_steps(out) == [3, 6] and (out / CHECKPOINTS / "step-00000009.pt.tmp").is_file()
    for p in (out / CHECKPOINTS).glob("step-*.pt"):  # what survived is loadable
        assert load_checkpoint(p)["step"] == int(p.name[5:13])
    # the same command again finishes the run
    assert train_online(cfg(tiny, out), online()).step == TOTAL
    assert not list((out / CHECKPOINTS).glob("*.tmp"))
    assert_same_run(reference, out)


def test_the_killed_and_resumed_run_equals_offline_training(tiny, reference, tmp_path):  # noqa: F811
    ds = offline_dataset(tiny["target"], tiny["prep"], tmp_path / "ds", "bfloat16")
    assert train(cfg(tiny, tmp_path / "offline", ds)).step == TOTAL
    assert_same_run(tmp_path / "offline", reference)


def test_sigkill_while_a_cache_unit_is_written(tiny, reference, ctx, tmp_path):  # noqa: F811
    out, cache = tmp_path / "run", tmp_path / "cache"
    kw = dict(cache=str(cache), samples_per_unit=4, samples_per_shard=2)
    c, o = _kw(cfg(tiny, out)), _kw(online(**kw))

    def half_written() -> bool:
        return any((cache / U.UNITS).glob("unit-*.partial-*/shard-00000.safetensors"))

    code = _run(ctx, c, o, {"slow_step": 0.05}, until=half_written)
    assert code == -signal.SIGKILL
    assert list((cache / U.UNITS).glob("unit-*.partial-*"))  # the dead writer's files
    assert train_online(cfg(tiny, out), online(**kw)).step == TOTAL
    assert not list((cache / U.UNITS).glob("unit-*.partial-*"))
    assert_same_run(reference, out)
    ref = offline_dataset(tiny["target"], tiny["prep"], tmp_path / "ds", "bfloat16")

    def shards(d: Path) -> dict[str, bytes]:
        return {str(p.relative_to(d)): p.read_bytes() for p in (d / U.UNITS).rglob("*.safetensors")}

    assert shards(cache) == shards(ref)


def _exited(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # a zombie: exited, not yet reaped by its new parent


def test_a_killed_trainer_takes_its_split_engine_down_and_the_rerun_resumes(tiny, reference, ctx, tmp_path):  # noqa: F811
    """SIGKILL of the trainer cannot stop the engine process it spawned; the engine notices
    its parent is gone (also while blocked on a full results queue) and exits, freeing its
    GPUs. The rerun then resumes as with the co-located placement."""
    out = tmp_path / "split"
    # a unit of 6 steps (12 prompts) and 1 s per batch: the engine fills the results queue
    # (8 samples) long before the trainer is killed after its first step, and waits on it
    split = online(placement="split", unit_steps=6)
    c, o = _kw(cfg(tiny, out)), _kw(split)
    pid_file = tmp_path / "engine.pid"
    code = _run(ctx, c, o, {"slow_batch": 1.0, "engine_pid": str(pid_file)},
                until=lambda: _last_logged_step(out / METRICS_CSV) >= 1)
    assert code == -signal.SIGKILL
    engine = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while not _exited(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _exited(engine), f"the engine process {engine} outlived its trainer"
    assert train_online(cfg(tiny, out), split).step == TOTAL
    assert_same_run(reference, out)  # unit_steps 6 vs 4: the same states (one prompt per forward)
