"""One job per output directory: a second job fails clearly, a dead one never blocks.

The other job is a real second process holding the lock (``vllm_compat.locking``, no torch
import, so it starts in well under a second).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllm_compat.locking import LOCK_FILE, OutputDirLockedError, lock_output_dir

HOLDER = textwrap.dedent("""
    import sys
    from vllm_compat.locking import lock_output_dir
    lock = lock_output_dir(sys.argv[1], sys.argv[2])
    print("locked", flush=True)
    sys.stdin.read()  # hold it until the test closes our stdin (or kills us)
    lock.release()
""")


class Holder:
    """Another job: a process that took the lock on ``directory``."""

    def __init__(self, directory: Path, job: str = "holder job") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), job],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "locked\n"
        self.pid = self.proc.pid

    def message(self, directory: Path, job: str = "holder job") -> str:
        return (f"{directory}: output directory is in use by another running job "
                f"(pid {self.pid} on {socket.gethostname()}: {job}); wait for it to finish "
                f"or use a different output directory")

    def stop(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        assert self.proc.wait(30) == -signal.SIGKILL


@pytest.fixture
def holder(tmp_path):
    h = Holder(tmp_path / "out")
    yield h
    if h.proc.poll() is None:
        h.stop()


def can_lock_from_another_process(directory: Path) -> bool:
    code = ("import sys\nfrom vllm_compat.locking import lock_output_dir, OutputDirLockedError\n"
            "try:\n    lock_output_dir(sys.argv[1]).release()\nexcept OutputDirLockedError:\n    sys.exit(1)")
    return subprocess.run([sys.executable, "-c", code, str(directory)], check=False).returncode == 0


def test_second_job_fails_with_the_exact_message(holder, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputDirLockedError) as err:
        lock_output_dir(out, "second job")
    assert str(err.value) == holder.message(out)
    assert err.value.owner["pid"] == holder.pid and err.value.directory == str(out)
    holder.stop()  # the owner finished: now it is free, and a clean release leaves no file
    assert not (out / LOCK_FILE).exists()
    lock_output_dir(out, "second job").release()


def test_every_writer_of_an_output_directory_takes_the_lock(holder, tmp_path):
    out = tmp_path / "out"
    before = sorted(p.name for p in out.iterdir())
    from vllm_compat.eagle3.data import ShardWriter

    with pytest.raises(OutputDirLockedError) as err:
        ShardWriter(out, hidden_size=8, aux_layer_ids=[1], final_layer_id=2)
    assert str(err.value) == holder.message(out)

    from vllm_compat.eagle3.extract_step import extract_dataset

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 16}))
    for backend in ("transformers", "vllm"):  # refused before any model is loaded
        with pytest.raises(OutputDirLockedError) as err:
            extract_dataset(target, tmp_path / "no-records", out, backend=backend)
        assert str(err.value) == holder.message(out)

    from vllm_compat.eagle3.training import TrainConfig, train

    with pytest.raises(OutputDirLockedError) as err:  # before reading dataset, target or vocab
        train(TrainConfig(dataset="nowhere", target="nowhere", vocab="nowhere", output_dir=str(out)))
    assert str(err.value) == holder.message(out)

    from vllm_compat.speculators import offline

    args = offline.parse_args(["--target-model-path", "m", "--train-data-path", "x.jsonl",
                               "--output-dir", str(out), "--tensor-parallel-size", "1"])
    with pytest.raises(OutputDirLockedError) as err:  # before the generator is touched
        offline.generate_and_save_hidden_states(args, offline.TokenizedDataset([[1]], [[1]]), object())
    assert str(err.value) == holder.message(out)
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written by the refused jobs


def test_lock_of_a_killed_job_does_not_block(tmp_path):
    out = tmp_path / "out"
    dead = Holder(out, "killed job")
    dead.kill()
    stale = json.loads((out / LOCK_FILE).read_text())
    assert stale["pid"] == dead.pid and stale["job"] == "killed job"  # the file outlived it
    lock = lock_output_dir(out, "next job")  # the kernel dropped the flock with the process
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not can_lock_from_another_process(out)
    lock.release()
    assert can_lock_from_another_process(out)


def test_writer_holds_the_lock_until_closed_and_nests_in_one_process(tmp_path):
    from vllm_compat.eagle3.data import ShardWriter

    out = tmp_path / "ds"
    with lock_output_dir(out, "eagle3 extract"):  # what extract_dataset does around its writer
        w = ShardWriter(out, hidden_size=4, aux_layer_ids=[1], final_layer_id=2, dtype=torch.float32)
        w.add({"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([True, False]),
               "hidden_states": torch.zeros(2, 2, 4)})
        w.close()
        assert not can_lock_from_another_process(out)  # the outer lock is still held
        with pytest.raises(RuntimeError, match=f"ShardWriter for {out} is closed"):
            w.add({})
    assert can_lock_from_another_process(out)
    w = ShardWriter(out, hidden_size=4, aux_layer_ids=[1], final_layer_id=2, dtype=torch.float32)
    assert not can_lock_from_another_process(out)
    w.close()
    assert can_lock_from_another_process(out)
