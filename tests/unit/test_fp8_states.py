"""FP8 hidden states: the encoder's error bound and bytes, FP8 datasets written and read back,
earlier per-sample-scale datasets still read, and training on FP8-stored states."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_compat.eagle3 import data
from vllm_compat.eagle3.data import (
    BackgroundShardWriter,
    DatasetFormatError,
    HiddenStatesDataset,
    InvalidShardError,
    ShardWriter,
)
from vllm_compat.extract import fp8

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP8 = torch.float8_e4m3fn


def _states(seed=0, T=37, H=96):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 4, H, generator=g)
    x[:, 1] *= 300.0                    # very different layer scales
    x[:, 2] *= 1e-3
    x[T // 2, 3, 5] = 2000.0            # an outlier token
    x[:, 0, :10] = 1e-7                 # far below the fp8 normal range of its row
    x[min(3, T - 1)] *= 50.0            # one loud token among quiet ones
    return x.to(torch.bfloat16)


def _bound(x, scale):
    """e4m3: half-ulp 2^-4 relative (normals), 2^-10 * scale absolute (subnormals)."""
    s = scale[..., None] if scale.dim() == x.dim() - 1 else scale[None, :, None]
    return 2.0 ** -4 * x.abs() + 2.0 ** -10 * s + 1e-6 * s


# ----------------------------------------------------------------------------- the encoder


def test_round_trip_is_within_the_fp8_error_bound():
    x = _states()
    q, scale = fp8.encode(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (37, 4)
    y = fp8.decode(q, scale, torch.float32)
    xf = x.float()
    assert bool(((y - xf).abs() <= _bound(xf, scale)).all())
    assert float(y.abs().max()) == pytest.approx(float(xf.abs().max()), rel=2 ** -4)
    assert float(y[18, 3, 5]) == pytest.approx(2000.0, rel=2 ** -4)  # the outlier
    assert fp8.decode(q, scale).dtype == torch.bfloat16


def test_encode_equals_the_float32_formula_bit_for_bit():
    """The one-pass encode gives the bytes of the explicit float32 form (outliers, values far
    below a row's normal range and an all-zero row included)."""
    x = _states()
    x[:, 2] = 0
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / fp8.FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    want = (xf / scale[..., None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(FP8)
    q, got = fp8.encode(x)
    assert torch.equal(got, scale)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    # float32 input of the same values: the same bytes
    q32, s32 = fp8.encode(xf)
    assert torch.equal(q32.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s32, scale)


def test_large_inputs_are_encoded_in_row_blocks_to_the_same_bytes(monkeypatch):
    """Bounded temporaries (the GPU encodes beside a full KV cache): the same bytes."""
    x = _states(T=37)
    q, scale = fp8.encode(x)
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", 5 * 4 * 96)  # blocks of 5 tokens
    q2, scale2 = fp8.encode(x)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)


def test_per_token_scales_beat_one_scale_per_sample_and_layer():
    """Quiet tokens next to a loud one (as the massive activations of a first token) keep
    their precision; with one scale per sample and layer (earlier datasets) they fall among
    FP8's subnormals once the loud token is ~10^4 times louder (mean relative error of the
    quiet rows: 0.025 per token; per sample 0.026 at 10^3, 0.039 at 10^4, 0.36 at 10^5)."""
    def errors(loud):
        x = torch.randn(37, 4, 96, generator=torch.Generator().manual_seed(1))
        x[0] *= loud
        q, scale = fp8.encode(x)
        per_token = (fp8.decode(q, scale, torch.float32) - x).norm(dim=-1) / x.norm(dim=-1)
        s_old = x.abs().amax(dim=(0, 2)) / fp8.FP8_MAX
        q_old = (x / s_old[None, :, None]).clamp(-448, 448).to(FP8)
        per_sample = (fp8.decode(q_old, s_old, torch.float32) - x).norm(dim=-1) / x.norm(dim=-1)
        return float(per_token[1:].mean()), float(per_sample[1:].mean())

    tok3, old3 = errors(1e3)
    tok5, old5 = errors(1e5)
    assert tok3 == tok5 < 0.03  # a row's error does not depend on the other rows
    assert old3 < 0.03 and old5 > 10 * tok5


def test_zero_rows_stay_zero_and_non_finite_rows_decode_to_nan():
    x = _states()
    x[:, 2] = 0
    x[5, 1, 7] = float("nan")
    x[6, 3, 0] = float("inf")
    q, scale = fp8.encode(x)
    y = fp8.decode(q, scale, torch.float32)
    assert float(y[:, 2].abs().max()) == 0.0 and bool(torch.isfinite(y[:, 2]).all())
    assert bool(torch.isnan(y[5, 1]).any()) and not bool(torch.isfinite(y[6, 3]).all())
    ok = torch.ones(37, 4, dtype=torch.bool)
    ok[5, 1] = ok[6, 3] = False
    assert bool(torch.isfinite(y[ok]).all())


def test_per_sample_scales_of_earlier_datasets_decode_by_broadcast():
    x = _states().float()
    s_old = x.abs().amax(dim=(0, 2)) / fp8.FP8_MAX
    q_old = (x / s_old[None, :, None]).to(FP8)
    assert torch.equal(fp8.decode(q_old, s_old, torch.float32),
                       q_old.float() * s_old[None, :, None])
    with pytest.raises(ValueError, match="does not fit"):
        fp8.decode(q_old, torch.ones(5))
    assert fp8.is_fp8(FP8) and fp8.is_fp8("float8_e4m3fn") and not fp8.is_fp8(torch.bfloat16)


# ----------------------------------------------------------------------------- datasets


def _samples(n=5, H=96):
    return [{"input_ids": torch.arange(3, 3 + t), "loss_mask": torch.ones(t, dtype=torch.bool),
             "hidden_states": _states(i, T=t, H=H)} for i, t in enumerate([5, 9, 1, 12, 7][:n])]


def _writer(d, dtype=FP8, per=2):
    return ShardWriter(d, hidden_size=96, aux_layer_ids=[2, 8, 13], final_layer_id=16,
                       dtype=dtype, samples_per_shard=per)


def test_fp8_dataset_round_trip_encoded_here_or_before(tmp_path):
    """bf16 samples (encoded by the writer) and samples encoded beforehand, as the extractor
    hands them out, give the same files; the reader decodes within the FP8 bound."""
    samples = _samples()
    with _writer(tmp_path / "here") as w:
        for s in samples:
            w.add(s)
    with _writer(tmp_path / "before") as w:
        for s in samples:
            q, sc = fp8.encode(s["hidden_states"])
            w.add({**s, "hidden_states": q, "hidden_states_scale": sc})
    for name in ("manifest.json", "shard-00000.safetensors", "shard-00002.safetensors"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "before" / name).read_bytes()
    man = json.loads((tmp_path / "here" / "manifest.json").read_text())
    assert man["format_version"] == 2 and man["dtype"] == "float8_e4m3fn"
    assert man["hidden_states_scale"]["per"] == "token and layer"
    ds = HiddenStatesDataset(tmp_path / "here", verify="full")
    assert len(ds) == 5 and ds.manifest.is_fp8
    for s, got in zip(samples, ds):
        assert set(got) == {"input_ids", "loss_mask", "hidden_states"}
        assert got["hidden_states"].dtype == torch.bfloat16
        x = s["hidden_states"].float()
        _, scale = fp8.encode(s["hidden_states"])
        # + bf16 rounding of the decoded value (2^-9 relative)
        assert bool(((got["hidden_states"].float() - x).abs()
                     <= _bound(x, scale) + 2.0 ** -8 * x.abs()).all())
    raw = HiddenStatesDataset(tmp_path / "here", decode_dtype=None)[3]
    assert raw["hidden_states"].dtype == FP8 and raw["hidden_states_scale"].shape == (12, 4)
    f32 = HiddenStatesDataset(tmp_path / "here", decode_dtype=torch.float32)[3]["hidden_states"]
    assert torch.equal(f32, fp8.decode(raw["hidden_states"], raw["hidden_states_scale"], torch.float32))


def test_a_bf16_dataset_keeps_format_version_1(tmp_path):
    with _writer(tmp_path / "bf16", dtype=torch.bfloat16) as w:
        w.add(_samples(1)[0])
    man = json.loads((tmp_path / "bf16" / "manifest.json").read_text())
    assert man["format_version"] == 1 and "hidden_states_scale" not in man


def test_wrong_fp8_inputs_are_refused(tmp_path):
    s = _samples(1)[0]
    q, sc = fp8.encode(s["hidden_states"])
    with _writer(tmp_path / "a") as w:
        with pytest.raises(DatasetFormatError, match="without hidden_states_scale"):
            w.add({**s, "hidden_states": q})
        with pytest.raises(DatasetFormatError, match="hidden_states_scale shape"):
            w.add({**s, "hidden_states": q, "hidden_states_scale": sc[:, :2]})
    with _writer(tmp_path / "b", dtype=torch.bfloat16) as w:
        with pytest.raises(DatasetFormatError, match="float8_e4m3fn"):
            w.add({**s, "hidden_states": q, "hidden_states_scale": sc})
    with pytest.raises(DatasetFormatError, match="dtype=bfloat16"):  # no FP8 appended to bf16
        _writer(tmp_path / "b", dtype=FP8)


def test_reader_refuses_an_fp8_shard_without_scales_and_a_non_finite_scale(tmp_path):
    from safetensors.torch import load_file, save_file
    with _writer(tmp_path / "ds", per=8) as w:
        for s in _samples(3):
            w.add(s)
    path = tmp_path / "ds" / "shard-00000.safetensors"
    orig = load_file(str(path))
    bad = dict(orig)
    bad["1.hidden_states_scale"] = bad["1.hidden_states_scale"].clone()
    bad["1.hidden_states_scale"][2, 1] = float("nan")
    save_file(bad, str(path))
    man = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    man["shards"][0]["bytes"] = path.stat().st_size
    man["shards"][0]["sha256_tree"] = data._sha256_tree_file(path, data.DIGEST_PIECE)
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(man))
    ds = HiddenStatesDataset(tmp_path / "ds")  # header checks pass; reading sample 1 does not
    with pytest.raises(InvalidShardError, match="sample 1: hidden_states has 96 non-finite"):
        ds[1]
    with pytest.raises(InvalidShardError, match="sample 1"):
        HiddenStatesDataset(tmp_path / "ds", verify="full")
    del bad["1.hidden_states_scale"]
    bad["1.hidden_states_scale_"] = orig["1.hidden_states_scale"]  # renamed away
    save_file(bad, str(path))
    man["shards"][0]["bytes"] = path.stat().st_size
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(InvalidShardError, match="sample 1: no hidden_states_scale"):
        HiddenStatesDataset(tmp_path / "ds")


def test_earlier_fp8_datasets_with_one_scale_per_sample_and_layer_are_read(tmp_path):
    """format_version 1, dtype float8_e4m3fn, hidden_states_scale [n]: decoded by broadcast."""
    samples = _samples(3)
    with _writer(tmp_path / "old") as w:
        for s in samples:
            x = s["hidden_states"].float()
            scale = x.abs().amax(dim=(0, 2)) / fp8.FP8_MAX
            w.add({**s, "hidden_states": (x / scale[None, :, None]).to(FP8),
                   "hidden_states_scale": scale})
    man = json.loads((tmp_path / "old" / "manifest.json").read_text())
    man["format_version"] = 1
    del man["hidden_states_scale"]
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(man))
    ds = HiddenStatesDataset(tmp_path / "old", verify="full")
    for s, got in zip(samples, ds):
        x = s["hidden_states"].float()
        scale = x.abs().amax(dim=(0, 2)) / fp8.FP8_MAX
        assert bool(((got["hidden_states"].float() - x).abs()
                     <= _bound(x, scale) + 2.0 ** -8 * x.abs()).all())


