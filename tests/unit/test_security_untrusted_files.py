"""Datasets, samples and checkpoints may come from other people: nothing is
unpickled, names in a manifest cannot leave the dataset directory, and loading a target
never runs code shipped with it.

Every crafted payload here would create a marker file if it ran; each test first shows that
the payload is live (it does run when loaded the unsafe way) where that is cheap.
"""

from __future__ import annotations

import ast
import json
import pickle
from pathlib import Path

import pytest
import torch

from vllm_compat.eagle3.data import (
    MANIFEST,
    HiddenStatesDataset,
    ShardWriter,
    UnsafePathError,
)
from vllm_compat.speculators import offline

SRC = Path(__file__).resolve().parents[2] / "src" / "vllm_compat"


class Payload:
    """Unpickling this calls ``open(marker, "w")``: code execution that leaves a trace."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted_pt(path: Path, marker: Path) -> Path:
    torch.save({"input_ids": torch.zeros(3, dtype=torch.long), "loss_mask": Payload(marker),
                "hidden_states": [torch.zeros(3, 4)]}, path)
    return path


def test_payload_is_live_when_unpickled(tmp_path):
    marker = tmp_path / "ran"
    crafted_pt(tmp_path / "data_0.pt", marker)
    torch.load(tmp_path / "data_0.pt", weights_only=False)  # what the reader must never do
    assert marker.exists()


def test_speculators_sample_with_pickled_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = crafted_pt(tmp_path / "data_0.pt", marker)
    with pytest.raises(offline.SampleFileError) as err:
        offline.load_sample(path)
    assert str(err.value) == (
        f"{path}: refused by the weights only loader: unsupported GLOBAL io.open (the file holds "
        "pickled objects or code; sample files are never unpickled)")
    with pytest.raises(offline.SampleFileError):
        dict(offline.iter_data_dir(tmp_path))
    assert not marker.exists()


def test_training_checkpoint_with_pickled_code_is_refused_and_not_run(tmp_path):
    from vllm_compat.eagle3.training import load_checkpoint

    marker = tmp_path / "ran"
    path = tmp_path / "step-00000001.pt"
    torch.save({"step": 1, "draft": {"w": torch.zeros(1)}, "rng": Payload(marker)}, path)
    with pytest.raises(Exception, match="GLOBAL io.open") as err:  # weights_only refused it
        load_checkpoint(path)
    assert isinstance(err.value, pickle.UnpicklingError) or isinstance(err.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()


def test_damaged_speculators_sample_names_the_file(tmp_path):
    path = tmp_path / "data_0.pt"
    offline.save_sample_to_disk({"input_ids": torch.zeros(3, dtype=torch.long)}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(offline.SampleFileError) as err:
        offline.load_sample(path)
    assert str(err.value) == (
        f"{path}: not a readable torch file (PytorchStreamReader failed reading zip archive: "
        "failed finding central directory)")


def test_speculators_symlink_out_of_the_directory_is_refused(tmp_path):
    outside = tmp_path / "outside.pt"
    offline.save_sample_to_disk({"input_ids": torch.zeros(2, dtype=torch.long)}, outside)
    out = tmp_path / "out"
    out.mkdir()
    (out / "data_0.pt").symlink_to(outside)
    with pytest.raises(offline.SampleFileError) as err:
        list(offline.iter_data_dir(out))
    assert str(err.value) == f"{out / 'data_0.pt'}: a link to {outside}, outside the directory {out}"


@pytest.fixture
def ds_dir(tmp_path):
    d = tmp_path / "ds"
    with ShardWriter(d, hidden_size=4, aux_layer_ids=[1], final_layer_id=2, dtype=torch.float32,
                     samples_per_shard=1) as w:
        for t in (2, 3):
            w.add({"input_ids": torch.arange(t), "loss_mask": torch.ones(t, dtype=torch.bool),
                   "hidden_states": torch.ones(t, 2, 4)})
    return d


def set_shard_name(d: Path, name: str, key: str = "shards") -> None:
    m = json.loads((d / MANIFEST).read_text())
    if key == "pending":
        m["pending"] = dict(m["shards"].pop(), file=name)
    else:
        m["shards"][0]["file"] = name
    (d / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("name", ["../secret.safetensors", "sub/../../secret.safetensors", "/etc/passwd"])
@pytest.mark.parametrize("on_invalid", ["raise", "skip"])
def test_manifest_naming_a_path_outside_is_refused(ds_dir, name, on_invalid):
    (ds_dir.parent / "secret.safetensors").write_bytes((ds_dir / "shard-00000.safetensors").read_bytes())
    set_shard_name(ds_dir, name)
    with pytest.raises(UnsafePathError) as err:  # never skipped: the manifest itself is hostile
        HiddenStatesDataset(ds_dir, on_invalid=on_invalid)
    assert str(err.value) == f"{ds_dir / MANIFEST}: shard file {name!r} is outside the dataset directory"


def test_symlinked_shard_leading_outside_is_refused(ds_dir):
    outside = ds_dir.parent / "elsewhere.safetensors"
    shard = ds_dir / "shard-00000.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(UnsafePathError) as err:
        HiddenStatesDataset(ds_dir)
    assert str(err.value) == (f"{ds_dir / MANIFEST}: shard file 'shard-00000.safetensors' is a link to "
                              f"{outside}, outside the dataset directory")
    # a link that stays inside the directory is fine
    inside = ds_dir / "moved.bin"
    outside.rename(inside)
    shard.unlink()
    shard.symlink_to(inside.name)
    assert len(HiddenStatesDataset(ds_dir)) == 2


def test_resumed_writer_never_deletes_outside_the_directory(ds_dir):
    """Recovery deletes a pending shard that does not match its record: a crafted 'pending'
    name must not make it delete someone else's file."""
    victim = ds_dir.parent / "victim.safetensors"
    victim.write_bytes(b"precious")
    set_shard_name(ds_dir, "../victim.safetensors", key="pending")
    with pytest.raises(UnsafePathError) as err:
        ShardWriter(ds_dir, hidden_size=4, aux_layer_ids=[1], final_layer_id=2, dtype=torch.float32)
    assert str(err.value) == (f"{ds_dir / MANIFEST}: shard file '../victim.safetensors' is outside "
                              "the dataset directory")
    assert victim.read_bytes() == b"precious"


