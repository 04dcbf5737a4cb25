"""HiddenStatesDataset refuses damaged datasets with an error naming the file,
or, with ``on_invalid="skip"``, leaves the bad shards out and reports them.

Each test damages one thing of a dataset written by the real ShardWriter (files rewritten
with safetensors itself, with the manifest's size and sha256 updated, when the damage is
meant to be in the content rather than a torn file) and asserts the exact message.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_compat.eagle3.data import (
    MANIFEST,
    DatasetFormatError,
    HiddenStatesDataset,
    InvalidShardError,
    ShardWriter,
    SkippedShard,
)

H, AUX, FINAL = 8, [1, 2, 3], 6
LENGTHS = [3, 5, 4, 6, 2]  # shards: [3, 5], [4, 6], [2]


def sample(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    t = LENGTHS[i]
    return {"input_ids": torch.randint(0, 50, (t,), generator=g),
            "loss_mask": torch.rand(t, generator=g) > 0.5,
            "hidden_states": torch.randn(t, len(AUX) + 1, H, generator=g)}


@pytest.fixture
def ds_dir(tmp_path):
    d = tmp_path / "ds"
    with ShardWriter(d, hidden_size=H, aux_layer_ids=AUX, final_layer_id=FINAL, dtype=torch.float32,
                     samples_per_shard=2) as w:
        for i in range(len(LENGTHS)):
            w.add(sample(i))
    return d


def shard(d, k: int):
    return d / f"shard-{k:05d}.safetensors"


def edit_manifest(d, fn) -> None:
    m = json.loads((d / MANIFEST).read_text())
    fn(m)
    (d / MANIFEST).write_text(json.dumps(m))


def rewrite(d, k: int, fn) -> None:
    """Rewrite shard k's tensors (as another writer would) and record its new size and sha256."""
    path = shard(d, k)
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))
    raw = path.read_bytes()

    def update(m):
        # the whole-file sha256 of earlier writers (still honoured) in place of the tree digest
        m["shards"][k].pop("sha256_tree", None)
        m["shards"][k].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    edit_manifest(d, update)


def error(d, **kw) -> str:
    with pytest.raises(InvalidShardError) as err:
        HiddenStatesDataset(d, **kw)
    return str(err.value)


def test_intact_dataset_reads_back(ds_dir):
    ds = HiddenStatesDataset(ds_dir, verify="full")
    assert len(ds) == 5 and ds.skipped == []
    for i, s in enumerate(ds):
        assert all(torch.equal(s[k], v.to(s[k].dtype)) for k, v in sample(i).items())


@pytest.mark.parametrize("keep, reason", [
    (5, "truncated: 5 bytes, not a safetensors file"),
    (40, "truncated: 40 bytes, shorter than its {n}-byte safetensors header"),
    (-7, "truncated: {size} bytes, its safetensors header describes {full}"),
])
def test_truncated_shard(ds_dir, keep, reason):
    p = shard(ds_dir, 1)
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    p.write_bytes(raw[:keep])
    want = reason.format(n=n, size=len(raw) + keep if keep < 0 else keep, full=len(raw))
    assert error(ds_dir) == f"{p}: {want}"


def test_trailing_bytes(ds_dir):
    p = shard(ds_dir, 0)
    size = p.stat().st_size
    with p.open("ab") as f:
        f.write(b"junk")
    assert error(ds_dir) == f"{p}: has trailing bytes: {size + 4} bytes, its safetensors header describes {size}"


def test_wrong_shape(ds_dir):
    rewrite(ds_dir, 1, lambda t: t.update({"0.hidden_states": t["0.hidden_states"][:, :3].contiguous()}))
    assert error(ds_dir) == (f"{shard(ds_dir, 1)}: sample 0: hidden_states shape (4, 3, 8) != "
                             f"(T, n_aux + 1, H) = (4, 4, 8)")


def test_loss_mask_length_differs(ds_dir):
    rewrite(ds_dir, 0, lambda t: t.update({"1.loss_mask": t["1.loss_mask"][:-1]}))
    assert error(ds_dir) == f"{shard(ds_dir, 0)}: sample 1: loss_mask shape (4,) != input_ids shape (5,)"


