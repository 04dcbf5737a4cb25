"""Training survives SIGKILL: a run killed at random points and resumed equals one that never stopped.

Compared against an uninterrupted run: the whole per-step loss curve (every column of
``metrics.csv``), the sample indices of every step (``data_order.csv``) and the final
weights, within 1e-6 (fp32; in practice bit-identical). Killed runs are separate
processes (forked from a forkserver that has torch imported, so a start costs well under
a second); the kill is a real ``SIGKILL``, so nothing in the trainer gets to clean up.

The mutation tests show the comparison can fail: a resume that loses the optimizer state
or the data order produces a different curve, and a checkpoint written in place (not
tmp + fsync + rename) is left torn by a kill during the save.

``VC_KILL_SEED=<int>`` replays the random kill points of a failed run.
"""

from __future__ import annotations

import csv
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _kill_points import slow_collate, tear_nth_torch_save
from vllm_compat.testing.synthetic import write_dataset, write_target
from vllm_compat.eagle3.training import (
    CHECKPOINTS, DATA_ORDER_CSV, METRICS_CSV, TrainConfig, load_checkpoint, train,
)
from vllm_compat.eagle3.vocab import build_vocab
from vllm_compat.errors import TrainingCheckpointError

NUM_SAMPLES, BATCH, EPOCHS = 8, 2, 3
TOTAL = NUM_SAMPLES // BATCH * EPOCHS  # 12 steps; checkpoints at 3, 6, 9, 12
TOL = 1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume-inputs")
    write_target(d / "target")
    write_dataset(d / "ds", d / "target", num_samples=NUM_SAMPLES)
    build_vocab(d / "ds", 96, draft_vocab_size=32, output_dir=d / "vocab")
    return d


def _cfg(inputs: Path, out: Path, **kw) -> dict:
    base = dict(dataset=str(inputs / "ds"), target=str(inputs / "target"), vocab=str(inputs / "vocab"),
                output_dir=str(out), epochs=EPOCHS, batch_size=BATCH, lr=3e-3, warmup_steps=2,
                checkpoint_every=3, keep_checkpoints=2, dtype="fp32", progress=False, tensorboard=False)
    base.update(kw)
    return base


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert train(TrainConfig(**_cfg(inputs, out))).step == TOTAL
    return out


@pytest.fixture(scope="module")
def ctx():
    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(["torch", "vllm_compat.eagle3.training", __name__])
    return c


# ----------------------------------------------------------------------------- the child


def _child(cfg: dict, opts: dict) -> None:
    """Runs ``train`` in a forked process; ``opts`` slow it down or make it die mid-save."""
    torch.set_num_threads(1)
    from vllm_compat.eagle3 import training as T

    if opts.get("slow"):  # a step takes >= slow seconds, so a kill can land on any step
        slow_collate(T, opts["slow"])
    if opts.get("marker"):  # tells the parent the CSV now shows this run's progress
        reset = T._reset_csv

        def reset_and_mark(path, names, upto):
            reset(path, names, upto)
            if path.name == T.METRICS_CSV:
                Path(opts["marker"]).write_text(str(upto))

        T._reset_csv = reset_and_mark
    if opts.get("crash_on_save"):  # the n-th torch.save writes half its bytes, then SIGKILL
        tear_nth_torch_save(opts["crash_on_save"])
    if opts.get("in_place"):  # a save without tmp + rename, to show what atomicity prevents
        def save_in_place(out, state, keep):
            d = out / T.CHECKPOINTS
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"step-{state['step']:08d}.pt"
            torch.save(state, path)
            for old in T._checkpoints(out)[:-keep]:
                old.unlink()
            return path

        T.save_checkpoint = save_in_place
    T.train(T.TrainConfig(**cfg))


def _last_logged_step(path: Path) -> int:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    lines = [line for line in text.split("\n")[1:-1] if line]  # complete rows only
    try:
        return int(lines[-1].split(",")[0]) if lines else 0
    except ValueError:
        return 0


def _checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name[5:13]) for p in (out / CHECKPOINTS).glob("step-*.pt"))


