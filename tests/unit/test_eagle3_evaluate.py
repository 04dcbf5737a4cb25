"""``eagle3 evaluate`` when a configuration fails: each configuration runs in its own process
(the real ``run_isolated``), a failure is recorded and named, the others are measured and
kept, and the step fails (``EvaluationError``, exit code 1 of ``vllm-compat eagle3 evaluate``
and of the e2e ``evaluate`` phase, the failed configurations on stderr, nothing labelled ok).

The engine side is ``_isolation_helpers.cell``: vLLM cannot run on the CPU, so each process
returns made-up numbers derived from its prompts, or raises / dies for the configuration it is
told to; everything around it (processes, bookkeeping, reports, exit codes) is the real code."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

import _isolation_helpers as H  # noqa: E402
from vllm_compat.eagle3 import cli  # noqa: E402
from vllm_compat.eagle3 import evaluate as E  # noqa: E402

TEXT = "def f(x):\n    return [x * i for i in range(10)]  # squares and more\n" * 40


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A target directory with ``tokenizer.json``, held-out chunks, a draft directory."""
    from examples.eagle3_e2e.tokenizer_train import train_bpe

    root = tmp_path_factory.mktemp("eval")
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")  # the command checks a model directory has one
    train_bpe(texts=[TEXT], vocab_size=300).save(str(target / "tokenizer.json"))
    chunks = root / "eval.jsonl"
    chunks.write_text("".join(json.dumps({"path": f"m{i}.py", "prompt": TEXT[i * 50:], "completion": ""})
                              + "\n" for i in range(6)))
    draft = root / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    return {"root": root, "target": target, "chunks": chunks, "draft": draft}


def config(files: dict[str, Path], out: Path, **engine) -> E.EvalConfig:
    return E.EvalConfig(target=str(files["target"]), draft=str(files["draft"]),
                        prompts_file=str(files["chunks"]), output_dir=str(out), ks=[3, 1], ngram_ks=[3],
                        prompt_len=12, max_tokens=8, batch_prompts=4, batch1_prompts=2,
                        engine_kwargs={"log": str(out.parent / f"{out.name}-cells.jsonl"), **engine})


def cells_run(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out.parent / f"{out.name}-cells.jsonl").read_text().splitlines()]


def test_a_failing_configuration_fails_the_step_and_the_others_are_kept(files, tmp_path):
    out = tmp_path / "eval"
    with pytest.raises(E.EvaluationError) as info:
        E.evaluate(config(files, out, fail="eagle3-k3"), cell_fn=H.cell, log=lambda m: None)
    err = info.value
    assert err.failed == [{"name": "eagle3-k3", "error_type": "ValueError",
                           "error": "ValueError: num_speculative_tokens=3 is not possible"}]
    assert "1 of 4 evaluation configurations failed: eagle3-k3 (ValueError: " in str(err)
    res = err.result
    assert res["status"] == "partial"
    assert [(c["name"], c["status"]) for c in res["configs"]] == [
        ("baseline", "ok"), ("eagle3-k3", "error"), ("ngram-k3", "ok"), ("eagle3-k1", "ok")]
    bad = res["configs"][1]
    assert "raise ValueError" in bad["traceback"] and "runs" not in bad
    # the configurations after the failure ran, each in a process of its own
    ran = cells_run(out)
    assert [r["name"] for r in ran] == ["baseline", "eagle3-k3", "ngram-k3", "eagle3-k1"]
    assert len({r["pid"] for r in ran}) == 4 and os.getpid() not in {r["pid"] for r in ran}
    # the measured configurations keep their numbers, on disk too
    on_disk = json.loads((out / E.RESULT_JSON).read_text())
    for c in (res["configs"][i] for i in (0, 2, 3)):
        disk = next(d for d in on_disk["configs"] if d["name"] == c["name"])
        assert disk["runs"] == c["runs"] and set(c["runs"]) == {"batch1", "batch4"}
        assert c["runs"]["batch4"]["generated_tokens"] == 4 * 8
    assert res["configs"][3]["runs"]["batch4"]["match_baseline"]["exact_fraction"] == 1.0
    assert on_disk["status"] == "partial" and on_disk["failed"] == err.failed
    rows = {(r["config"], r.get("run")): r for r in res["summary"]["rows"]}
    assert rows[("eagle3-k3", None)]["status"] == "error"
    assert rows[("eagle3-k1", "batch4")]["acceptance_length"] == pytest.approx(1.7)
    md = (out / E.RESULT_MD).read_text()
    assert "**partial**: failed: eagle3-k3 (ValueError)" in md and "| eagle3-k1 | batch4 |" in md