def test_planted_lock_symlink_is_not_followed(tmp_path):
    from vllm_compat.locking import LOCK_FILE, lock_output_dir

    target = tmp_path / "important.txt"
    target.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(target)
    with pytest.raises(OSError):
        lock_output_dir(out)
    assert target.read_text() == "keep"


def _calls(name: str):
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == name:
                yield path.relative_to(SRC.parent.parent), node


def test_every_torch_load_in_the_library_is_weights_only():
    found = list(_calls("torch.load"))
    assert found  # the scan sees the known call sites
    for path, node in found:
        kw = {k.arg: k.value for k in node.keywords}
        assert isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True, \
            f"{path}:{node.lineno}: torch.load without weights_only=True"
    assert not list(_calls("pickle.load")) and not list(_calls("pickle.loads"))


def _trust_remote_code_true() -> list[str]:
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            pairs = []
            if isinstance(node, ast.Call):
                pairs = [(k.arg, k.value) for k in node.keywords]
            elif isinstance(node, ast.Dict):
                pairs = [(k.value if isinstance(k, ast.Constant) else None, v)
                         for k, v in zip(node.keys, node.values)]
            for key, value in pairs:
                if key == "trust_remote_code" and not (isinstance(value, ast.Constant) and value.value is False) \
                        and not isinstance(value, (ast.Name, ast.Attribute)):
                    hits.append(f"{path.relative_to(SRC.parent.parent)}:{node.lineno}")
    return hits


def test_library_never_turns_trust_remote_code_on_by_itself():
    assert _trust_remote_code_true() == []


def test_target_with_custom_code_is_not_executed(tmp_path):
    """A target checkpoint shipping its own modeling code (``auto_map``) is refused by the CPU
    extraction path; the code never runs."""
    pytest.importorskip("transformers")
    from vllm_compat.eagle3.extract_step import extract_dataset

    marker = tmp_path / "ran"
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "model_type": "crafted-llama", "architectures": ["CraftedForCausalLM"],
        "auto_map": {"AutoConfig": "crafted.CraftedConfig", "AutoModelForCausalLM": "crafted.CraftedForCausalLM"},
        "num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 32}))
    (target / "crafted.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        extract_dataset(target, tmp_path / "records", tmp_path / "ds", backend="transformers")
    assert not marker.exists()
