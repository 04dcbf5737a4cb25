"""CPU tests of the offline data-generation flow's files: data_{i}.pt, sample_lengths.json,
data_config.json, token_freq.pt, and the command line.

The hidden states here come from ``samples_to_results`` over extractor-shaped samples
(the generator's real output path); the engine itself runs in tests/gpu.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from vllm_compat.speculators import offline
from vllm_compat.speculators.config_generator import DataGenerationConfig
from vllm_compat.speculators.vllm_hidden_states_generator import (
    prepare_prompts,
    resolve_layer_ids,
    samples_to_results,
)

H = 16
LENGTHS = [5, 16, 17, 33, 48, 1, 70, 9, 64, 31, 100, 2, 47]


@dataclass(frozen=True)
class Sample:  # the documented fields of vllm_compat.extract.ExtractedSample
    index: int
    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    layer_ids: tuple


def hidden(ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(ids) * 31 + len(ids))
    base = torch.randn(len(ids), 1, H, generator=g, dtype=torch.float32)
    return (base + torch.tensor(layer_ids, dtype=torch.float32)[None, :, None]).to(torch.bfloat16)


class ResultsFromSamples:
    """The generator's output half (prepare_prompts -> samples -> samples_to_results), with
    states that are a deterministic function of the tokens instead of a model on a GPU.
    Samples are handed over in reverse order, as an engine may finish them."""

    def __init__(self, layer_ids, num_layers=8, convention="speculators", max_model_len=4096):
        self.model_path = "tiny-model"
        self.tensor_parallel_size = 1
        self.layer_convention = convention
        self.layer_ids, self.capture_layer_ids = resolve_layer_ids(
            layer_ids, num_layers, convention)
        self.max_model_len = max_model_len
        self.config = argparse.Namespace(hidden_size=H, num_hidden_layers=num_layers)
        self.vllm_config = argparse.Namespace(
            model_config=argparse.Namespace(max_model_len=max_model_len),
            cache_config=argparse.Namespace(gpu_memory_utilization=0.5))
        self.calls = []

    def generate(self, token_ids):
        prompts = prepare_prompts(token_ids, self.max_model_len)
        self.calls.append(len(prompts))
        ids = list(dict.fromkeys(self.capture_layer_ids))
        samples = [Sample(i, torch.tensor(p), hidden(p, ids), tuple(ids))
                   for i, p in reversed(list(enumerate(prompts)))]
        return samples_to_results(samples, prompts, self.capture_layer_ids)


def args_for(tmp_path, **kw):
    argv = ["--target-model-path", "tiny-model", "--train-data-path", str(tmp_path / "in.jsonl"),
            "--output-dir", str(tmp_path / "out"), "--token-freq-path", str(tmp_path / "tf.pt"),
            "--tensor-parallel-size", "1"]
    for k, v in kw.items():
        vals = [str(x) for x in v] if isinstance(v, list) else [str(v)]
        argv += [f"--{k.replace('_', '-')}", *vals]
    return offline.parse_args(argv)


def write_jsonl(tmp_path, lengths=LENGTHS):
    rows = []
    for i, n in enumerate(lengths):
        ids = [200 + (11 * i + 3 * j) % 700 for j in range(n)]
        mask = [int((j + i) % 3 != 0) for j in range(n)]
        rows.append({"input_ids": ids, "loss_mask": mask})
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_round_trip_13_samples_batch_16(tmp_path):
    rows = write_jsonl(tmp_path)
    args = args_for(tmp_path, batch_size=16, layer_ids=[2, 4, 5, 8])
    ds = offline.load_dataset_for(args)
    gen = ResultsFromSamples([2, 4, 5, 8], convention="vllm")
    assert offline.generate_and_save_hidden_states(args, ds, gen) == len(rows)
    assert gen.calls == [13]  # one batch of >= 11: the size that broke 0.4.x
    out = tmp_path / "out"
    loaded = dict(offline.iter_data_dir(out))
    assert sorted(loaded) == list(range(len(rows)))
    for i, row in enumerate(rows):
        s = loaded[i]
        assert set(s) == {"input_ids", "hidden_states", "loss_mask"}
        assert s["input_ids"].dtype == torch.long and s["input_ids"].tolist() == row["input_ids"]
        assert s["loss_mask"].dtype == torch.long and s["loss_mask"].tolist() == row["loss_mask"]
        assert isinstance(s["hidden_states"], list) and len(s["hidden_states"]) == 4
        want = hidden(row["input_ids"], [2, 4, 5, 8])
        for k, h in enumerate(s["hidden_states"]):
            assert h.dtype == torch.bfloat16 and torch.equal(h, want[:, k])
    lengths = json.loads((out / "sample_lengths.json").read_text())
    assert lengths == {str(i): len(r["input_ids"]) for i, r in enumerate(rows)}
    cfg = json.loads((out / "data_config.json").read_text())
    assert cfg["hidden_states"]["layer_ids"] == [2, 4, 5, 8]
    assert cfg["hidden_states"]["layer_convention"] == "vllm"
    assert cfg["data"]["num_samples"] == len(rows)
    assert cfg["format"]["schema"]["hidden_states"]["dtype"] == "list[torch.bfloat16]"
    assert cfg["format"]["schema"]["hidden_states"]["shape"] == f"list of [seq_len, {H}]"
    tf = torch.load(tmp_path / "tf.pt", weights_only=True)
    expect: dict[int, int] = {}
    for r in rows:
        for t, m in zip(r["input_ids"], r["loss_mask"]):
            if m:
                expect[t] = expect.get(t, 0) + 1
    assert tf == expect


def test_resume_writes_only_the_missing_files_and_merges_lengths(tmp_path):
    rows = write_jsonl(tmp_path)
    args = args_for(tmp_path, batch_size=4, max_samples=6)
    ds = offline.load_dataset_for(args)
    gen = ResultsFromSamples(None)
    assert offline.generate_and_save_hidden_states(args, ds, gen) == 6
    args = args_for(tmp_path, batch_size=4)
    ds = offline.load_dataset_for(args)
    gen2 = ResultsFromSamples(None)
    assert offline.generate_and_save_hidden_states(args, ds, gen2) == len(rows) - 6
    assert gen2.calls == [4, 3]
    out = tmp_path / "out"
    assert offline.find_last_checkpoint(out) == len(rows)
    assert json.loads((out / "sample_lengths.json").read_text()) == {
        str(i): len(r["input_ids"]) for i, r in enumerate(rows)}
    assert offline.generate_and_save_hidden_states(args, ds, gen2) == 0


def test_start_idx_offsets_file_names(tmp_path):
    write_jsonl(tmp_path, [3, 4, 5])
    args = args_for(tmp_path, start_idx=100)
    n = offline.generate_and_save_hidden_states(args, offline.load_dataset_for(args),
                                                ResultsFromSamples(None))
    assert n == 3 and offline.find_last_checkpoint(tmp_path / "out") == 103


def test_truncated_prompt_cuts_the_loss_mask(tmp_path):
    rows = write_jsonl(tmp_path, [40, 10])
    args = args_for(tmp_path)
    offline.generate_and_save_hidden_states(args, offline.load_dataset_for(args),
                                            ResultsFromSamples(None, max_model_len=21))
    s0 = offline.load_sample(tmp_path / "out" / "data_0.pt")
    assert s0["input_ids"].tolist() == rows[0]["input_ids"][:20]
    assert s0["loss_mask"].tolist() == rows[0]["loss_mask"][:20]
    assert s0["hidden_states"][0].shape == (20, H)


def test_speculators_numbering_run_records_both_numberings(tmp_path):
    write_jsonl(tmp_path, [3])
    args = args_for(tmp_path)
    gen = ResultsFromSamples([2, 4, 5, 7])
    offline.generate_and_save_hidden_states(args, offline.load_dataset_for(args), gen)
    cfg = json.loads((tmp_path / "out" / "data_config.json").read_text())
    hs = cfg["hidden_states"]
    assert hs["layer_ids"] == [2, 4, 5, 7] and hs["vllm_layer_ids"] == [3, 5, 6, 8]
    assert hs["layer_convention"] == "speculators"
    s = offline.load_sample(tmp_path / "out" / "data_0.pt")
    assert torch.equal(s["hidden_states"][0], hidden(s["input_ids"].tolist(), [3])[:, 0])


def test_repeated_ids_write_one_tensor_per_distinct_layer(tmp_path):
    """L=6: speculators' default [2, 3, 3, 5] captured 3 states; the schema says 3 too."""
    write_jsonl(tmp_path, [4])
    args = args_for(tmp_path)
    gen = ResultsFromSamples(None, num_layers=6)
    offline.generate_and_save_hidden_states(args, offline.load_dataset_for(args), gen)
    cfg = json.loads((tmp_path / "out" / "data_config.json").read_text())
    assert cfg["hidden_states"]["layer_ids"] == [2, 3, 3, 5]
    assert cfg["hidden_states"]["vllm_layer_ids"] == [3, 4, 6]
    assert cfg["format"]["schema"]["hidden_states"]["num_tensors"] == 3
    assert len(offline.load_sample(tmp_path / "out" / "data_0.pt")["hidden_states"]) == 3