def test_a_configuration_whose_process_dies_is_recorded_and_the_run_goes_on(files, tmp_path):
    out = tmp_path / "eval"
    res = E.evaluate(config(files, out, crash="ngram-k3"), cell_fn=H.cell, log=lambda m: None,
                     raise_on_error=False)
    assert res["status"] == "partial"
    assert [f["name"] for f in res["failed"]] == ["ngram-k3"]
    assert res["failed"][0]["error_type"] == "SIGABRT"
    assert "killed by SIGABRT" in res["failed"][0]["error"]
    assert [c["status"] for c in res["configs"]] == ["ok", "ok", "error", "ok"]


def test_nothing_measured_is_status_failed(files, tmp_path):
    out = tmp_path / "eval"
    cfg = config(files, out, fail="baseline")
    cfg.ks, cfg.ngram_ks = [], []
    res = E.evaluate(cfg, cell_fn=H.cell, log=lambda m: None, raise_on_error=False)
    assert res["status"] == "failed" and [f["name"] for f in res["failed"]] == ["baseline"]


def _cli_args(files: dict[str, Path], out: Path, **engine) -> list[str]:
    kw = {"log": str(out.parent / f"{out.name}-cells.jsonl"), **engine}
    return ["eagle3", "evaluate", str(files["target"]), "--draft", str(files["draft"]),
            "--prompts", str(files["chunks"]), "-o", str(out), "--k", "3", "--ngram-k", "3",
            "--prompt-len", "12", "--max-tokens", "8", "--batch-prompts", "4", "--batch1-prompts", "2",
            "--engine-kwargs", json.dumps(kw)]


