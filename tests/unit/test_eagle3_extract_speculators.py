"""``eagle3 extract --format speculators``: speculators 0.5-0.9's hs_{row}.safetensors files,
resumable, in the model's dtype or hs-connectors' FP8 form."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from vllm_compat.cli import main  # noqa: E402
from vllm_compat.extract import HiddenStatesExtractor  # noqa: E402
from vllm_compat.testing.models import build_model  # noqa: E402

LAYERS = [2, 4, 5, 8]  # launch_vllm.py's default for 8 layers


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_model("llama-tiny", tmp_path_factory.mktemp("t") / "m")


@pytest.fixture
def prepared(tmp_path):
    """What speculators' prepare-data saves: a datasets directory of input_ids/loss_mask."""
    rows = [[1 + (3 * i + j) % 500 for j in range(4 + 5 * i)] for i in range(5)]
    ds = datasets.Dataset.from_dict({"input_ids": rows,
                                     "loss_mask": [[0] * 2 + [1] * (len(r) - 2) for r in rows],
                                     "seq_len": [len(r) for r in rows]})
    ds.save_to_disk(str(tmp_path / "prep"))
    return tmp_path / "prep", rows


def run(*argv, capsys):
    assert main(["eagle3", "extract", *argv, "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_files_per_row_as_generate_offline_data_leaves_them(target, prepared, tmp_path, capsys):
    prep, rows = prepared
    out = tmp_path / "hidden_states"
    rep = run(str(prep), "--target", target, "--output", str(out), "--format", "speculators",
              "--backend", "transformers", capsys=capsys)
    assert rep["written"] == 5 and rep["layer_ids"] == LAYERS
    with HiddenStatesExtractor(target, layer_ids=LAYERS, backend="transformers") as ex:
        ref = [s.hidden_states for s in ex.extract(rows)]
    for i, ids in enumerate(rows):
        data = load_file(out / f"hs_{i}.safetensors")
        assert set(data) == {"token_ids", "hidden_states"}
        assert data["token_ids"].dtype == torch.int64 and data["token_ids"].tolist() == ids
        assert data["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(data["hidden_states"], ref[i])


def test_resume_skips_readable_files_and_rewrites_broken_ones(target, prepared, tmp_path, capsys):
    prep, rows = prepared
    out = tmp_path / "hs"
    run(str(prep), "--target", target, "--output", str(out), "--format", "speculators",
        "--backend", "transformers", "--max-samples", "3", capsys=capsys)
    assert sorted(p.name for p in out.glob("hs_*")) == [f"hs_{i}.safetensors" for i in range(3)]
    (out / "hs_1.safetensors").write_bytes(b"truncated")
    rep = run(str(prep), "--target", target, "--output", str(out), "--format", "speculators",
              "--backend", "transformers", capsys=capsys)
    assert (rep["written"], rep["skipped"]) == (3, 2)  # rows 1, 3, 4
    assert load_file(out / "hs_1.safetensors")["token_ids"].tolist() == rows[1]


def test_fp8_files_in_hs_connectors_form(target, prepared, tmp_path, capsys):
    prep, rows = prepared
    out = tmp_path / "fp8"
    run(str(prep), "--target", target, "--output", str(out), "--format", "speculators",
        "--backend", "transformers", "--dtype", "float8_e4m3fn", capsys=capsys)
    data = load_file(out / "hs_4.safetensors")
    assert data["hidden_states"].dtype == torch.float8_e4m3fn
    assert data["hidden_states_scales"].shape == (len(rows[4]), 1, 1)
