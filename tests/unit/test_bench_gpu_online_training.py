"""bench.gpu_online_training on the CPU (transformers backend, a tiny Llama): it runs offline
and co-located online training on the same records and steps and writes a results file that
says what was measured with what."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from bench import gpu_online_training as bench


def test_arguments_are_checked(capsys):
    assert bench.parse_args(["--model", "llama-tiny", "--out", "x"]).placements == "colocated,split"
    assert bench.parse_args(["--model", "llama-tiny", "--out", "x", "--placements",
                             "colocated,colocated-stream"]).placements == "colocated,colocated-stream"
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "llama-tiny", "--out", "x", "--placements", "colocated,remote"])
    assert "unknown placement" in capsys.readouterr().err


def test_cpu_run_writes_rates_memory_and_provenance(tmp_path, one_torch_thread):
    args = ["--model", "llama-tiny", "--backend", "transformers", "--device", "cpu", "--out", str(tmp_path),
            "--num-records", "16", "--record-len", "32", "--batch-size", "2", "--steps", "6",
            "--draft-vocab-size", "64", "--placements", "colocated", "--threads", "1"]
    assert bench.main(args) == 0
    r = json.loads((tmp_path / "gpu_online_training-llama-tiny.json").read_text())
    assert r["schema"] == bench.SCHEMA and r["commit"] and "torch" in r["versions"]
    assert r["command"][-len(args):] == args
    off, on = r["runs"]["offline"], r["runs"]["colocated"]
    assert off["tokens"] == on["tokens"] == 6 * 2 * 32  # the same steps, the same records
    assert off["tokens_per_s"] > 0 and on["tokens_per_s"] > 0 and off["torch_threads"] == 1
    assert r["summary"]["colocated_vs_offline"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"], rel=1e-2)
    assert on["peak_gib"] == {}  # no CUDA device: nothing sampled
    # where the online run's time went: the extractor extracted every token it trained on
    assert on["extracted_tokens"] >= on["tokens"] and on["extract_busy_s"] > 0
    assert on["trainer_wait_s"] >= 0 and on["extractor_wait_s"] >= 0 and on["prepare_s"] > 0