@pytest.mark.parametrize("key, dtype, reason", [
    ("hidden_states", torch.float16, "hidden_states dtype float16, manifest.json says float32"),
    ("input_ids", torch.int32, "input_ids dtype int32, expected int64"),
    ("loss_mask", torch.uint8, "loss_mask dtype uint8, expected bool"),
])
def test_wrong_dtype(ds_dir, key, dtype, reason):
    rewrite(ds_dir, 2, lambda t: t.update({f"0.{key}": t[f"0.{key}"].to(dtype)}))
    assert error(ds_dir) == f"{shard(ds_dir, 2)}: sample 0: {reason}"


def test_missing_key(ds_dir):
    rewrite(ds_dir, 0, lambda t: t.pop("1.loss_mask"))
    assert error(ds_dir) == f"{shard(ds_dir, 0)}: sample 1: sample lacks ['loss_mask']"


def test_unexpected_tensor_name(ds_dir):
    rewrite(ds_dir, 0, lambda t: t.update({"weights": torch.zeros(1)}))
    assert error(ds_dir) == f"{shard(ds_dir, 0)}: unexpected tensor name 'weights' (expected '<sample>.<key>')"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_inf_named_with_file_and_sample(ds_dir, value):
    def poison(t):
        t["1.hidden_states"][2, 0, 3] = value
        t["1.hidden_states"][0, 1, 1] = -value
    rewrite(ds_dir, 0, poison)
    p = shard(ds_dir, 0)
    reason = f"{p}: sample 1: hidden_states has 2 non-finite values (NaN/Inf)"
    ds = HiddenStatesDataset(ds_dir)  # the header is fine: caught when the sample is read
    ds[0]
    with pytest.raises(InvalidShardError) as err:
        ds[1]
    assert str(err.value) == reason
    assert error(ds_dir, verify="full") == reason  # or when the dataset is opened


def test_manifest_lists_a_missing_shard(ds_dir):
    shard(ds_dir, 1).unlink()
    assert error(ds_dir) == f"{shard(ds_dir, 1)}: listed in manifest.json but missing"


def test_shard_not_in_manifest(ds_dir):
    shutil.copy(shard(ds_dir, 0), ds_dir / "shard-00007.safetensors")
    assert error(ds_dir) == f"{ds_dir / 'shard-00007.safetensors'}: shard file not listed in manifest.json"


def test_shard_listed_twice(ds_dir):
    edit_manifest(ds_dir, lambda m: m["shards"].append(dict(m["shards"][0])))
    assert error(ds_dir) == f"{shard(ds_dir, 0)}: listed twice in manifest.json"


def test_sample_count_mismatch(ds_dir):
    edit_manifest(ds_dir, lambda m: m["shards"][2].update(num_samples=2))
    assert error(ds_dir) == f"{shard(ds_dir, 2)}: holds 1 samples, manifest.json says 2"


def test_token_count_mismatch(ds_dir):
    edit_manifest(ds_dir, lambda m: m["shards"][1].update(num_tokens=11))
    assert error(ds_dir) == f"{shard(ds_dir, 1)}: holds 10 tokens, manifest.json says 11"


def test_hidden_size_mismatch(ds_dir):
    edit_manifest(ds_dir, lambda m: m.update(hidden_size=16))
    assert error(ds_dir) == (f"{shard(ds_dir, 0)}: sample 0: hidden_states shape (3, 4, 8) != "
                             f"(T, n_aux + 1, H) = (3, 4, 16)")


def test_size_mismatch_with_manifest(ds_dir):
    rewrite(ds_dir, 1, lambda t: None)
    edit_manifest(ds_dir, lambda m: m["shards"][1].update(bytes=m["shards"][1]["bytes"] + 1))
    size = shard(ds_dir, 1).stat().st_size
    assert error(ds_dir) == f"{shard(ds_dir, 1)}: {size} bytes, manifest.json says {size + 1}"


