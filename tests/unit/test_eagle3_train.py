"""Training: it learns, logs per TTT position, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import csv
import importlib.util

import pytest
import torch

from vllm_compat.testing.synthetic import write_dataset, write_target
from vllm_compat.eagle3.training import (
    CHECKPOINTS,
    METRICS_CSV,
    METRICS_PNG,
    TrainConfig,
    epoch_order,
    load_checkpoint,
    load_final,
    lr_lambda,
    train,
)
from vllm_compat.eagle3.vocab import build_vocab


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("train-inputs")
    write_target(d / "target")
    write_dataset(d / "ds", d / "target", num_samples=8)
    build_vocab(d / "ds", 96, draft_vocab_size=32, output_dir=d / "vocab")
    return d


def _cfg(inputs, out, **kw):
    base = dict(dataset=str(inputs / "ds"), target=str(inputs / "target"), vocab=str(inputs / "vocab"),
                output_dir=str(out), epochs=2, batch_size=2, lr=3e-3, warmup_steps=2, checkpoint_every=2,
                dtype="fp32", progress=False, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


def _rows(out):
    with (out / METRICS_CSV).open() as f:
        return list(csv.DictReader(f))


def test_loss_falls_and_metrics_are_logged_per_position(inputs, tmp_path):
    res = train(_cfg(inputs, tmp_path, epochs=6, ttt_steps=2, ttt_decay=0.8))
    rows = _rows(tmp_path)
    assert res.step == 24 and [int(r["step"]) for r in rows] == list(range(1, 25))
    assert set(rows[0]) == {"step", "epoch", "lr", "loss", "grad_norm", "loss_0", "loss_1", "acc_0", "acc_1",
                            "chain_0", "chain_1"}
    # chain_k (steps 0..k all right, like vLLM's per-position acceptance) vs acc_k (step k alone)
    assert all(r["chain_0"] == r["acc_0"] for r in rows)
    assert all(float(r["chain_1"]) <= float(r["acc_1"]) + 1e-9 for r in rows)
    assert any(float(r["chain_1"]) < float(r["acc_1"]) for r in rows)  # the chain is carried
    first = sum(float(r["loss_0"]) for r in rows[:4])
    last = sum(float(r["loss_0"]) for r in rows[-4:])
    assert last < 0.8 * first, (first, last)
    assert float(rows[-1]["acc_0"]) > float(rows[0]["acc_0"])
    if importlib.util.find_spec("matplotlib") is not None:  # the plot is optional (eagle3 extra)
        assert (tmp_path / METRICS_PNG).stat().st_size > 1000
    else:
        assert not (tmp_path / METRICS_PNG).exists()
    cfg, weights = load_final(tmp_path)
    assert cfg.aux_layer_ids == [2, 4, 5] and cfg.final_layer_id == 8
    assert "embed_tokens.weight" not in weights and weights["lm_head.weight"].shape == (32, 16)


def test_resume_equals_an_uninterrupted_run(inputs, tmp_path):
    whole = train(_cfg(inputs, tmp_path / "whole"))
    # interrupted after step 3 (checkpoints at 2 and 3), and the step-3 checkpoint lost as in a
    # crash: the rerun restarts from step 2 and must redo step 3 identically
    part = train(_cfg(inputs, tmp_path / "part", max_steps=3))
    assert part.step == 3
    (tmp_path / "part" / CHECKPOINTS / "step-00000003.pt").unlink()
    resumed = train(_cfg(inputs, tmp_path / "part"))
    assert resumed.step == whole.step == 8
    a = load_checkpoint(tmp_path / "whole" / CHECKPOINTS / "step-00000008.pt")
    b = load_checkpoint(tmp_path / "part" / CHECKPOINTS / "step-00000008.pt")
    for k in a["draft"]:
        assert torch.equal(a["draft"][k], b["draft"][k]), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a["scheduler"] == b["scheduler"]
    assert _rows(tmp_path / "whole") == _rows(tmp_path / "part")
    with pytest.raises(ValueError, match="batch size 2; now 8, 1, 4: the data order would differ"):
        train(_cfg(inputs, tmp_path / "part", batch_size=4))


def test_bf16_autocast_trains(inputs, tmp_path):
    res = train(_cfg(inputs, tmp_path, dtype="bf16", epochs=1))
    assert res.step == 4 and all(torch.isfinite(torch.tensor(v)) for v in res.last_metrics.values())
    _, weights = load_final(tmp_path)
    assert weights["fc.weight"].dtype == torch.float32  # fp32 master weights


def test_schedule_and_data_order():
    f = lr_lambda(warmup=2, total=10, min_ratio=0.1)
    assert [round(f(s), 4) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert f(10) == pytest.approx(0.1) and f(6) == pytest.approx(0.1 + 0.9 * 0.5)
    assert epoch_order(10, 0, 1) == epoch_order(10, 0, 1) != epoch_order(10, 0, 2)
    ranks = [epoch_order(10, 0, 1, r, 2) for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == list(range(10)) and not set(ranks[0]) & set(ranks[1])
    uneven = [epoch_order(11, 0, 1, r, 3) for r in (0, 1, 2)]
    assert [len(u) for u in uneven] == [3, 3, 3] and len(set(sum(uneven, []))) == 9


def test_too_few_samples_for_the_batch(inputs, tmp_path):
    with pytest.raises(ValueError, match="8 samples are fewer than batch_size x world_size = 16"):
        train(_cfg(inputs, tmp_path, batch_size=16))


def test_tensorboard_events_when_installed(inputs, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is optional")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(_cfg(inputs, tmp_path, epochs=1, tensorboard=True, ttt_steps=2))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/loss_0", "train/loss_1", "train/acc_0", "train/acc_1"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/acc_1")] == [1, 2, 3, 4]


def test_prefetching_thread_gives_the_same_run(inputs, tmp_path):
    """Batches built ahead in a background thread (the CUDA default) are the same batches in
    the same order: identical loss curve, data order and weights as building them in the loop."""
    a = train(_cfg(inputs, tmp_path / "in-process", prefetch=0, max_steps=6))
    b = train(_cfg(inputs, tmp_path / "workers", prefetch=3, max_steps=6))
    assert a.step == b.step == 6
    assert _rows(tmp_path / "in-process") == _rows(tmp_path / "workers")
    order = [(tmp_path / d / "data_order.csv").read_text() for d in ("in-process", "workers")]
    assert order[0] == order[1]
    wa, wb = load_final(tmp_path / "in-process" / "final")[1], load_final(tmp_path / "workers" / "final")[1]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_collate_keeps_bf16_and_equals_float32_padding():
    from vllm_compat.eagle3.training import collate

    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool),
                "hidden_states": torch.randn(n, 3, 8, generator=g).to(torch.bfloat16)} for n in (5, 2, 4)]
    out = collate(samples)
    assert out["hidden_states"].dtype == torch.bfloat16 and out["hidden_states"].shape == (3, 5, 3, 8)
    ref = torch.zeros(3, 5, 3, 8)
    for i, s in enumerate(samples):
        ref[i, : len(s["input_ids"])] = s["hidden_states"].float()
    assert torch.equal(out["hidden_states"].float(), ref)  # bf16 -> fp32 is exact
    assert out["valid"].sum().item() == 11 and not out["valid"][1, 2:].any()
    mixed = samples[:2] + [{**samples[2], "hidden_states": samples[2]["hidden_states"].float()}]
    assert collate(mixed)["hidden_states"].dtype == torch.float32


def test_prefetched_order_errors_and_early_stop():
    import threading

    from vllm_compat.eagle3.training import prefetched

    seen: list[str] = []

    def make(x):
        seen.append(threading.current_thread().name)
        if x == 7:
            raise ValueError("bad sample 7")
        return x * x

    assert list(prefetched(make, range(5), 0)) == [0, 1, 4, 9, 16]
    assert set(seen) == {threading.current_thread().name}  # depth 0: the caller's thread
    seen.clear()
    assert list(prefetched(make, range(6), 3)) == [0, 1, 4, 9, 16, 25]
    assert len(set(seen)) == 1 and seen[0].startswith("draft-batches")
    it = prefetched(make, range(10), 2)
    assert [next(it) for _ in range(7)] == [x * x for x in range(7)]
    with pytest.raises(ValueError, match="bad sample 7"):  # raised in order, in the caller
        next(it)
    it = prefetched(make, iter(range(100)), 2)
    assert next(it) == 0
    it.close()  # a consumer that stops early leaves no thread behind
    assert not [t for t in threading.enumerate() if t.name.startswith("draft-batches")]


def test_device_resident_samples_give_the_same_run(inputs, tmp_path):
    """Samples read once onto the training device (``DeviceSamples``; the CUDA default when
    they fit) and padded there give the same batches in the same order as reading the files
    every step: identical loss curve, data order and weights. Here the device is the CPU."""
    from vllm_compat.eagle3.data import HiddenStatesDataset
    from vllm_compat.eagle3.training import DeviceSamples, device_cache_fits

    a = train(_cfg(inputs, tmp_path / "files", device_cache=False, max_steps=6))
    b = train(_cfg(inputs, tmp_path / "cached", device_cache=True, max_steps=6))
    ds = HiddenStatesDataset(inputs / "ds")
    held = DeviceSamples(ds, "cpu")
    c = train(_cfg(inputs, tmp_path / "passed", max_steps=6), samples=held)
    assert a.step == b.step == c.step == 6
    for d in ("cached", "passed"):
        assert _rows(tmp_path / "files") == _rows(tmp_path / d)
        assert (tmp_path / "files" / "data_order.csv").read_text() == (tmp_path / d / "data_order.csv").read_text()
        wa, wb = load_final(tmp_path / "files" / "final")[1], load_final(tmp_path / d / "final")[1]
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert len(held) == len(ds) and all(torch.equal(held[i]["hidden_states"], ds[i]["hidden_states"])
                                        for i in range(len(ds)))
    assert not device_cache_fits(ds, torch.device("cpu"))  # auto mode is for CUDA only
    with pytest.raises(ValueError, match="samples hold .* this run trains on"):
        train(_cfg(inputs, tmp_path / "other", dataset=str(tmp_path / "elsewhere"), max_steps=1), samples=held)


def test_schedule_steps_make_the_cosine_span_the_steps_run(inputs, tmp_path):
    """A run stopped by max_steps keeps the epochs' schedule unless told its length: then the
    learning rate falls to its floor where the run stops, not part-way down."""
    f5 = lr_lambda(warmup=2, total=5, min_ratio=0.1)
    short = train(_cfg(inputs, tmp_path / "short", max_steps=5, schedule_steps=5, min_lr_ratio=0.1))
    lrs = [float(r["lr"]) for r in _rows(tmp_path / "short")]
    assert short.step == 5 and lrs == pytest.approx([3e-3 * f5(i) for i in range(5)])
    assert lrs[-1] < 3e-3 * 0.5  # 0.325 of the peak at the last step, the floor right after it
    stopped = train(_cfg(inputs, tmp_path / "stopped", max_steps=5, min_lr_ratio=0.1))
    assert float(_rows(tmp_path / "stopped")[-1]["lr"]) > 3e-3 * 0.75  # 8-step schedule, stopped at 5
    # a checkpoint of one schedule does not resume into another
    with pytest.raises(Exception, match="schedule"):
        train(_cfg(inputs, tmp_path / "short", max_steps=6, schedule_steps=6, min_lr_ratio=0.1))
    assert stopped.step == 5