def test_cli_exits_1_and_names_the_failed_configuration_on_stderr(files, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(E, "run_cell", H.cell)  # the engine side, as above
    monkeypatch.setattr(cli, "vllm_can_run", lambda: (True, ""))  # the cells need no vLLM
    assert cli.main(_cli_args(files, tmp_path / "bad", fail="eagle3-k3")) == 1
    cap = capsys.readouterr()
    assert "evaluate: eagle3-k3 FAILED: ValueError: num_speculative_tokens=3 is not possible" in cap.err
    assert "1 of 3 configurations failed (partial)" in cap.err
    assert re.search(r"\bok\b", cap.out, re.IGNORECASE) is None
    assert cli.main(_cli_args(files, tmp_path / "good")) == 0
    cap = capsys.readouterr()
    assert "FAILED" not in cap.err and json.loads(cap.out[cap.out.index("[\n"):])[0]["k"] == 3
    res = json.loads((tmp_path / "good" / E.RESULT_JSON).read_text())
    assert res["status"] == "ok" and res["failed"] == [] and res["skipped"] == []
    assert [c["status"] for c in res["configs"]] == ["ok"] * 3
    assert "**" not in (tmp_path / "good" / E.RESULT_MD).read_text()


def test_e2e_evaluate_phase_fails_names_the_configuration_and_keeps_the_rest(files, tmp_path, monkeypatch,
                                                                            capsys):
    import shutil

    from examples.eagle3_e2e import e2e

    monkeypatch.setattr(E, "run_cell", H.cell)
    work, out = tmp_path / "w", tmp_path / "o"
    shutil.copytree(files["target"], work / "llama" / "target")
    shutil.copytree(files["draft"], work / "llama" / "draft")
    (work / "corpus").mkdir(parents=True)
    shutil.copy(files["chunks"], work / "corpus" / "eval.jsonl")
    kw = {"fail": "eagle3-k1", "log": str(tmp_path / "cells.jsonl")}
    rc = e2e.main(["evaluate", "--work", str(work), "--out", str(out), "--model", "llama", "--k", "3", "1",
                   "--ngram-k", "3", "--prompt-len", "12", "--max-tokens", "8", "--batch-prompts", "4",
                   "--batch1-prompts", "2", "--engine-kwargs", json.dumps(kw)])
    cap = capsys.readouterr()
    assert rc == 1
    assert "evaluate: eagle3-k1 FAILED: ValueError: num_speculative_tokens=1 is not possible" in cap.err
    assert "evaluate/evaluate: ok" not in cap.out and "evaluate/evaluate: error" in cap.out
    steps = {(s["step"]): s for s in json.loads((out / e2e.SUMMARY).read_text())["steps"]}
    ev = steps["evaluate"]
    assert ev["status"] == "error" and "eagle3-k1 (ValueError" in ev["error"]
    assert "raise ValueError" in ev["traceback"] or "EvaluationError" in ev["traceback"]
    assert ev["result"]["status"] == "partial"
    assert [f["name"] for f in ev["result"]["failed"]] == ["eagle3-k1"]
    assert {c["name"]: c["status"] for c in ev["result"]["configs"]} == {
        "baseline": "ok", "eagle3-k3": "ok", "ngram-k3": "ok", "eagle3-k1": "error"}
    assert [(c["k"], c["run"]) for c in ev["result"]["eagle3_vs_ngram"]] == [(3, "batch1"), (3, "batch4")]
    assert steps["_phase"]["status"] == "error"
    kept = json.loads((out / "llama-evaluate.json").read_text())
    assert kept["configs"][1]["runs"]["batch4"]["spec"]["acceptance_length"] == pytest.approx(1 + 22 / 30)


def test_the_baseline_outputs_and_what_prompt_lookup_finds_in_them_are_kept(files, tmp_path):
    out = tmp_path / "eval"
    res = E.evaluate(config(files, out), cell_fn=H.cell, log=lambda m: None)
    kept = json.loads((out / E.BASELINE_OUTPUTS).read_text())
    for run, prompts in kept["prompts"].items():
        outs = kept["outputs"][run]
        assert outs == [[(t + 1) % 97 for t in p[:8]] for p in prompts]  # what the baseline cell generated
        rep = res["baseline_repetition"][run]
        assert rep["tokens"] == sum(map(len, outs)) and (rep["min_n"], rep["max_n"]) == (2, 5)
    assert set(kept["outputs"]) == {"batch1", "batch4"}
    assert "What prompt lookup can exploit" in (out / E.RESULT_MD).read_text()


def test_sampled_evaluation_seeds_each_prompt_alike_and_skips_the_output_comparison(files, tmp_path):
    out = tmp_path / "eval"
    cfg = config(files, out)
    cfg.temperature, cfg.seed = 0.7, 100
    res = E.evaluate(cfg, cell_fn=H.cell, log=lambda m: None)
    for c in res["configs"]:
        assert all("match_baseline" not in r for r in c["runs"].values()), c["name"]
    assert "sampled at temperature 0.7, seed 100 + prompt index" in (out / E.RESULT_MD).read_text()
    greedy = E.evaluate(config(files, tmp_path / "greedy"), cell_fn=H.cell, log=lambda m: None)
    assert all("match_baseline" in r for c in greedy["configs"] if c["method"] for r in c["runs"].values())


class _Recording:
    """What ``_run`` asks of the engine module, recorded: prompts, temperature, seeds per call."""

    def __init__(self):
        self.calls = []

    def metrics(self, llm):
        return []

    def timed_generate(self, llm, prompts, *, max_tokens, **sample):
        self.calls.append((len(prompts), sample))
        return [[1] * max_tokens for _ in prompts], 0.01


def test_each_prompt_keeps_its_seed_at_batch_1_and_batched():
    serve = _Recording()
    E._run(serve, None, [[1], [2], [3]], 2, batched=False, temperature=0.5, seed=7)
    E._run(serve, None, [[1], [2], [3]], 2, batched=True, temperature=0.5, seed=7)
    E._run(serve, None, [[1], [2]], 2, batched=True)
    E._run(serve, None, [[1]], 2, batched=True, temperature=1.0, seed=3, top_p=0.95)
    t = {"temperature": 0.5, "top_p": 1.0}
    assert serve.calls == [(1, dict(t, seeds=[7])), (1, dict(t, seeds=[8])), (1, dict(t, seeds=[9])),
                           (3, dict(t, seeds=[7, 8, 9])), (2, {}),
                           (1, {"temperature": 1.0, "top_p": 0.95, "seeds": [3]})]


def test_a_sampled_evaluation_passes_its_nucleus_to_every_cell_and_names_it(files, tmp_path):
    out = tmp_path / "eval"
    cfg = config(files, out)
    cfg.temperature, cfg.top_p = 1.0, 0.95
    res = E.evaluate(cfg, cell_fn=H.cell, log=lambda m: None)
    cells = cells_run(out)
    assert len(cells) == len(res["configs"]) > 1
    assert all(c["sampling"] == {"temperature": 1.0, "seed": 0, "top_p": 0.95} for c in cells), cells
    assert "sampled at temperature 1, top_p 0.95, seed 0 + prompt index" in (out / E.RESULT_MD).read_text()



def test_a_nucleus_without_sampling_is_refused_in_one_line(files, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(E, "run_cell", H.cell)
    monkeypatch.setattr(cli, "vllm_can_run", lambda: (True, ""))
    assert cli.main([*_cli_args(files, tmp_path / "greedy"), "--top-p", "0.95"]) == 2
    err = capsys.readouterr().err
    assert "--top-p 0.95 only applies to sampled runs" in err and "Traceback" not in err
    assert not (tmp_path / "greedy-cells.jsonl").exists()  # refused before any engine
    assert cli.main([*_cli_args(files, tmp_path / "sampled"), "--top-p", "0.95", "--temperature", "1"]) == 0


def test_the_acceptance_ceiling_reads_the_targets_logprobs_at_the_output_positions(files, tmp_path):
    from vllm_compat.eagle3.repetition import repetition_stats

    out = tmp_path / "eval"
    cfg = config(files, out, outputs="loop")
    cfg.temperature, cfg.acceptance_ceiling = 1.0, True
    res = E.evaluate(cfg, cell_fn=H.cell, ceiling_fn=H.certain_target, log=lambda m: None)
    kept = json.loads((out / E.BASELINE_OUTPUTS).read_text())
    assert set(res["acceptance_ceiling"]) == {"batch1", "batch4"}
    for run, c in res["acceptance_ceiling"].items():
        prompts, outs = kept["prompts"][run], kept["outputs"][run]
        rep = repetition_stats(prompts, outs, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        assert c["tokens"] == rep["tokens"] and rep["lookup_hit_fraction"] > 0, rep
        assert c["top1_prob_mean"] == 1.0
        # the target is certain of each output token, so a proposal is accepted exactly where
        # the lookup is right: read at any other position, the rows would say otherwise
        assert c["lookup_accept_prob"][0] == pytest.approx(rep["lookup_hit_fraction"] / rep["lookup_match_fraction"])
    assert "What the target lets through" in (out / E.RESULT_MD).read_text()
    greedy = E.evaluate(config(files, tmp_path / "greedy"), cell_fn=H.cell, ceiling_fn=H.certain_target,
                        log=lambda m: None)
    assert "acceptance_ceiling" not in greedy  # greedy verification accepts exact matches only


def test_an_acceptance_ceiling_without_sampling_is_refused_in_one_line(files, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "vllm_can_run", lambda: (True, ""))
    assert cli.main([*_cli_args(files, tmp_path / "greedy"), "--acceptance-ceiling"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and "--acceptance-ceiling measures sampled runs" in err[0], err


def test_a_failing_acceptance_ceiling_is_recorded_and_the_baseline_stands(files, tmp_path):
    out = tmp_path / "eval"
    cfg = config(files, out, outputs="loop")
    cfg.temperature, cfg.acceptance_ceiling = 1.0, True
    res = E.evaluate(cfg, cell_fn=H.cell, ceiling_fn=H.failing_target, log=lambda m: None)
    assert "greater than max allowed" in res["acceptance_ceiling_error"]
    assert not res["failed"] and res["status"] == "ok"
    assert (out / E.BASELINE_OUTPUTS).exists()
    md = (out / E.RESULT_MD).read_text()
    assert "Acceptance ceiling not measured:" in md and "greater than max allowed" in md
