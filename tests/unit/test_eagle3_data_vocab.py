"""Dataset shards (writer/reader) and the draft vocabulary mapping."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_compat.eagle3.data import (
    MANIFEST,
    DatasetFormatError,
    HiddenStatesDataset,
    ShardWriter,
    read_manifest,
)
from vllm_compat.testing.synthetic import write_dataset, write_target
from vllm_compat.eagle3.vocab import VocabMapping, build_mapping, build_vocab, count_tokens


def _sample(t, n_layers=4, h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 50, (t,), generator=g), "loss_mask": torch.rand(t, generator=g) > 0.5,
            "hidden_states": torch.randn(t, n_layers, h, generator=g), "extra": torch.arange(t)}


def test_round_trip_and_manifest(tmp_path):
    samples = [_sample(5 + i, seed=i) for i in range(5)]
    with ShardWriter(tmp_path, hidden_size=8, aux_layer_ids=[1, 2, 3], final_layer_id=6,
                     dtype=torch.float32, samples_per_shard=2) as w:
        for s in samples:
            w.add(s)
    m = read_manifest(tmp_path)
    assert [s["num_samples"] for s in m.shards] == [2, 2, 1]
    assert m.num_tokens == sum(5 + i for i in range(5)) and m.layer_ids == [1, 2, 3, 6]
    ds = HiddenStatesDataset(tmp_path)
    for want, got in zip(samples, ds, strict=True):
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k].to(got[k].dtype)), k
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.name != MANIFEST) == [".safetensors"] * 3


def test_reopening_appends_and_refuses_other_layers(tmp_path):
    kw = dict(hidden_size=8, aux_layer_ids=[1, 2, 3], final_layer_id=6, samples_per_shard=2)
    with ShardWriter(tmp_path, **kw) as w:
        w.add(_sample(4))
    with ShardWriter(tmp_path, **kw) as w:
        assert w.num_samples == 1
        w.add(_sample(6))
    assert len(HiddenStatesDataset(tmp_path)) == 2
    with pytest.raises(DatasetFormatError, match="cannot append"):
        ShardWriter(tmp_path, **{**kw, "aux_layer_ids": [1, 2, 4]})


@pytest.mark.parametrize("bad, message", [
    ({"hidden_states": torch.zeros(5, 3, 8)}, r"hidden_states shape \(5, 3, 8\) != \(T, n_aux \+ 1, H\) = \(5, 4, 8\)"),
    ({"loss_mask": torch.ones(4, dtype=torch.bool)}, r"loss_mask shape \(4,\) != input_ids shape \(5,\)"),
    ({"input_ids": torch.zeros(0, dtype=torch.int64)}, "non-empty 1-D"),
])
def test_writer_rejects_bad_samples(tmp_path, bad, message):
    w = ShardWriter(tmp_path, hidden_size=8, aux_layer_ids=[1, 2, 3], final_layer_id=6)
    with pytest.raises(DatasetFormatError, match=message):
        w.add({**_sample(5), **bad})


def test_reader_refuses_foreign_manifest(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DatasetFormatError, match="not a vllm-compat-eagle3-hidden-states v1/v2 manifest"):
        HiddenStatesDataset(tmp_path)


def test_counts_only_loss_masked_tokens():
    ids = torch.tensor([1, 2, 2, 3, 3, 3])
    mask = torch.tensor([True, False, True, False, False, True])
    assert count_tokens([(ids, mask)], 5).tolist() == [0, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="token id 7 >= target vocab size 5"):
        count_tokens([(torch.tensor([7]), torch.tensor([True]))], 5)


def test_mapping_top_k_ties_and_padding():
    counts = torch.tensor([0, 5, 0, 9, 5, 0, 1, 0])
    m = build_mapping(counts, draft_vocab_size=3)  # 3 (9), then 1 and 4 tie at 5: lower id first -> 1
    assert m.draft_to_target_ids.tolist() == [1, 3, 4]
    assert m.d2t.tolist() == [1, 2, 2] and m.d2t.dtype == torch.int64
    assert m.t2d.tolist() == [False, True, False, True, True, False, False, False]
    padded = build_mapping(counts, draft_vocab_size=6)  # 4 seen ids + the lowest unseen ones (0, 2)
    assert padded.draft_to_target_ids.tolist() == [0, 1, 2, 3, 4, 6]
    capped = build_mapping(counts, draft_vocab_size=32000)
    assert capped.draft_vocab_size == 8 and capped.d2t.tolist() == [0] * 8


def test_round_trip_target_draft_target(tmp_path):
    write_target(tmp_path / "target")
    write_dataset(tmp_path / "ds", tmp_path / "target", num_samples=6)
    m = build_vocab(tmp_path / "ds", 96, draft_vocab_size=20, output_dir=tmp_path / "vocab")
    back = VocabMapping.load(tmp_path / "vocab")
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back.t2d, m.t2d)
    target_ids = m.draft_to_target_ids
    assert int(m.t2d.sum()) == 20 and m.t2d[target_ids].all()
    assert torch.equal(m.target_to_draft_ids()[target_ids], torch.arange(20))
    assert (m.target_to_draft_ids()[~m.t2d] == -1).all()
    assert bool((m.d2t[1:] >= m.d2t[:-1]).all()) and int(m.d2t.min()) >= 0
    # the kept ids are the most frequent masked tokens
    assert int(m.counts[m.t2d].min()) >= int(m.counts[~m.t2d].max())
    assert 0.5 < m.coverage <= 1.0
