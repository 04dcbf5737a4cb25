"""The shard digest (sha256 over per-piece sha256s, pieces hashed in parallel)."""

from __future__ import annotations

import hashlib
import random

import pytest

from vllm_compat.eagle3 import data


def reference(raw: bytes, piece: int) -> str:
    parts = [hashlib.sha256(raw[i:i + piece]).digest() for i in range(0, len(raw), piece)]
    return hashlib.sha256(b"".join(parts)).hexdigest()


@pytest.mark.parametrize("piece", [1, 7, 64, 1000])
def test_tree_digest_is_defined_by_the_bytes_not_the_chunking(tmp_path, piece):
    rng = random.Random(piece)
    raw = rng.randbytes(5000)
    cuts = sorted(rng.sample(range(1, len(raw)), 9))
    chunks = [raw[a:b] for a, b in zip([0] + cuts, cuts + [len(raw)])]
    want = reference(raw, piece)
    assert data.sha256_tree(chunks, piece) == want
    assert data.sha256_tree([memoryview(raw)], piece) == want
    (tmp_path / "f").write_bytes(raw)
    assert data._sha256_tree_file(tmp_path / "f", piece) == want
    flipped = bytearray(raw)
    flipped[rng.randrange(len(raw))] ^= 1
    assert data.sha256_tree([bytes(flipped)], piece) != want


def test_empty_input_and_piece_boundaries(tmp_path):
    assert data.sha256_tree([], 8) == hashlib.sha256(b"").hexdigest()
    raw = bytes(range(32))  # exactly 4 pieces of 8: no empty trailing piece
    assert data.sha256_tree([raw[:8], raw[8:24], raw[24:]], 8) == reference(raw, 8)
    (tmp_path / "e").write_bytes(b"")
    assert data._sha256_tree_file(tmp_path / "e", 8) == hashlib.sha256(b"").hexdigest()


def test_writer_records_the_tree_digest_and_recovery_honours_both(tmp_path):
    import torch
    w = data.ShardWriter(tmp_path / "ds", hidden_size=8, aux_layer_ids=[1], final_layer_id=2,
                         samples_per_shard=1)
    w.add({"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.bool),
           "hidden_states": torch.randn(5, 2, 8).to(torch.bfloat16)})
    m = w.close()
    (entry,) = m.shards
    path = tmp_path / "ds" / entry["file"]
    assert "sha256" not in entry and entry["sha256_piece"] == data.DIGEST_PIECE
    assert entry["sha256_tree"] == reference(path.read_bytes(), data.DIGEST_PIECE)
    assert data._digests_match(path, entry)
    assert data._digests_match(path, {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    assert not data._digests_match(path, dict(entry, sha256_tree="0" * 64))
    assert not data._digests_match(path, {"sha256": "0" * 64})
