"""Online training (states extracted while training) equals offline training on the same
records, seed and settings, and writes no states under its output directory.

The extractor is :class:`~vllm_compat.extract.HiddenStatesExtractor` with its transformers
backend (``extract/hf_engine.py``) on a tiny Llama: a real forward on the CPU. vLLM does not
run here (its wheels are CUDA builds that cannot run a forward on this CPU), so the vLLM
engine is covered by tests/gpu/test_online_training_gpu.py. The offline reference is what
``eagle3 extract --replicas`` writes: work units (:mod:`vllm_compat.eagle3.units`) extracted
by the same extractor, merged, then ``train``.

Tolerance of the comparisons: 1e-6 on every logged metric and weight, the offline resume
tests' own. Both runs feed the same states (the transformers backend runs one prompt per
forward, so a prompt's states do not depend on what runs beside it), cast or FP8-coded the
same way, collated the same way, to the same fp32 trainer on one thread: they are expected
to be bit-identical (they are, 2026-12-03), and 1e-6 leaves room only for a summation order.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

pytest.importorskip("transformers")

from vllm_compat.eagle3 import units as U
from vllm_compat.eagle3.cli import main as cli_main
from vllm_compat.eagle3.colocated import MEMORY_PLAN, PlacementError
from vllm_compat.eagle3.online import OnlineConfig, online_units, train_online
from vllm_compat.eagle3.training import CHECKPOINTS, DATA_ORDER_CSV, METRICS_CSV, TrainConfig, train
from vllm_compat.eagle3.vocab import build_vocab
from vllm_compat.extract import HiddenStatesExtractor
from vllm_compat.target import read_target
from vllm_compat.testing.models import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUX = (1, 2)
NUM_RECORDS, BATCH, EPOCHS = 12, 2, 2
TOTAL = NUM_RECORDS // BATCH * EPOCHS
TOL = 1e-6


def write_records(directory: Path, n: int = NUM_RECORDS, vocab: int = 64) -> Path:
    """``prepared.jsonl`` as ``prepare`` writes it: chat-like records that open with the
    special ids (bos 1, then a reserved id at the top of the vocabulary), a masked prompt and
    a trained reply that ends on eos 2, and a blank line (prepare may leave one)."""
    g = torch.Generator().manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        k = int(torch.randint(4, 12, (1,), generator=g))
        body = torch.randint(3, vocab - 1, (k,), generator=g).tolist()
        ids = [1, vocab - 1] + body + [2]
        prompt = 2 + k // 2
        lines.append(json.dumps({"line": i + 1, "input_ids": ids,
                                 "loss_mask": [0] * prompt + [1] * (len(ids) - prompt)}) + "\n")
        if i == 5:
            lines.append("\n")
    (directory / "prepared.jsonl").write_text("".join(lines))
    return directory


def offline_dataset(target: str, records: Path, out: Path, dtype: str, per_unit: int = 4,
                    per_shard: int = 2) -> Path:
    """The offline pipeline's dataset: work units by the same extractor, merged."""
    t = read_target(target)
    spec = U.UnitSpec(t.hidden_size, AUX, t.num_hidden_layers, dtype, per_shard, t.manifest_entry())
    units = U.write_plan(out, records, per_unit, spec)
    fp8 = {"states_dtype": torch.float8_e4m3fn} if dtype == "float8_e4m3fn" else {}
    with HiddenStatesExtractor(target, layer_ids=[*AUX, t.num_hidden_layers], backend="transformers",
                               **fp8) as ex:
        for u in units:
            U.write_unit(ex, records, out, u, spec)
    U.merge_units(out)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("online")
    target = build_model("llama", d / "target", dtype=torch.float32, vocab_size=64, hidden_size=16,
                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=32)
    write_records(d / "prep")
    build_vocab(d / "prep", 64, draft_vocab_size=32, output_dir=d / "vocab", progress=False)
    return {"dir": d, "target": target, "prep": d / "prep", "vocab": d / "vocab"}


def cfg(tiny, out: Path, dataset: Path | None = None, **kw) -> TrainConfig:
    base = dict(dataset=str(dataset or tiny["prep"]), target=tiny["target"], vocab=str(tiny["vocab"]),
                output_dir=str(out), epochs=EPOCHS, batch_size=BATCH, lr=3e-3, warmup_steps=2,
                checkpoint_every=3, keep_checkpoints=2, dtype="fp32", progress=False, tensorboard=False)
    base.update(kw)
    return TrainConfig(**base)


def online(**kw) -> OnlineConfig:
    return OnlineConfig(**{"backend": "transformers", "aux_layer_ids": AUX, "queue_depth": 2,
                           "unit_steps": 4, **kw})


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def assert_same_run(a: Path, b: Path) -> None:
    ra, rb = rows(a / METRICS_CSV), rows(b / METRICS_CSV)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [str(s) for s in range(1, TOTAL + 1)]
    assert max(abs(float(x[k]) - float(y[k])) for x, y in zip(ra, rb) for k in x) <= TOL
    assert rows(a / DATA_ORDER_CSV) == rows(b / DATA_ORDER_CSV)
    wa = load_file(str(a / "final" / "draft.safetensors"))
    wb = load_file(str(b / "final" / "draft.safetensors"))
    assert wa.keys() == wb.keys()
    assert max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa) <= TOL