def _run(ctx, cfg: dict, opts: dict, *, kill_after_step: int | None = None, delay: float = 0.0):
    """Start the child; with ``kill_after_step``, SIGKILL it ``delay`` s after its log shows
    that step. Returns ``(killed, exitcode)``."""
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "started.marker"
    marker.unlink(missing_ok=True)
    p = ctx.Process(target=_child, args=(cfg, {**opts, "marker": str(marker)}))
    p.start()
    killed = False
    deadline = time.monotonic() + 300
    while kill_after_step is not None and p.is_alive() and time.monotonic() < deadline:
        if marker.exists() and _last_logged_step(out / METRICS_CSV) >= kill_after_step:
            time.sleep(delay)
            os.kill(p.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.005)
    p.join(120)
    assert p.exitcode is not None, "the training child hung"
    return killed, p.exitcode


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _curve_diff(a: Path, b: Path) -> float:
    """Largest difference of any logged metric at any step (inf when the steps differ)."""
    ra, rb = _rows(a / METRICS_CSV), _rows(b / METRICS_CSV)
    if [r["step"] for r in ra] != [r["step"] for r in rb]:
        return float("inf")
    return max(abs(float(x[k]) - float(y[k])) for x, y in zip(ra, rb) for k in x)


def _assert_same_run(reference: Path, out: Path, why: str = "") -> None:
    assert [int(r["step"]) for r in _rows(out / METRICS_CSV)] == list(range(1, TOTAL + 1)), why
    assert _curve_diff(reference, out) <= TOL, why
    assert _rows(out / DATA_ORDER_CSV) == _rows(reference / DATA_ORDER_CSV), why
    wa = load_file(str(reference / "final" / "draft.safetensors"))
    wb = load_file(str(out / "final" / "draft.safetensors"))
    assert wa.keys() == wb.keys()
    assert max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa) <= TOL, why


# ----------------------------------------------------------------------------- tests


def test_reference_logs_every_step_and_a_per_epoch_permutation(reference):
    order = _rows(reference / DATA_ORDER_CSV)
    assert [int(r["step"]) for r in order] == list(range(1, TOTAL + 1))
    per_epoch: dict[str, list[int]] = {}
    for r in order:
        per_epoch.setdefault(r["epoch"], []).extend(int(i) for i in r["samples"].split())
    assert len(per_epoch) == EPOCHS
    assert all(sorted(v) == list(range(NUM_SAMPLES)) for v in per_epoch.values())
    assert len({tuple(v) for v in per_epoch.values()}) == EPOCHS  # reshuffled every epoch


def test_sigkill_at_random_points_then_resume_equals_an_uninterrupted_run(inputs, reference, ctx, tmp_path):
    seed = int(os.environ.get("VC_KILL_SEED") or random.SystemRandom().randrange(2**32))
    rng = random.Random(seed)
    out = tmp_path / "killed"
    cfg = _cfg(inputs, out)
    kills = []
    # one kill in each third of the run's first 11 steps, a random 0-60 ms after the log
    # shows the chosen step: it lands in a forward/backward pass, a CSV append or a save
    for lo, hi in ((1, 4), (5, 8), (9, 11)):
        resumed_from = (_checkpoint_steps(out) or [0])[-1]
        step = max(rng.randint(lo, hi), resumed_from + 1)
        delay = rng.uniform(0.0, 0.06)
        killed, code = _run(ctx, cfg, {"slow": 0.03}, kill_after_step=step, delay=delay)
        tmp_left = sorted(p.name for p in (out / CHECKPOINTS).glob("*.tmp"))
        kills.append(dict(resumed_from=resumed_from, kill_after=step, delay_ms=round(delay * 1000),
                          logged=_last_logged_step(out / METRICS_CSV), torn_tmp=tmp_left))
        assert killed and code == -signal.SIGKILL, (seed, kills, code)
        for p in (out / CHECKPOINTS).glob("step-*.pt"):  # whatever survived is loadable
            assert load_checkpoint(p)["step"] == int(p.name[5:13]), (seed, kills)
    why = f"VC_KILL_SEED={seed} kills={kills}"
    print(why)  # shown with -rP / -s: where the kills landed
    resumed = train(TrainConfig(**cfg))  # the restart, with resume (the default)
    assert resumed.step == TOTAL, why
    assert not list((out / CHECKPOINTS).glob("*.tmp")), why  # leftovers of torn saves removed
    _assert_same_run(reference, out, why)


