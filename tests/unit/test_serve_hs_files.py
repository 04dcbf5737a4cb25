"""Hidden-state files and their ``.lock`` protocol, as vLLM's connectors write them."""

from __future__ import annotations

import fcntl
import os
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from vllm_compat.serve.hs_files import (  # noqa: E402
    SCALES_KEY,
    HiddenStatesFiles,
    quantize_per_token,
    save_hidden_states,
)


def lock_is_held(path: str) -> bool:
    """What speculators' reader does: try LOCK_EX | LOCK_NB on an O_RDWR descriptor."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def states(t=5, k=4, h=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, k, h, generator=g) * 3).to(torch.bfloat16)


def test_the_file_has_vllms_keys_dtypes_and_layout(tmp_path):
    hs = states()
    save_hidden_states(tmp_path / "a.safetensors", [5, 6, 7, 8, 9], hs)
    data = load_file(tmp_path / "a.safetensors")
    assert set(data) == {"token_ids", "hidden_states"}
    assert data["token_ids"].dtype == torch.int64 and data["token_ids"].tolist() == [5, 6, 7, 8, 9]
    assert torch.equal(data["hidden_states"], hs)


def test_fp8_scales_per_token_over_layers_and_features(tmp_path):
    hs = states(t=6, k=3, h=32)
    hs[2] = 0  # an all-zero token: a tiny scale, zeros back (not NaN)
    save_hidden_states(tmp_path / "q.safetensors", range(6), hs, "fp8")
    data = load_file(tmp_path / "q.safetensors")
    q, scale = data["hidden_states"], data[SCALES_KEY]
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (6, 1, 1)
    amax = hs.float().abs().flatten(1).amax(1)
    assert torch.equal(scale.flatten(), (amax / 448.0).clamp(min=1e-12))
    back = q.float() * scale
    # e4m3: 3 mantissa bits, relative error <= 2**-4 for normal values, and the row's max is
    # mapped onto 448 exactly
    big = hs.float().abs() >= 2 ** -6 * scale
    assert ((back - hs.float()).abs() <= 2 ** -4 * hs.float().abs())[big].all()
    assert torch.equal(back[2], torch.zeros_like(back[2]))
    assert torch.equal(q.float().abs().flatten(1).amax(1)[[0, 1, 3, 4, 5]], torch.full((5,), 448.0))


def test_quantize_is_the_same_on_any_shape():
    x = states(t=3, k=2, h=8)
    q, s = quantize_per_token(x)
    q2, s2 = quantize_per_token(x.reshape(3, 16))
    assert torch.equal(q.reshape(3, 16).view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s.flatten(), s2.flatten())


def test_the_lock_is_held_from_reservation_until_the_file_is_complete(tmp_path, monkeypatch):
    import vllm_compat.serve.hs_files as hf

    real = hf.save_hidden_states
    writing, finish = threading.Event(), threading.Event()

    def slow_save(*a, **kw):  # the write is in progress until the test lets it end
        writing.set()
        assert finish.wait(30)
        real(*a, **kw)

    monkeypatch.setattr(hf, "save_hidden_states", slow_save)
    files = HiddenStatesFiles(tmp_path, num_threads=1)
    res = files.reserve("req-1")
    lock = res.path + ".lock"
    assert os.path.exists(lock) and lock_is_held(lock)  # before the path is handed out
    done = threading.Event()
    files.write(res, [1, 2, 3, 4, 5], states(), on_done=lambda ok: done.set())
    assert writing.wait(30)
    assert lock_is_held(lock)  # held while the file is written
    finish.set()
    assert done.wait(30)
    assert not lock_is_held(lock)  # released once written; the reader removes it
    assert load_file(res.path)["token_ids"].tolist() == [1, 2, 3, 4, 5]
    files.close()


def test_discarded_before_the_write_leaves_nothing(tmp_path):
    files = HiddenStatesFiles(tmp_path)
    res = files.reserve("gone")
    files.discard(res)
    files.write(res, [1], states(t=1))  # a late write of a discarded file does nothing
    files.close()
    assert list(tmp_path.iterdir()) == []


def test_discarded_while_written_leaves_nothing(tmp_path):
    files = HiddenStatesFiles(tmp_path, num_threads=1)
    res = files.reserve("gone")
    gate = threading.Event()
    files._pool.submit(gate.wait)
    done = threading.Event()
    files.write(res, range(5), states(), on_done=lambda ok: done.set())
    files.discard(res)  # the client left; its write is still queued
    assert lock_is_held(res.path + ".lock")
    gate.set()
    assert done.wait(30)
    files.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_releases_the_lock(tmp_path):
    files = HiddenStatesFiles(tmp_path)
    res = files.reserve("bad")
    done = []
    ev = threading.Event()
    files.write(res, [1, 2], states(t=3), on_done=lambda ok: (done.append(ok), ev.set()))
    assert ev.wait(30) and done == [False]  # 2 token ids for 3 rows: refused, not written
    assert not lock_is_held(res.path + ".lock") and not os.path.exists(res.path)
    files.close()


def test_atomic_save_never_leaves_a_partial_file(tmp_path, monkeypatch):
    import safetensors.torch as st

    def broken(tensors, path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", broken)
    with pytest.raises(OSError):
        save_hidden_states(tmp_path / "hs_0.safetensors", [1], states(t=1), atomic=True)
    assert list(tmp_path.iterdir()) == []