@pytest.fixture(scope="module")
def offline_bf16(tiny):
    ds = offline_dataset(tiny["target"], tiny["prep"], tiny["dir"] / "ds-bf16", "bfloat16")
    out = tiny["dir"] / "offline-bf16"
    assert train(cfg(tiny, out, ds)).step == TOTAL
    return out


@pytest.fixture(scope="module")
def online_bf16(tiny):
    out = tiny["dir"] / "online-bf16"
    assert train_online(cfg(tiny, out), online()).step == TOTAL
    return out


def test_online_gives_offline_training_losses_order_and_weights(offline_bf16, online_bf16):
    assert_same_run(offline_bf16, online_bf16)
    # the run was not trivially flat: the draft learned something
    r = rows(online_bf16 / METRICS_CSV)
    assert float(r[-1]["loss_0"]) < float(r[0]["loss_0"])


def test_online_fp8_states_are_coded_like_fp8_shards(tiny, offline_bf16, tmp_path):
    ds = offline_dataset(tiny["target"], tiny["prep"], tmp_path / "ds-fp8", "float8_e4m3fn")
    train(cfg(tiny, tmp_path / "offline", ds, max_steps=6))
    train_online(cfg(tiny, tmp_path / "online", max_steps=6), online(states_dtype="float8_e4m3fn"))
    a, b = rows(tmp_path / "offline" / METRICS_CSV), rows(tmp_path / "online" / METRICS_CSV)
    assert len(a) == len(b) == 6
    assert max(abs(float(x[k]) - float(y[k])) for x, y in zip(a, b) for k in x) <= TOL
    # and FP8 is not a no-op: the bf16 run's losses differ from it
    bf16 = rows(offline_bf16 / METRICS_CSV)[:6]
    assert max(abs(float(x["loss"]) - float(y["loss"])) for x, y in zip(a, bf16)) > 1e-7


def state_rows(dataset: Path) -> list[bytes]:
    """The bytes of every token's states (all layers of one token) of an extracted dataset,
    as bf16 (the shards' dtype) and float32: what a file holding states would contain."""
    from vllm_compat.eagle3.data import HiddenStatesDataset

    out = []
    for sample in HiddenStatesDataset(dataset):
        hs = sample["hidden_states"]
        for row in hs:
            out.append(row.contiguous().view(torch.uint8).numpy().tobytes())
            out.append(row.float().contiguous().view(torch.uint8).numpy().tobytes())
    return out