def test_data_config_has_speculators_layout():
    cfg = DataGenerationConfig.from_settings(
        target_model_path="m", tensor_parallel_size=2, gpu_memory_utilization=0.8,
        max_model_len=2048, hidden_size=4096, layer_ids=[2, 16, 29, 31],
        vllm_layer_ids=[3, 17, 30, 32], layer_convention="speculators", train_data_path="sharegpt",
        seq_length=2048, cache_dir="/c", num_samples=5, max_samples=None, seed=0,
        command="x").to_dict()
    cfg = json.loads(json.dumps(cfg))
    # speculators 0.4.0.1 DataGenerationConfig.to_dict() keys
    assert set(cfg) == {"version", "generated_at", "speculators_version", "reproducibility",
                        "model", "data", "hidden_states", "generation", "format"}
    assert cfg["version"] == "2.0"
    assert {"command", "package_versions", "gpu"} <= set(cfg["reproducibility"])
    assert {"torch", "vllm", "transformers", "speculators"} <= set(
        cfg["reproducibility"]["package_versions"])
    assert {"target_model_path", "tensor_parallel_size", "gpu_memory_utilization",
            "hidden_size"} <= set(cfg["model"])
    assert set(cfg["data"]) == {"train_data_path", "seq_length", "max_samples", "num_samples",
                                "seed", "chat_template_note"}
    assert cfg["generation"] == {"cache_dir": "/c"}
    f = cfg["format"]
    assert f["file_pattern"] == "data_{idx}.pt" and f["data_format_version"] == 1
    assert set(f["schema"]) == {"input_ids", "hidden_states", "loss_mask"}
    assert f["schema"]["hidden_states"]["num_tensors"] == 4
    assert f["schema"]["hidden_states"]["shape"] == "list of [seq_len, 4096]"