@pytest.mark.parametrize("save", ["atomic", "in_place"])
def test_sigkill_in_the_middle_of_a_checkpoint_write(inputs, reference, ctx, tmp_path, save):
    """The 3rd save (step 9) writes half its bytes and the process is SIGKILLed."""
    out = tmp_path / save
    cfg = _cfg(inputs, out)
    killed, code = _run(ctx, cfg, {"crash_on_save": 3, "in_place": save == "in_place"})
    assert code == -signal.SIGKILL and _last_logged_step(out / METRICS_CSV) == 9
    if save == "atomic":
        # the torn bytes are in the temporary file; the latest real checkpoint is complete
        assert _checkpoint_steps(out) == [3, 6]
        assert (out / CHECKPOINTS / "step-00000009.pt.tmp").is_file()
        assert train(TrainConfig(**cfg)).step == TOTAL  # resumes from step 6
        _assert_same_run(reference, out)
        return
    # written in place, the latest checkpoint is the torn one: resume cannot be exact
    torn = out / CHECKPOINTS / "step-00000009.pt"
    assert _checkpoint_steps(out) == [3, 6, 9]
    with pytest.raises(TrainingCheckpointError) as info:
        train(TrainConfig(**cfg))
    msg = str(info.value)
    assert msg.startswith(f"{torn} is not a readable training checkpoint (")
    assert msg.endswith("); delete it to resume from the previous one, or start over with resume=False")
    torn.unlink()  # what the message says to do
    assert train(TrainConfig(**cfg)).step == TOTAL
    _assert_same_run(reference, out)


def _stopped_at_step_6(inputs, out: Path) -> dict:
    """A run stopped after step 8 whose step-8 checkpoint was lost: it resumes from step 6."""
    cfg = _cfg(inputs, out)
    train(TrainConfig(**{**cfg, "max_steps": 8}))
    (out / CHECKPOINTS / "step-00000008.pt").unlink()
    assert _checkpoint_steps(out) == [6]
    return cfg


def test_a_resume_without_the_optimizer_state_is_caught(inputs, reference, tmp_path):
    cfg = _stopped_at_step_6(inputs, tmp_path)
    path = tmp_path / CHECKPOINTS / "step-00000006.pt"
    state = load_checkpoint(path)
    state["optimizer"]["state"] = {}  # AdamW moments lost, weights and schedule kept
    torch.save(state, path)
    train(TrainConfig(**cfg))
    assert _rows(tmp_path / DATA_ORDER_CSV) == _rows(reference / DATA_ORDER_CSV)
    assert _curve_diff(reference, tmp_path) > 1e-3  # the comparison sees it


def test_a_resume_without_the_data_order_is_caught(inputs, reference, tmp_path, monkeypatch):
    from vllm_compat.eagle3 import training as T

    cfg = _stopped_at_step_6(inputs, tmp_path)
    order = T.epoch_order
    # as if the shuffle were drawn from state the checkpoint does not hold
    monkeypatch.setattr(T, "epoch_order", lambda n, seed, epoch, rank=0, world=1: order(n, seed + 1, epoch, rank, world))
    train(TrainConfig(**cfg))
    got, want = _rows(tmp_path / DATA_ORDER_CSV), _rows(reference / DATA_ORDER_CSV)
    assert got[:6] == want[:6] and got[6:] != want[6:]
    assert _curve_diff(reference, tmp_path) > 1e-3


def test_resume_refuses_another_seed_or_schedule(inputs, tmp_path):
    cfg = _stopped_at_step_6(inputs, tmp_path)
    ckpt = tmp_path / CHECKPOINTS / "step-00000006.pt"
    with pytest.raises(TrainingCheckpointError) as info:
        train(TrainConfig(**{**cfg, "seed": 5}))
    assert str(info.value) == (
        f"{ckpt} was written for seed 0 and a 12-step schedule; now seed 5 and 12 steps (epochs=3): the "
        "data order or learning rates would differ, so resuming would not be exact (start over with "
        "resume=False / --no-resume)")
    with pytest.raises(TrainingCheckpointError) as info:
        train(TrainConfig(**{**cfg, "epochs": 4}))
    assert str(info.value) == (
        f"{ckpt} was written for seed 0 and a 12-step schedule; now seed 0 and 16 steps (epochs=4): the "
        "data order or learning rates would differ, so resuming would not be exact (start over with "
        "resume=False / --no-resume)")


def test_torn_last_log_row_is_dropped_on_resume(inputs, reference, tmp_path):
    cfg = _stopped_at_step_6(inputs, tmp_path)
    # a kill in the middle of an append: only "1" of a row "10,..." reached the file; a
    # reader that kept it (step 1 <= 6) would log a row of empty metrics
    for name in (METRICS_CSV, DATA_ORDER_CSV):
        with (tmp_path / name).open("a") as f:
            f.write("1")
    train(TrainConfig(**cfg))
    _assert_same_run(reference, tmp_path)


def test_no_resume_starts_over_and_forgets_old_checkpoints(inputs, reference, tmp_path):
    cfg = _stopped_at_step_6(inputs, tmp_path)
    train(TrainConfig(**{**cfg, "max_steps": 2}), resume=False)
    assert _checkpoint_steps(tmp_path) == [2]  # step 6 of the abandoned run is gone
    train(TrainConfig(**cfg))
    _assert_same_run(reference, tmp_path)
