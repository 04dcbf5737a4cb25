"""The EAGLE-3 example's pieces that run on the CPU: stdlib corpus, BPE tokenizer, target training, the
e2e ``pipeline`` phase (transformers extraction), and evaluate's metric arithmetic."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from examples.eagle3_e2e import corpus as C  # noqa: E402
from vllm_compat.eagle3 import evaluate as E  # noqa: E402

try:  # vLLM's own snapshot classes when vLLM is installed (not in the CPU test env)
    from vllm.v1.metrics.reader import Counter, Vector  # type: ignore
except ImportError:
    @dataclass
    class Counter:  # the fields of vllm.v1.metrics.reader.Counter
        name: str
        labels: dict
        value: int

    @dataclass
    class Vector:  # the fields of vllm.v1.metrics.reader.Vector
        name: str
        labels: dict
        values: list


@pytest.fixture(scope="module")
def fake_stdlib(tmp_path_factory) -> Path:
    """~30 small real stdlib files, plus files the corpus must skip or place."""
    root = tmp_path_factory.mktemp("stdlib")
    real = [(rel, p) for rel, p in C.stdlib_files(include_tests=False) if p.stat().st_size < 6000]
    for rel, p in real[:30]:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dst)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "foreign.py").write_text("x = 1\n")
    (root / "test").mkdir()
    (root / "test" / "test_thing.py").write_text("def test():\n    assert True\n")
    (root / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    (root / "blank.py").write_text("\n\n")
    return root


def test_real_stdlib_listing_is_sorted_and_excludes_site_packages():
    files = C.stdlib_files()
    rels = [r for r, _ in files]
    assert rels == sorted(rels) and len(rels) > 500
    assert not any(part in ("site-packages", "dist-packages") for r in rels for part in r.split("/"))
    assert all(r.endswith(".py") for r in rels)
    no_tests = C.stdlib_files(include_tests=False)
    assert len(no_tests) < len(files)
    assert not any(set(r.split("/")[:-1]) & C.TEST_DIRS for r, _ in no_tests)


def test_chunk_text_bounds_and_lossless():
    text = "a = 1\n" * 50 + "b" * 130 + "\n" + "   \n" + "def f():\n    return 2\n"
    chunks = C.chunk_text(text, 64)
    assert all(0 < len(c) <= 64 for c in chunks)
    assert "".join(chunks) == text.replace("   \n", "", 1) or "".join(chunks) == text
    assert C.chunk_text("x\n", 64) == ["x\n"]
    with pytest.raises(ValueError):
        C.chunk_text("x", 0)


def test_corpus_split_is_deterministic_and_disjoint(fake_stdlib, tmp_path):
    a = C.build_corpus(tmp_path / "a", root=fake_stdlib, eval_fraction=0.2, chunk_chars=500)
    b = C.build_corpus(tmp_path / "b", root=fake_stdlib, eval_fraction=0.2, chunk_chars=500)
    assert a == b
    for name in (C.TRAIN_DOCS, C.EVAL_DOCS, C.TRAIN_CHUNKS, C.EVAL_CHUNKS, C.TRAIN_TEXT):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    train = [d["path"] for d in C.read_jsonl(tmp_path / "a" / C.TRAIN_DOCS)]
    held = [d["path"] for d in C.read_jsonl(tmp_path / "a" / C.EVAL_DOCS)]
    assert held and train and not set(train) & set(held)
    assert "site-packages/foreign.py" not in train + held
    assert "test/test_thing.py" in train + held  # tests are included by default
    assert a.skipped == {"empty": 1, "not_utf8": 1}
    assert a.files_train + a.files_eval == len(train) + len(held) == 31
    assert a.bytes_eval == sum(len(d["text"].encode()) for d in C.read_jsonl(tmp_path / "a" / C.EVAL_DOCS))
    # the split is a function of the path alone
    assert all(C.is_heldout(p, 0.2) for p in held) and not any(C.is_heldout(p, 0.2) for p in train)
    chunks = C.read_jsonl(tmp_path / "a" / C.EVAL_CHUNKS)
    assert {c["path"] for c in chunks} == set(held)
    assert all(c["prompt"] == "" and 0 < len(c["completion"]) <= 500 for c in chunks)
    # another salt gives another split, same files
    c = C.build_corpus(tmp_path / "c", root=fake_stdlib, eval_fraction=0.2, salt="x")
    assert c.files_train + c.files_eval == 31
    assert json.loads((tmp_path / "a" / C.REPORT).read_text())["files_eval"] == a.files_eval


@pytest.fixture(scope="module")
def tokenizer_dir(fake_stdlib, tmp_path_factory) -> Path:
    from examples.eagle3_e2e.tokenizer_train import train_tokenizer

    d = tmp_path_factory.mktemp("corpus")
    C.build_corpus(d, root=fake_stdlib, eval_fraction=0.2, chunk_chars=600)
    train_tokenizer(d / C.TRAIN_TEXT, d / "tok", vocab_size=400)
    return d


def test_tokenizer_round_trip_and_autotokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir / "tok"), local_files_only=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert len(tok) == 400
    for s in ("def f(x):\n    return x  # café ünïcode ✓\n", "\t\t  \n", "𝔘𝔫𝔦"):
        ids = tok(s)["input_ids"]
        assert ids[0] == tok.bos_token_id  # the post-processor frames like the target's training data
        assert tok.decode(ids, skip_special_tokens=True) == s
        assert tok(s, add_special_tokens=False)["input_ids"] == ids[1:]
    cfg = json.loads((tokenizer_dir / "tok" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def _tiny_target_cfg(tokenizer_dir: Path, out: Path, **kw):
    from examples.eagle3_e2e.target_train import TargetTrainConfig

    base = dict(corpus_dir=str(tokenizer_dir), tokenizer_dir=str(tokenizer_dir / "tok"), output_dir=str(out),
                hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, seq_len=32, batch_size=8, lr=1e-2, warmup_steps=2, max_steps=25,
                eval_tokens=512, log_every=5, device="cpu")
    base.update(kw)
    return TargetTrainConfig(**base)


def test_target_training_lowers_loss_and_reloads_identically(tokenizer_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from examples.eagle3_e2e.target_train import train_target

    rep, model = train_target(_tiny_target_cfg(tokenizer_dir, tmp_path / "t"), log=lambda *_: None,
                              return_model=True)
    assert rep["steps"] == 25 and rep["tokens_seen"] == 25 * 8 * 32
    assert rep["heldout"]["loss"] < rep["heldout_initial"]["loss"] - 0.3
    assert rep["train_loss_last"] < rep["train_loss_first"]
    saved = json.loads((tmp_path / "t" / "train_report.json").read_text())
    assert saved["heldout"] == rep["heldout"]
    assert rep["selection"] and 1 <= rep["selected_step"] <= 25  # the final selection check always runs
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "t"), dtype=torch.bfloat16).eval()
    ids = torch.tensor([[0, 5, 17, 99, 3, 250, 7]])
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, reloaded(input_ids=ids).logits)
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "t"), local_files_only=True)
    assert tok.bos_token_id == reloaded.config.bos_token_id == 0
    gen = json.loads((tmp_path / "t" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1


def test_eval_windows_are_disjoint_and_capped():
    from examples.eagle3_e2e.target_train import eval_windows

    stream = torch.arange(1000)
    report, select = eval_windows(stream, 10, 30)
    assert len(report) == len(select) == 3 and all(len(w) == 11 for w in report + select)
    starts_r, starts_s = {int(w[0]) for w in report}, {int(w[0]) for w in select}
    assert starts_r == {0, 20, 40} and starts_s == {10, 30, 50}
    # predicted positions (w[1:]) never overlap between the two sets
    assert not {int(t) for w in report for t in w[1:]} & {int(t) for w in select for t in w[1:]}
    short = torch.arange(15)
    assert eval_windows(short, 10, 30) == ([short], [short])


def _tiny_target(e2e, fake_stdlib, tmp_path) -> tuple[Path, Path, list[str]]:
    """The target phase on the CPU: a 4-layer Llama trained 4 steps on the fake stdlib."""
    work, out = tmp_path / "w", tmp_path / "out"
    common = ["--work", str(work), "--out", str(out), "--device", "cpu"]
    assert e2e.main(["target", *common, "--stdlib-root", str(fake_stdlib), "--eval-fraction", "0.2",
                     "--chunk-chars", "300", "--vocab-size", "300", "--hidden", "32", "--layers", "4",
                     "--heads", "4", "--kv-heads", "2", "--intermediate", "64", "--seq-len", "32",
                     "--batch", "4", "--target-steps", "4", "--warmup", "1", "--eval-tokens", "128"]) == 0
    return work, out, common


def test_pipeline_phase_on_cpu_through_export_and_validate(fake_stdlib, tmp_path):
    from examples.eagle3_e2e import e2e

    work, out, common = _tiny_target(e2e, fake_stdlib, tmp_path)
    assert json.loads((work / "target.done").read_text())["status"] == "ok"
    assert e2e.main(["pipeline", *common, "--model", "llama", "--extract-backend", "transformers",
                     "--extract-dtype", "float32", "--max-records", "6", "--draft-minutes", "0.05",
                     "--draft-batch", "2", "--ttt-steps", "2", "--draft-warmup", "1", "--max-model-len", "256",
                     "--wait-timeout", "5", "--train-after", str(work / "target.done")]) == 0
    steps = json.loads((out / "e2e.json").read_text())["steps"]
    got = [(s["phase"], s["step"], s["status"]) for s in steps]
    assert [g for g in got if g[2] != "ok"] == []
    assert [s for _, s, _ in got] == ["corpus", "tokenizer", "target_train", "_phase", "wait_target", "prepare",
                                      "merge", "extract", "vocab", "wait_before_training", "train_draft",
                                      "export", "validate", "_phase"]
    waited = next(s for s in steps if s["step"] == "wait_before_training")["result"]
    assert waited["found"] is True and waited["waited_s"] < 5
    assert all(isinstance(s["wall_s"], float) for s in steps)
    tr = next(s for s in steps if s["step"] == "train_draft")["result"]
    assert len(tr["calibration_runs_s"]) == 3 and tr["steps"] >= 1 and tr["device"] == "cpu"
    # the timed steps ran once before they were timed (a warm-up of the same steps)
    first, short, timed = tr["calibration_run_steps"]
    assert first == timed > short == 2
    val = next(s for s in steps if s["step"] == "validate")["result"]
    assert val["ok"] and val["problems"] == []
    cfg = json.loads((work / "llama" / "draft" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # 4 layers: the last three of 1..L-1
    assert (out / "work" / "llama" / "target" / "train_report.json").exists()
    import tarfile
    with tarfile.open(out / "work-artifacts.tar.gz") as tar:  # the reports as one archive
        assert "work/llama/target/train_report.json" in tar.getnames()
    assert not list(out.rglob("*.safetensors"))  # reports only, no weights


def test_pipeline_online_trains_the_same_steps_on_the_same_records(fake_stdlib, tmp_path):
    """``--online``: a second draft trained with states streamed from the target (transformers
    on the CPU here, batch-independent), for the offline draft's steps on the records of its
    dataset: the same data order and the same per-step losses, no state file of its own, and
    it exports and validates like the offline one."""
    import csv

    from examples.eagle3_e2e import e2e

    work, out, common = _tiny_target(e2e, fake_stdlib, tmp_path)
    assert e2e.main(["pipeline", *common, "--model", "llama", "--extract-backend", "transformers",
                     "--extract-dtype", "float32", "--max-records", "6", "--draft-steps", "5",
                     "--draft-batch", "2", "--ttt-steps", "2", "--draft-warmup", "1", "--max-model-len", "256",
                     "--wait-timeout", "5", "--online"]) == 0
    steps = {s["step"]: s for s in json.loads((out / "e2e.json").read_text())["steps"]}
    assert [k for k in ("train_draft_online", "export_online", "validate_online") if steps[k]["status"] != "ok"] == []
    on = steps["train_draft_online"]["result"]
    assert on["steps"] == steps["train_draft"]["result"]["steps"] == 5 and on["records"] == 6
    assert steps["validate_online"]["result"]["ok"]

    def rows(run: str, name: str) -> list[dict[str, str]]:
        with (work / "llama" / run / name).open(newline="") as f:
            return list(csv.DictReader(f))

    assert rows("run_online", "data_order.csv") == rows("run", "data_order.csv")
    # an untrained draft's loss is about 2 log(vocab) for any record: the gradient's norm is
    # what tells records apart (8 % for the same steps over other records)
    for x, y in zip(rows("run_online", "metrics.csv"), rows("run", "metrics.csv"), strict=True):
        assert float(x["loss"]) == pytest.approx(float(y["loss"]), rel=1e-6)
        assert float(x["grad_norm"]) == pytest.approx(float(y["grad_norm"]), rel=1e-3)
    run_online = work / "llama" / "run_online"
    assert not [p for p in run_online.rglob("*.safetensors") if "final" not in p.parts and "checkpoint" not in str(p)]
    assert (work / "llama" / "draft_online" / "config.json").exists()
    # a later run without --online leaves no online draft of the earlier one for evaluate to serve
    assert e2e.main(["pipeline", *common, "--model", "llama", "--extract-backend", "transformers",
                     "--extract-dtype", "float32", "--max-records", "6", "--draft-steps", "2",
                     "--draft-batch", "2", "--ttt-steps", "2", "--draft-warmup", "1", "--max-model-len", "256",
                     "--wait-timeout", "5"]) == 0
    assert not (work / "llama" / "draft_online").exists()


def test_online_vs_offline_pairs_each_k_and_run():
    from examples.eagle3_e2e import e2e

    def row(method, k, run, al, status="ok"):
        return {"method": method, "k": k, "run": run, "status": status, "acceptance_length": al}

    offline = [row("eagle3", 3, "batch1", 3.0), row("eagle3", 3, "batched", 2.8), row("ngram", 3, "batch1", 2.5),
               row("eagle3", 5, "batch1", 4.0)]
    online = [row("eagle3", 3, "batch1", 2.97), row("eagle3", 3, "batched", 2.8), row("eagle3", 5, "batch1", None)]
    got = e2e.online_vs_offline(offline, online)
    assert [(g["k"], g["run"]) for g in got] == [(3, "batch1"), (3, "batched")]
    assert got[0]["online_over_offline"] == pytest.approx(0.99)
    assert got[1]["offline_acceptance_length"] == got[1]["online_acceptance_length"] == 2.8


def test_a_lost_report_folder_does_not_fail_a_finished_step(tmp_path, capsys):
    """A report folder emptied or removed by something else while a phase runs must not fail
    the phase (a real run trained and saved the target, then failed writing e2e.json.tmp).
    The record lives in work/; the out/ copy is best effort (recreated, or skipped with a log)."""
    import shutil

    from examples.eagle3_e2e import e2e

    work, out = tmp_path / "w", tmp_path / "out"
    rec = e2e.Recorder(work, out, "target")
    with rec.step("emptied") as r:
        shutil.rmtree(out)  # emptied by something else
        r["x"] = 1
    with rec.step("blocked") as r:
        shutil.rmtree(out)
        out.write_text("not a folder")  # out cannot be written at all
    rows = [json.loads(x) for x in (work / e2e.JSONL).read_text().splitlines()]
    assert [(x["step"], x["status"]) for x in rows] == [("emptied", "ok"), ("blocked", "ok")]
    assert "could not write the report copy" in capsys.readouterr().out
    out.unlink()
    rec.mirror()  # once out is usable again the copy has every step
    assert [x["step"] for x in json.loads((out / e2e.SUMMARY).read_text())["steps"]] == ["emptied", "blocked"]


def test_pipeline_reports_a_failed_target_phase(tmp_path):
    from examples.eagle3_e2e import e2e

    work = tmp_path / "w"
    work.mkdir()
    e2e.write_marker(work, "target", status="error", error="boom")
    assert e2e.main(["pipeline", "--work", str(work), "--out", str(tmp_path / "o"), "--wait-timeout", "1"]) == 1
    steps = json.loads((tmp_path / "o" / "e2e.json").read_text())["steps"]
    assert steps[0]["step"] == "wait_target" and steps[0]["status"] == "error" and "boom" in steps[0]["error"]


@pytest.mark.parametrize("flags", [["--top-p", "0.95"], ["--sd-top-p", "0.9", "--temperature", "1"]])
def test_a_nucleus_on_a_greedy_run_is_refused_before_any_phase_starts(flags, tmp_path, capsys):
    from examples.eagle3_e2e import e2e

    work = tmp_path / "w"
    with pytest.raises(SystemExit) as exc:
        e2e.main(["evaluate", "--work", str(work), *flags])
    assert exc.value.code == 2
    flag = flags[0]
    assert f"{flag} {flags[1]} only applies to sampled runs" in capsys.readouterr().err
    assert not work.exists()  # refused before a Recorder wrote anything


def test_a_nucleus_with_its_temperature_is_accepted():
    from examples.eagle3_e2e import e2e

    p = e2e.build_parser()
    a = p.parse_args(["evaluate", "--work", "w", "--temperature", "1", "--top-p", "0.95",
                      "--sd-temperature", "0.7", "--sd-top-p", "0.9"])
    e2e._refuse_flags_of_sampled_runs(p, a)  # no SystemExit
    assert (a.top_p, a.sd_top_p) == (0.95, 0.9)


def test_an_acceptance_ceiling_on_a_greedy_run_is_refused_before_any_phase_starts(tmp_path, capsys):
    from examples.eagle3_e2e import e2e

    work = tmp_path / "w"
    with pytest.raises(SystemExit) as exc:
        e2e.main(["all", "--model", "kimi", "--work", str(work), "--acceptance-ceiling"])
    assert exc.value.code == 2
    assert "--acceptance-ceiling measures sampled runs: add --temperature" in capsys.readouterr().err
    assert not work.exists()


def test_an_acceptance_ceiling_with_sampling_is_accepted():
    from examples.eagle3_e2e import e2e

    p = e2e.build_parser()
    a = p.parse_args(["all", "--model", "kimi", "--work", "w", "--temperature", "1", "--top-p", "0.95",
                      "--acceptance-ceiling"])
    e2e._refuse_flags_of_sampled_runs(p, a)  # no SystemExit
    assert a.acceptance_ceiling


def test_pipeline_fails_fast_when_the_target_process_died(tmp_path):
    import subprocess
    import sys
    import time

    from examples.eagle3_e2e import e2e

    work = tmp_path / "w"
    work.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (work / e2e.PID_FILE).write_text(f"{dead.pid}\n")
    t0 = time.perf_counter()
    assert e2e.main(["pipeline", "--work", str(work), "--wait-timeout", "60"]) == 1
    assert time.perf_counter() - t0 < 30
    rec = json.loads((work / e2e.JSONL).read_text().splitlines()[0])
    assert rec["status"] == "error" and "ended without writing" in rec["error"]


# --------------------------------------------------------------------------- evaluate arithmetic


def _snapshot(drafts, draft_tokens, accepted, per_pos, engine="0"):
    labels = {"model_name": "/t", "engine": engine}
    return [
        Counter(name="vllm:spec_decode_num_drafts", labels=labels, value=drafts),
        Counter(name="vllm:spec_decode_num_draft_tokens", labels=labels, value=draft_tokens),
        Counter(name="vllm:spec_decode_num_accepted_tokens", labels=labels, value=accepted),
        Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels, values=per_pos),
        Counter(name="vllm:generation_tokens", labels=labels, value=12345),  # ignored
    ]


def test_spec_counters_deltas_and_acceptance():
    before = E.spec_counters(_snapshot(10, 30, 12, [6, 4, 2]))
    after = E.spec_counters(_snapshot(110, 330, 192, [86, 64, 42]))
    d = after - before
    assert (d.drafts, d.draft_tokens, d.accepted, d.accepted_per_pos) == (100, 300, 180, [80, 60, 40])
    # 4 requests, 400 generated tokens: 400 - 180 = 220 target steps (4 of them prefill)
    acc = E.acceptance(d, generated_tokens=400, num_requests=4)
    assert acc["acceptance_length"] == pytest.approx(2.8)
    assert acc["per_position"] == pytest.approx([0.8, 0.6, 0.4])
    assert sum(acc["per_position"]) == pytest.approx(acc["acceptance_length"] - 1)
    assert acc["draft_acceptance_rate"] == pytest.approx(0.6)
    assert acc["effective_acceptance_length"] == pytest.approx(400 / 220)
    assert acc["draft_coverage"] == pytest.approx(100 / 216)
    # two engines' label sets add up; a baseline snapshot (no spec metrics) reads as zero
    two = E.spec_counters(_snapshot(1, 3, 2, [1, 1, 0]) + _snapshot(2, 6, 1, [1, 0, 0], engine="1"))
    assert (two.drafts, two.accepted, two.accepted_per_pos) == (3, 3, [2, 1, 0])
    assert E.spec_counters([Counter(name="vllm:num_requests", labels={}, value=3)]) == E.SpecCounters()
    assert E.acceptance(E.SpecCounters(), 10, 1)["acceptance_length"] is None
    with pytest.raises(ValueError, match="went down"):
        _ = before - after


def test_spec_counters_from_vllms_own_prometheus_path():
    """With vLLM installed: the engine's SpecDecodingProm fed with scheduler stats as the
    scheduler makes them, read back through get_metrics_snapshot (what LLM.get_metrics returns)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.metrics.prometheus import unregister_vllm_metrics
    from vllm.v1.metrics.reader import get_metrics_snapshot
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    unregister_vllm_metrics()
    try:
        prom = SpecDecodingProm(SimpleNamespace(num_speculative_tokens=3), ["model_name", "engine"], {0: ["m", "0"]})
        before = E.spec_counters(get_metrics_snapshot())
        for accepted in (3, 0, 1, 3, 2):  # five drafts of three tokens
            st = SpecDecodingStats.new(3)
            st.observe_draft(num_draft_tokens=3, num_accepted_tokens=accepted)
            prom.observe(st)
        d = E.spec_counters(get_metrics_snapshot()) - before
        assert (d.drafts, d.draft_tokens, d.accepted, d.accepted_per_pos) == (5, 15, 9, [4, 3, 2])
        assert E.acceptance(d, generated_tokens=14, num_requests=1)["acceptance_length"] == pytest.approx(1 + 9 / 5)
    finally:
        unregister_vllm_metrics()