def test_only_tensors_are_written_and_reading_is_weights_only(tmp_path):
    with pytest.raises(TypeError):
        offline.save_sample_to_disk({"input_ids": [1, 2, 3]}, tmp_path / "data_0.pt")
    with pytest.raises(TypeError):
        offline.save_sample_to_disk({"hidden_states": []}, tmp_path / "data_0.pt")
    assert not list(tmp_path.iterdir())
    # a pickle that is not plain tensors is refused by the reader
    torch.save({"input_ids": torch.zeros(2), "extra": argparse.Namespace(a=1)},
               tmp_path / "data_1.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        offline.load_sample(tmp_path / "data_1.pt")


def test_tokenized_inputs(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        '{"input_ids": [1, 2, 3]}\n\n{"input_ids": [4], "loss_mask": [0]}\n')
    ds = offline.load_tokenized_dataset(str(tmp_path / "a.jsonl"))
    assert ds[0:2] == {"input_ids": [[1, 2, 3], [4]], "loss_mask": [[1, 1, 1], [0]]}
    (tmp_path / "b.json").write_text('[{"input_ids": [5, 6], "loss_mask": [1, 0]}]')
    assert len(offline.load_tokenized_dataset(str(tmp_path / "b.json"))) == 1
    (tmp_path / "c.jsonl").write_text('{"conversations": []}\n')
    with pytest.raises(FileNotFoundError):
        offline.load_tokenized_dataset(str(tmp_path / "c.jsonl"))
    (tmp_path / "d.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(ValueError, match="loss_mask"):
        offline.load_tokenized_dataset(str(tmp_path / "d.jsonl"))


# speculators 0.4.0's scripts/data_generation_offline.py (text mode) flags and defaults
SPECULATORS_0_4_FLAGS = {
    "target_model_path": None, "gpu_memory_utilization": 0.8, "train_data_path": None,
    "seq_length": 2048, "max_samples": None, "token_freq_path": "./token_freq.pt",
    "hf_cache_dir": None, "assistant_pattern": None, "turn_dropout": False, "output_dir": None,
    "layer_ids": None, "batch_size": 8, "seed": 0, "start_idx": 0,
    "num_preprocessing_workers": 8,
}


def test_command_line_takes_the_speculators_flags():
    args = offline.parse_args(["--target-model-path", "m", "--train-data-path", "d",
                               "--output-dir", "o"])
    for name, default in SPECULATORS_0_4_FLAGS.items():
        if default is not None:
            assert getattr(args, name) == default, name
    assert args.tensor_parallel_size >= 1
    args = offline.parse_args(["--target-model-path", "m", "--train-data-path", "d",
                               "--output-dir", "o", "--layer-ids", "2", "16", "29", "31",
                               "--legacy-layer-indices", "--batch-size", "16", "--turn-dropout"])
    assert args.layer_ids == [2, 16, 29, 31] and args.legacy_layer_indices is True
    assert args.batch_size == 16 and args.turn_dropout
    args = offline.parse_args(["--target-model-path", "m", "--train-data-path", "d",
                               "--output-dir", "o", "--layer-convention", "vllm"])
    assert args.layer_convention == "vllm" and args.legacy_layer_indices is None