def test_changed_bytes_caught_by_full_verify(ds_dir):
    p = shard(ds_dir, 2)
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0x40  # a flipped bit in the last hidden state: same size, valid header
    p.write_bytes(bytes(raw))
    HiddenStatesDataset(ds_dir)  # header-level checks cannot see it
    assert error(ds_dir, verify="full") == (
        f"{p}: sha256 differs from manifest.json (the file changed after it was written)")


@pytest.mark.parametrize("text, reason", [
    ('{"format": ', "not valid JSON (Expecting value: line 1 column 12 (char 11))"),
    ('{"format": "vllm-compat-eagle3-hidden-states", "format_version": 1}', "missing 'shards'"),
    ('[]', "not a vllm-compat-eagle3-hidden-states v1/v2 manifest (format=None, version=None)"),
])
def test_broken_manifest(ds_dir, text, reason):
    (ds_dir / MANIFEST).write_text(text)
    with pytest.raises(DatasetFormatError) as err:
        HiddenStatesDataset(ds_dir)
    assert str(err.value) == f"{ds_dir / MANIFEST}: {reason}"


def test_skip_leaves_bad_shards_out_and_reports_them(ds_dir, caplog):
    p1 = shard(ds_dir, 1)
    p1.write_bytes(p1.read_bytes()[:-3])
    extra = ds_dir / "shard-00009.safetensors"
    shutil.copy(shard(ds_dir, 0), extra)
    size = p1.stat().st_size
    ds = HiddenStatesDataset(ds_dir, on_invalid="skip")
    assert ds.skipped == [
        SkippedShard(str(p1), f"truncated: {size} bytes, its safetensors header describes {size + 3}"),
        SkippedShard(str(extra), "shard file not listed in manifest.json"),
    ]
    assert len(ds) == 3
    kept = [0, 1, 4]
    for i, s in zip(kept, ds, strict=True):
        assert torch.equal(s["hidden_states"], sample(i)["hidden_states"])
    assert [ids.tolist() for ids, _ in ds.token_stream()] == [sample(i)["input_ids"].tolist() for i in kept]
    assert f"skipping {p1}: truncated" in caplog.text


def test_skip_with_full_verify_drops_non_finite_shards(ds_dir):
    rewrite(ds_dir, 2, lambda t: t["0.hidden_states"].fill_(float("nan")))
    ds = HiddenStatesDataset(ds_dir, on_invalid="skip", verify="full")
    assert ds.skipped == [SkippedShard(str(shard(ds_dir, 2)), "sample 0: hidden_states has 64 non-finite values (NaN/Inf)")]
    assert len(ds) == 4


def test_bad_options(ds_dir):
    with pytest.raises(ValueError, match="on_invalid must be one of"):
        HiddenStatesDataset(ds_dir, on_invalid="ignore")
    with pytest.raises(ValueError, match="verify must be one of"):
        HiddenStatesDataset(ds_dir, verify="none")


def test_writer_accepts_views_of_one_buffer_and_a_reused_tensor(tmp_path):
    """The extractor hands out per-request views of one host buffer per engine step, and
    callers reuse tensors (the same ids for every sample): safetensors refuses tensors that
    share memory, so the writer must copy exactly those. Read back equal to the inputs."""
    from vllm_compat.eagle3.data import HiddenStatesDataset, ShardWriter

    step = torch.randn(7, 2, 4)  # one "step buffer" holding three samples' states
    ids = torch.arange(3)
    views = [step[0:3], step[3:5], step[5:7]]
    with ShardWriter(tmp_path / "ds", hidden_size=4, aux_layer_ids=[1], final_layer_id=2,
                     dtype=torch.float32, samples_per_shard=3) as w:
        for v in views:
            n = v.shape[0]
            w.add({"input_ids": ids[:n], "loss_mask": torch.ones(n, dtype=torch.bool), "hidden_states": v})
        w.add({"input_ids": ids, "loss_mask": torch.ones(3, dtype=torch.bool), "hidden_states": views[0]})
    ds = HiddenStatesDataset(tmp_path / "ds")
    for i, v in enumerate(views + [views[0]]):
        assert torch.equal(ds[i]["hidden_states"], v)
    # the same samples without the copy are exactly what safetensors refuses
    from safetensors.torch import save
    with pytest.raises(RuntimeError, match="share memory"):
        save({"0.hidden_states": views[0], "1.hidden_states": step[0:3]})


