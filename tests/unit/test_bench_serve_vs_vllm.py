"""bench/serve_vs_vllm.py's pieces that run without a GPU: arguments and the file comparison."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from bench import serve_vs_vllm as sv  # noqa: E402
from vllm_compat.serve.hs_files import save_hidden_states  # noqa: E402


def test_defaults():
    a = sv.parse_args(["--speculators-python", "/x/python"])
    assert (a.model, a.concurrency, a.samples) == ("llama-1b", 32, 2000)


def test_compare_files(tmp_path):
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        hs = torch.randn(5, 4, 8, generator=g).to(torch.bfloat16)
        (tmp_path / "a").mkdir(exist_ok=True)
        save_hidden_states(tmp_path / "a" / f"hs_{i}.safetensors", list(range(5)), hs)
        other = hs.clone()
        if i == 2:
            other[0, 0, 0] += 1.0  # one value differs
        (tmp_path / "b").mkdir(exist_ok=True)
        save_hidden_states(tmp_path / "b" / f"hs_{i}.safetensors", list(range(5)), other)
    r = sv.compare_files(tmp_path / "a", tmp_path / "b", 10)
    assert r["files"] == 3
    assert r["bit_equal_share"] == pytest.approx(1 - 1 / (3 * 160))
    assert 0 < r["worst_rel_err"] < 0.2
    (tmp_path / "b" / "hs_1.safetensors").unlink()
    save_hidden_states(tmp_path / "b" / "hs_1.safetensors", [9, 9, 9, 9, 9],
                       torch.zeros(5, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(AssertionError):
        sv.compare_files(tmp_path / "a", tmp_path / "b", 10)  # token ids differ


def test_a_built_model_ships_a_tokenizer(tmp_path):
    """speculators' prepare-data loads the model's processing class even for token-id rows; a
    checkpoint without one failed it ("Unrecognized processing class")."""
    import argparse

    from transformers import AutoTokenizer

    path = sv._model(argparse.Namespace(model="llama-tiny"), tmp_path, device="cpu")
    assert AutoTokenizer.from_pretrained(path).encode("hello")


def test_keep_for_comparison_leaves_exactly_the_files_compare_files_reads(tmp_path):
    hs = torch.zeros(2, 1, 4, dtype=torch.bfloat16)
    for i in range(12):
        save_hidden_states(tmp_path / f"hs_{i}.safetensors", [1, 2], hs)
    read = sorted(p.name for p in tmp_path.glob("hs_*.safetensors"))[:5]
    assert sv.keep_for_comparison(tmp_path, 5) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == read
    assert sv.keep_for_comparison(tmp_path, 64) == 0