def test_match_baseline():
    m = E.match_baseline([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert m == {"exact": 1, "total": 2, "exact_fraction": 0.5, "mean_prefix_fraction": pytest.approx((1 + 1 / 3) / 2)}
    with pytest.raises(ValueError):
        E.match_baseline([[1]], [])


def test_planned_configs_order_and_speculative_configs(tmp_path):
    cfg = E.EvalConfig(target="/t", draft=str(tmp_path), prompts_file="p", output_dir="o", ks=[3, 1], ngram_ks=[3, 5])
    plans = E.planned_configs(cfg)
    assert [p["name"] for p in plans] == ["baseline", "eagle3-k3", "ngram-k3", "eagle3-k1", "ngram-k5"]
    assert plans[1]["speculative_config"] == {"method": "eagle3", "model": str(tmp_path.resolve()),
                                              "num_speculative_tokens": 3}
    assert plans[2]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    no_draft = E.planned_configs(E.EvalConfig(target="/t", draft=None, prompts_file="p", output_dir="o",
                                              ks=[3], ngram_ks=[]))
    assert [p["name"] for p in no_draft] == ["baseline"]


def test_build_prompts(tokenizer_dir):
    prompts, paths = E.build_prompts(tokenizer_dir / "tok" / "tokenizer.json", tokenizer_dir / C.EVAL_CHUNKS, 16, 5)
    assert len(prompts) == 5 and all(len(p) == 16 and p[0] == 0 for p in prompts)
    assert set(paths) <= {d["path"] for d in C.read_jsonl(tokenizer_dir / C.EVAL_DOCS)}
    with pytest.raises(ValueError, match="prompts wanted"):
        E.build_prompts(tokenizer_dir / "tok" / "tokenizer.json", tokenizer_dir / C.EVAL_CHUNKS, 16, 10 ** 6)


def _result() -> dict:
    """A result as evaluate() assembles it, from counter deltas built like the engine's."""
    def run(tok_s, gen, n, delta=None, match=None):
        r = {"requests": n, "generated_tokens": gen, "wall_s": gen / tok_s, "output_tok_s": tok_s,
             "spec": E.acceptance(delta, gen, n) if delta else None}
        if match is not None:
            r["match_baseline"] = match
        return r

    same = E.match_baseline([[1, 2]], [[1, 2]])
    configs = [{"name": "baseline", "method": None, "k": None, "status": "ok",
                "runs": {"batch1": run(500.0, 2048, 8), "batch32": run(9000.0, 8192, 32)}}]
    for method, k, al in (("eagle3", 1, 1.8), ("eagle3", 3, 2.6), ("ngram", 3, 2.9)):
        drafts = 1000
        acc = round((al - 1) * drafts)
        per = [min(acc, drafts)] + [max(0, acc - drafts * i) // 2 for i in range(1, k)]
        d = E.SpecCounters(drafts, drafts * k, acc, per[:k])
        configs.append({"name": f"{method}-k{k}", "method": method, "k": k, "status": "ok",
                        "runs": {"batch1": run(500.0 * al * 0.8, 2048, 8, d, same),
                                 "batch32": run(9000.0 * al * 0.6, 8192, 32, d, same)}})
    configs.append({"name": "ngram-k1", "method": "ngram", "k": 1, "status": "error", "error": "RuntimeError: x"})
    return {"label": "t", "vllm_version": "0.26.0", "target": "/t", "draft": "/d",
            "prompts": {"count": 32, "prompt_len": 128, "max_tokens": 256}, "configs": configs}


def test_summary_markdown_and_plot(tmp_path):
    res = _result()
    s = E.summarize(res)
    row = next(r for r in s["rows"] if r["config"] == "eagle3-k3" and r["run"] == "batch32")
    assert row["speedup"] == pytest.approx(2.6 * 0.6) and row["acceptance_length"] == pytest.approx(2.6)
    assert row["match_exact_fraction"] == 1.0
    assert any(r["config"] == "ngram-k1" and r["status"] == "error" for r in s["rows"])
    cmp3 = [c for c in s["eagle3_vs_ngram"] if c["k"] == 3]
    assert len(cmp3) == 2 and all(c["eagle3_beats_ngram"] is False for c in cmp3)
    md = E.markdown_table({**res, "summary": s})
    assert "| eagle3-k3 | batch32 |" in md and "ngram-k1" in md
    png = E.plot({**res, "summary": s}, tmp_path / "e.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert png is None
    else:
        assert png is not None and png.stat().st_size > 1000


def test_self_distill_prompts_reach_the_requested_count():
    """One prompt per record capped the 2026-11-29 run at 2967 of 4096; windows deeper into
    the records make up the rest, all distinct, all prompt_len long, seeded."""
    from examples.eagle3_e2e.e2e import self_distill_prompts

    recs = [{"input_ids": list(range(1000 * i, 1000 * i + n))} for i, n in enumerate([600, 50, 300, 1000, 64])]
    few = self_distill_prompts(recs, 3, 64, seed=1)
    assert len(few) == 3 and all(p[0] % 1000 == 0 for p in few)  # record starts first
    many = self_distill_prompts(recs, 9, 64, seed=1)
    assert len(many) == 9 and all(len(p) == 64 for p in many)
    assert len({tuple(p) for p in many}) == 9
    # 4 records reach 64 tokens; deeper windows at 256, 512 (record 0) and 256, 512, 768
    # (record 3): 9 windows in all, so asking for 100 gives those 9
    allw = self_distill_prompts(recs, 100, 64, seed=1)
    assert sorted(p[0] for p in allw) == [0, 256, 512, 2000, 3000, 3256, 3512, 3768, 4000]
    assert sorted(many) == sorted(allw)
    assert self_distill_prompts(recs, 9, 64, seed=1) == many  # seeded


def test_wait_for_file_gives_up_after_the_timeout(tmp_path):
    from examples.eagle3_e2e.e2e import wait_for_file

    r = wait_for_file(tmp_path / "never", 0.3, poll_s=0.05)
    assert r["found"] is False and 0.3 <= r["waited_s"] < 2
    (tmp_path / "now").touch()
    assert wait_for_file(tmp_path / "now", 5)["found"] is True


def test_kimi_target_phase_writes_a_kimi_k25_checkpoint_and_prepares_chats(fake_stdlib, tmp_path):
    """``--model kimi``: Kimi's tokenizer layout with merges learned from the corpus, a trained
    Kimi-K2.5-shaped target written as a Kimi-K2.5 checkpoint, and training chats rendered
    with the checkpoint's chat template (its tokenizer is code: loaded with trust_remote_code)."""
    pytest.importorskip("tiktoken")
    from examples.eagle3_e2e import e2e
    from vllm_compat.eagle3.prepare import PREPARED, prepare
    from vllm_compat.tokenizer import RemoteCodeRefusedError, load_tokenizer

    work = tmp_path / "w"
    assert e2e.main(["target", "--work", str(work), "--device", "cpu", "--model", "kimi",
                     "--stdlib-root", str(fake_stdlib), "--eval-fraction", "0.2", "--chunk-chars", "300",
                     "--seq-len", "32", "--batch", "2", "--target-steps", "2", "--warmup", "1",
                     "--eval-tokens", "64", "--select-every-s", "0"]) == 0
    target = work / "kimi" / "target"
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["text_config"]["model_type"] == "kimi_k2" and cfg["text_config"]["vocab_size"] == 163840
    assert not (target / "tokenizer.json").exists() and (target / "tiktoken.model").exists()
    rep = json.loads((target / "train_report.json").read_text())
    assert rep["family"] == "kimi_k25" and rep["steps"] == 2
    with pytest.raises(RemoteCodeRefusedError):
        load_tokenizer(target)
    chats = tmp_path / "chats.jsonl"
    e2e.select_records(work / "corpus" / C.TRAIN_CHUNKS, chats, 3, 0, as_chat=True)
    out = prepare(chats, target, tmp_path / "prep", max_length=512, trust_remote_code=True)
    assert out.kept == 3
    row = json.loads((tmp_path / "prep" / PREPARED).read_text().splitlines()[0])
    tok = load_tokenizer(target, trust_remote_code=True)
    text = tok.decode(row["input_ids"])
    assert "<|im_user|>" in text and "<|im_assistant|>" in text  # Kimi's chat markers
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert masked and "<|im_user|>" not in tok.decode(masked)  # loss on the assistant turn only
