"""``vllm-compat eagle3 <step>`` end to end through the CLI entry point."""

from __future__ import annotations

import argparse
import json

import pytest

from vllm_compat.eagle3.cli import add_parser, main
from vllm_compat.testing.synthetic import write_dataset, write_target


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_add_parser_registers_every_step():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    for step in ("prepare", "vocab", "train", "export", "validate"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["eagle3", step, "--help"])
        assert e.value.code == 0


def test_prepare_reports_counts(tmp_path, capsys):
    pytest.importorskip("transformers")
    from test_eagle3_prepare import CHATML, _tokenizer  # the locally trained tokenizer

    tok = _tokenizer(tmp_path / "tok", CHATML)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "Hello ", "completion": "there"}) + "\n{oops\n")
    assert main(["eagle3", "prepare", str(src), "--tokenizer", tok, "-o", str(tmp_path / "p"), "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kept"] == 1 and report["skipped"] == {"malformed_json": 1}


def test_vocab_train_resume_export_validate(tmp_path, capsys):
    target = write_target(tmp_path / "target")
    ds = write_dataset(tmp_path / "ds", target, num_samples=4)
    run = lambda *a: main(["eagle3", *map(str, a)])
    assert run("vocab", ds, "--target", target, "--draft-vocab-size", 40, "-o", tmp_path / "vocab", "--no-progress") == 0
    assert json.loads(capsys.readouterr().out)["draft_vocab_size"] == 40
    train = ["train", ds, "--target", target, "--vocab", tmp_path / "vocab", "-o", tmp_path / "run",
             "--epochs", 2, "--batch-size", 2, "--dtype", "fp32", "--checkpoint-every", 1, "--no-progress"]
    assert run(*train, "--max-steps", 1) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1
    assert run(*train) == 0  # resumes at step 1
    assert json.loads(capsys.readouterr().out)["step"] == 4
    assert run("export", tmp_path / "run", "--target", target, "-o", tmp_path / "ckpt") == 0
    capsys.readouterr()
    assert run("validate", tmp_path / "ckpt", "--target", target, "--no-vllm") == 0
    assert capsys.readouterr().out.startswith("OK: ")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 8]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    assert run("validate", tmp_path / "ckpt", "--target", target, "--no-vllm") == 1
    err = capsys.readouterr().err
    assert "error [aux_final] eagle_aux_hidden_state_layer_ids [2, 4, 8] contains the final layer 8" in err