def test_no_state_bytes_are_written_under_the_output_directory(tiny, offline_bf16, online_bf16):
    files = {p: p.read_bytes() for p in online_bf16.rglob("*") if p.is_file()}
    names = sorted(str(p.relative_to(online_bf16)) for p in files)
    logs = [n for n in names if not n.startswith((CHECKPOINTS + "/", "final/"))]
    assert set(logs) <= {"train_config.json", "metrics.csv", "data_order.csv", "metrics.png",
                         MEMORY_PLAN, ".lock"}, logs
    # no token's states, in the shard dtype or float32, anywhere under the output directory
    # (checkpoints and final/ included): 0 state bytes
    rows_ = state_rows(tiny["dir"] / "ds-bf16")
    found = [(str(p.relative_to(online_bf16)), i) for p, data in files.items()
             for i, r in enumerate(rows_) if r in data]
    assert found == []
    with safe_open(str(online_bf16 / "final" / "draft.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if "hidden_states" in k]  # noqa: SIM118
    # nothing was added beside the records either
    assert sorted(p.name for p in tiny["prep"].iterdir()) == ["prepared.jsonl"]
    total = sum(len(d) for d in files.values())
    state_total = sum(len(r) for r in rows_[::2])
    print(f"output directory: {total} bytes in {len(files)} files ({names}); "
          f"the run's states in bf16: {state_total} bytes; state bytes found: 0")


def test_the_cache_is_the_offline_work_unit_dataset_and_is_read_back(tiny, offline_bf16, tmp_path):
    cache = tmp_path / "cache"
    kw = dict(cache=str(cache), samples_per_unit=4, samples_per_shard=2)
    train_online(cfg(tiny, tmp_path / "first"), online(**kw))
    assert_same_run(offline_bf16, tmp_path / "first")
    # byte for byte what the offline pipeline wrote, unit by unit
    ref = tiny["dir"] / "ds-bf16" / U.UNITS
    got = {str(p.relative_to(cache / U.UNITS)): p.read_bytes() for p in (cache / U.UNITS).rglob("*.*")
           if p.is_file() and "lock" not in p.name}
    want = {str(p.relative_to(ref)): p.read_bytes() for p in ref.rglob("*.*")
            if p.is_file() and "lock" not in p.name}
    assert got == want
    # generate on missing: a lost unit is extracted again, the others are only read
    lost = cache / U.UNITS / "unit-00001"
    kept = {p: p.stat().st_mtime_ns for p in (cache / U.UNITS / "unit-00000").iterdir()}
    import shutil

    shutil.rmtree(lost)
    train_online(cfg(tiny, tmp_path / "second"), online(**kw))
    assert_same_run(offline_bf16, tmp_path / "second")
    assert (lost / "manifest.json").is_file()
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    # merged, the cache is a dataset offline training reads
    U.merge_units(cache)
    train(cfg(tiny, tmp_path / "offline-from-cache", cache))
    assert_same_run(offline_bf16, tmp_path / "offline-from-cache")


def test_split_placement_passes_states_through_shared_memory(tiny, online_bf16, tmp_path):
    """The engine in a spawned process (CPU here, the transformers backend): the same run."""
    out = tmp_path / "split"
    train_online(cfg(tiny, out), online(placement="split"))
    assert_same_run(online_bf16, out)


def test_colocated_engine_process_is_the_same_run_behind_the_same_memory_plan(tiny, online_bf16,
                                                                           tmp_path, monkeypatch):
    """--engine-process: the co-located memory plan, then the engine in a spawned process on
    the trainer's device (the CPU here)."""
    from vllm_compat.eagle3 import split_engine

    started = []

    class Spy(split_engine.SplitEngine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append((k, self._proc.pid))

    monkeypatch.setattr(split_engine, "SplitEngine", Spy)
    out = tmp_path / "process"
    train_online(cfg(tiny, out), online(engine_process=True))
    assert_same_run(online_bf16, out)
    (kw, pid), = started
    assert kw["device"].type == "cpu" and pid != os.getpid()
    assert json.loads((out / MEMORY_PLAN).read_text())["draft_bytes"] > 0
    with pytest.raises(PlacementError):  # refused by the plan, before any engine starts
        train_online(cfg(tiny, tmp_path / "refused"), online(engine_process=True,
                                                             memory_limit_bytes=100_000))
    assert len(started) == 1


def test_colocated_refuses_what_does_not_fit_and_names_the_split_placement(tiny, tmp_path):
    out = tmp_path / "refused"
    with pytest.raises(PlacementError) as info:
        train_online(cfg(tiny, out), online(memory_limit_bytes=100_000))
    msg = str(info.value)
    assert "co-located placement needs about" in msg and "--engine-devices" in msg
    plan = json.loads((out / MEMORY_PLAN).read_text())
    assert plan["total_bytes"] > plan["limit_bytes"] == 100_000
    assert plan["draft_bytes"] > 0 and plan["optimizer_bytes"] > 0 and plan["weights_bytes"] > 0
    assert not (out / CHECKPOINTS).exists() and not (out / METRICS_CSV).exists()
    # with room enough it starts (and reports the same plan)
    assert train_online(cfg(tiny, out, max_steps=1), online(memory_limit_bytes=1 << 30)).step == 1


def test_online_units_cover_the_steps_aligned_to_each_epoch():
    assert list(online_units(6, 4, 0, 12)) == [(0, 4), (4, 6), (6, 10), (10, 12)]
    # a resume at step 3 re-extracts its unit from step 0; one at 7 from 6
    assert list(online_units(6, 4, 3, 8)) == [(0, 4), (4, 6), (6, 10)]
    assert list(online_units(6, 4, 7, 12)) == [(6, 10), (10, 12)]


def test_cli_online_run_and_option_checks(tiny, online_bf16, tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["eagle3", "train", str(tiny["prep"]), "--target", tiny["target"], "--vocab", str(tiny["vocab"]),
            "-o", str(out), "--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--lr", "3e-3",
            "--warmup-steps", "2", "--checkpoint-every", "3", "--dtype", "fp32", "--no-progress"]
    online_args = ["--online", "--backend", "transformers", "--aux-layer-ids", "1", "2",
                   "--queue-depth", "2", "--unit-steps", "4"]
    assert cli_main(args + online_args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == TOTAL
    assert_same_run(online_bf16, out)
    # the options are checked before anything loads: a user's mistake, exit 2 and one line
    for extra, message in (
            (["--cache", str(tmp_path / "c")], "--cache: only with --online"),
            (online_args + ["--kv-cache-memory-bytes", "1000"], "--kv-cache-memory-bytes: vLLM engine options"),
            (online_args[:-4] + ["--queue-depth", "0"], "queue_depth must be >= 1"),
            (["--trainer-stream"], "--trainer-stream: only with --online"),
            (online_args + ["--trainer-stream", "--engine-devices", "1"], "is for the co-located placement"),
            (["--engine-process"], "--engine-process: only with --online"),
            (online_args + ["--engine-process", "--trainer-stream"], "without --trainer-stream")):
        assert cli_main(args + extra) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "c").exists()


def test_tensorboard_scalars_under_online_when_installed(tiny, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is optional")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_online(cfg(tiny, tmp_path, max_steps=3, tensorboard=True), online())
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"online/loss", "online/acc_0", "online/extract_tokens_per_s", "online/train_tokens_per_s",
            "online/trainer_wait_s"} <= tags
    assert [e.step for e in acc.Scalars("online/loss")] == [1, 2, 3]