def test_streamed_shard_bytes_are_a_valid_safetensors_file(tmp_path):
    """The writer streams header + tensor buffers instead of ``safetensors.torch.save`` (one
    copy less); safetensors itself must read every dtype back bit-exact, empty tensors too."""
    from safetensors import safe_open
    from safetensors.torch import load

    from vllm_compat.eagle3.data import _safetensors_chunks

    g = torch.Generator().manual_seed(0)
    tensors = {
        "0.input_ids": torch.randint(0, 1 << 40, (5,), generator=g),
        "0.loss_mask": torch.rand(5, generator=g) > 0.5,
        "0.hidden_states": torch.randn(5, 2, 3, generator=g).to(torch.bfloat16),
        "1.hidden_states": torch.randn(4, 3, generator=g).to(torch.float8_e4m3fn),
        "1.scale": torch.rand(2, generator=g, dtype=torch.float64),
        "2.empty": torch.zeros(0, 3, dtype=torch.float16),
        "3.int32": torch.arange(7, dtype=torch.int32),
    }
    data = b"".join(_safetensors_chunks(tensors))
    back = load(data)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k
    (tmp_path / "x.safetensors").write_bytes(data)
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:  # the reader's path
        assert set(f.keys()) == set(tensors)


def test_background_writer_writes_the_same_bytes_and_surfaces_errors(tmp_path):
    """BackgroundShardWriter (what extraction writes through): the same shard files, byte for
    byte, as ShardWriter called in the loop; a failing write is raised in the caller."""
    from vllm_compat.eagle3.data import BackgroundShardWriter, ShardWriter, check_sample  # noqa: F401

    g = torch.Generator().manual_seed(3)
    samples = []
    for n in (5, 9, 2, 7, 4, 6, 3):
        samples.append({"input_ids": torch.randint(0, 50, (n,), generator=g),
                        "loss_mask": torch.ones(n, dtype=torch.bool),
                        "hidden_states": torch.randn(n, 2, 8, generator=g).to(torch.bfloat16)})

    def writer(d):
        return ShardWriter(d, hidden_size=8, aux_layer_ids=[1], final_layer_id=3, samples_per_shard=3)

    with writer(tmp_path / "sync") as w:
        for s in samples:
            w.add(s)
    with BackgroundShardWriter(writer(tmp_path / "bg"), max_queue=2) as w:
        for s in samples:
            w.add(s)
    names = sorted(p.name for p in (tmp_path / "sync").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "bg").iterdir())
    assert len([n for n in names if n.startswith("shard-")]) == 3
    for n in names:
        if n.startswith("shard-") or n == "manifest.json":
            assert (tmp_path / "sync" / n).read_bytes() == (tmp_path / "bg" / n).read_bytes(), n

    # a bad sample is refused in the caller's thread, before it is queued
    w = BackgroundShardWriter(writer(tmp_path / "bad"))
    with pytest.raises(Exception, match="hidden_states"):
        w.add({**samples[0], "hidden_states": torch.zeros(5, 2, 7)})
    w.close()

    # a write that fails in the thread comes back on a later add() or on close()
    w = BackgroundShardWriter(writer(tmp_path / "fail"))
    w.writer.flush = lambda: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    raised = []
    try:
        for s in samples * 3:
            w.add(s)
            time.sleep(0.01)  # the thread fails at the first shard; later adds see it
    except OSError as e:
        raised.append(e)
    assert raised and "No space left" in str(raised[0])
    with pytest.raises(OSError, match="No space left"):  # close() does not swallow it
        w.close()
    assert w.writer._lock is None  # the folder lock was released