def test_background_writer_encodes_on_its_own_thread_to_the_same_bytes(tmp_path):
    samples = _samples()
    with _writer(tmp_path / "inline") as w:
        for s in samples:
            w.add(s)
    bg = BackgroundShardWriter(_writer(tmp_path / "bg"), max_queue=1)
    assert [t.name for t in bg._threads] == ["shard-writer", "shard-fp8-encode"]
    for s in samples:
        bg.add(s)
    m = bg.close()
    assert m.num_samples == 5 and bg.busy["encode_s"] > 0 and bg.busy["write_s"] > 0
    for sh in m.shards:
        assert (tmp_path / "bg" / sh["file"]).read_bytes() == \
            (tmp_path / "inline" / sh["file"]).read_bytes()
    # an encoding failure comes back to the caller and releases the folder
    bg = BackgroundShardWriter(_writer(tmp_path / "fail"), max_queue=1)
    q, _ = fp8.encode(samples[0]["hidden_states"])
    bg._in.put({**samples[0], "hidden_states": q})  # past add()'s checks: fails in the thread
    bg.add(samples[1])
    with pytest.raises(DatasetFormatError, match="without hidden_states_scale"):
        bg.close()
    _writer(tmp_path / "fail").close()  # the lock was released


def test_a_draft_trains_on_fp8_stored_states_as_on_float32_ones(tmp_path):
    """Same data and seed: the FP8 run's losses follow the float32 run's closely."""
    from vllm_compat.eagle3.training import TrainConfig, train
    from vllm_compat.eagle3.vocab import build_vocab
    from vllm_compat.testing.synthetic import write_dataset, write_target

    target = write_target(tmp_path / "t")
    runs = {}
    for name, dtype in (("f32", torch.float32), ("fp8", FP8)):
        write_dataset(tmp_path / f"ds-{name}", target, num_samples=12, dtype=dtype)
        build_vocab(tmp_path / f"ds-{name}", 96, draft_vocab_size=32, output_dir=tmp_path / f"v-{name}")
        res = train(TrainConfig(dataset=str(tmp_path / f"ds-{name}"), target=target,
                                vocab=str(tmp_path / f"v-{name}"), output_dir=str(tmp_path / f"r-{name}"),
                                batch_size=4, epochs=4, dtype="fp32", seed=0, progress=False,
                                tensorboard=False))
        runs[name] = res.last_metrics
    assert json.loads((tmp_path / "ds-fp8" / "manifest.json").read_text())["dtype"] == "float8_e4m3fn"
    assert runs["fp8"]["loss"] == pytest.approx(runs["f32"]["loss"], rel=0.05)
    assert runs["fp8"]["loss"] != runs["f32"]["loss"]  # really another input
    assert data.FP8_FORMAT_VERSION == 2
