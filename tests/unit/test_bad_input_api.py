"""Bad input across the public API: one test per case, each with the exact message.

Covered here: unsupported / unparsable vLLM versions (through ``route`` and through
``detect()`` reading the installed distribution's metadata), layer ids (negative, beyond
``L``, duplicated, not integers, empty) through every entry point that takes them, and a
draft, dataset or trained run made for another target (``validate``, ``export``,
``train``). Request-level input (empty prompts, token ids, block sizes, hash algorithms)
is tested in test_request_validation.py and tests/conformance/test_bad_input_requests.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import vllm_compat
from vllm_compat import versions

NEWEST, NEXT = versions.NEWEST_TESTED, versions.NEWEST_TESTED_SERIES  # from the versions table
from vllm_compat.errors import (
    InvalidLayerIdError, InvalidVllmVersionError, TargetMismatchError, UnknownAdapterError,
    UnsupportedVllmVersionError, VllmCompatError,
)
from vllm_compat.extract import HiddenStatesExtractor, extract_hidden_states
from vllm_compat.extract import layers as lay

RANGE4 = "valid ids are 0..4 (0 = embeddings output, 4 = final pre-norm state)"


def _raises(exc_type, fn, *args, **kw) -> str:
    with pytest.raises(exc_type) as info:
        fn(*args, **kw)
    return str(info.value)


# ----------------------------------------------------------------------------- vLLM version

def test_too_old_version_is_refused_with_the_range_and_the_fix():
    msg = _raises(UnsupportedVllmVersionError, versions.route, "0.9.2", env={})
    assert msg == ("vLLM 0.9.2 is older than vllm_compat supports: supported range is 0.10.2 to "
                   f"{NEWEST.major}.{NEWEST.minor}.x (newer runs with a warning); upgrade vLLM: pip install -U 'vllm>=0.10.2'")


def test_newer_than_tested_is_refused_under_strict():
    msg = _raises(UnsupportedVllmVersionError, versions.route, f"{NEXT}", env={"VLLM_COMPAT_STRICT": "1"})
    assert msg == (f"vLLM {NEXT} is newer than the newest release vllm_compat was tested on ({NEWEST}) and "
                   f"VLLM_COMPAT_STRICT=1 refuses untested releases: install vLLM <= {NEWEST}, set "
                   "VLLM_COMPAT_STRICT=drift to accept it when the drift check finds nothing that "
                   "affects a capability, or unset VLLM_COMPAT_STRICT to run it with adapter 'v0_29'")


def test_unparsable_version_string():
    assert _raises(InvalidVllmVersionError, versions.route, "nightly", env={}) == (
        "not a PEP 440 version: 'nightly' (expected a vLLM version such as '0.11.1' or "
        "'0.11.1rc6.dev16+g933cdea44')")
    assert _raises(InvalidVllmVersionError, versions.route, "  ", env={}) == (
        "not a vLLM version string: '  ' (expected a PEP 440 version such as '0.11.1' or "
        "'0.11.1rc6.dev16+g933cdea44')")


def test_unknown_forced_adapter():
    msg = _raises(UnknownAdapterError, versions.route, "0.26.0", env={"VLLM_COMPAT_ADAPTER": "v9"})
    assert msg == ("VLLM_COMPAT_ADAPTER='v9' names no adapter; choose one of ['v0_10', 'v0_11', "
                   "'v0_17', 'v0_29'], or unset it to route by the installed version")


@pytest.fixture
def installed_vllm(tmp_path, monkeypatch):
    """Make ``importlib.metadata`` find a vLLM distribution of the given version, ahead of any
    real one: detect() then runs its real installed-version path (no function is patched)."""
    def install(version: str) -> None:
        d = tmp_path / f"site-{version.replace('+', '_')}" / f"vllm-{version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        monkeypatch.syspath_prepend(str(d.parent))
    monkeypatch.delenv("VLLM_COMPAT_ADAPTER", raising=False)
    monkeypatch.delenv("VLLM_COMPAT_STRICT", raising=False)
    return install


def _detect_fails(exc_type) -> str:
    had_vllm = "vllm" in sys.modules
    msg = _raises(exc_type, vllm_compat.detect, refresh=True)
    assert had_vllm or "vllm" not in sys.modules  # refused before vLLM was imported
    return msg


def test_detect_refuses_an_installed_vllm_that_is_too_old(installed_vllm):
    installed_vllm("0.9.2")
    assert _detect_fails(UnsupportedVllmVersionError) == (
        f"vLLM 0.9.2 is older than vllm_compat supports: supported range is 0.10.2 to {NEWEST.major}.{NEWEST.minor}.x "
        "(newer runs with a warning); upgrade vLLM: pip install -U 'vllm>=0.10.2'")
    # the public helpers that need vLLM go through the same check
    with pytest.raises(UnsupportedVllmVersionError, match="older than vllm_compat supports"):
        vllm_compat.adapter(refresh=True)


def test_detect_refuses_a_newer_installed_vllm_under_strict(installed_vllm, monkeypatch):
    installed_vllm("99.0.1")
    monkeypatch.setenv("VLLM_COMPAT_STRICT", "1")
    assert _detect_fails(UnsupportedVllmVersionError) == (
        f"vLLM 99.0.1 is newer than the newest release vllm_compat was tested on ({NEWEST}) and "
        f"VLLM_COMPAT_STRICT=1 refuses untested releases: install vLLM <= {NEWEST}, set "
        "VLLM_COMPAT_STRICT=drift to accept it when the drift check finds nothing that "
        "affects a capability, or unset VLLM_COMPAT_STRICT to run it with adapter 'v0_29'")


def test_detect_names_an_unparsable_installed_version(installed_vllm):
    installed_vllm("custom-fork")
    assert _detect_fails(InvalidVllmVersionError) == (
        "the installed vLLM's metadata reports version 'custom-fork', which is not a PEP 440 "
        "version: reinstall vLLM from a release wheel, or build it from a git checkout with its "
        "tags so that setuptools-scm can name the version")


# ----------------------------------------------------------------------------- layer ids

LAYER_CASES = {
    "negative": ([1, -1],
                 f"layer id -1 is negative: {RANGE4}; for HF-style indices counted from the end use "
                 "from_hf_indices()"),
    "beyond_L": ([0, 7],
                 f"layer id 7 is above num_hidden_layers=4: the target has 4 decoder layers, so {RANGE4}"),
    "just_beyond_L": ([5], f"layer id 5 is above num_hidden_layers=4: the target has 4 decoder layers, so {RANGE4}"),
    "duplicated": ([2, 3, 2], "layer id 2 is requested more than once (positions 0 and 2): list each layer once"),
    "float": ([1.5], "layer id must be an integer, got 1.5"),
    "bool": ([True], "layer id must be an integer, got True"),
    "empty": ([], f"no layer ids requested: pass at least one id ({RANGE4}), or None for the EAGLE-3 default"),
    "string": ("123", "layer ids must be a sequence of ints, got '123'"),
    "scalar": (3, "layer ids must be a sequence of ints, got 3"),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_validate_layer_ids(case):
    bad, message = LAYER_CASES[case]
    msg = _raises(InvalidLayerIdError, lay.validate_layer_ids, bad, 4)
    assert msg == message
    assert issubclass(InvalidLayerIdError, ValueError) and issubclass(InvalidLayerIdError, VllmCompatError)


@pytest.fixture
def tiny_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_hidden_layers": 4, "vocab_size": 64}))
    return str(tmp_path)


@pytest.mark.parametrize("case", ["negative", "beyond_L", "duplicated", "empty", "string"])
def test_extractor_refuses_bad_layer_ids_before_starting_vllm(tiny_model, case):
    bad, message = LAYER_CASES[case]
    assert _raises(InvalidLayerIdError, HiddenStatesExtractor, tiny_model, layer_ids=bad) == message
    assert _raises(InvalidLayerIdError, extract_hidden_states, tiny_model, [[1, 2]], layer_ids=bad) == message


def test_converters_name_the_valid_range():
    assert _raises(InvalidLayerIdError, lay.from_hf_indices, [9], 8) == (
        "HF hidden_states index 9 is out of range for 8 layers (9 entries): valid indices are -9..8")
    assert _raises(InvalidLayerIdError, lay.from_speculators_indices, [8], 8) == (
        "speculators layer id 8 is out of range 0..7 (id k is the output of decoder layer k; the target "
        "has 8 decoder layers)")
    assert _raises(InvalidLayerIdError, lay.from_speculators_indices, [3, 3], 8) == (
        "layer id 4 is requested more than once (positions 0 and 1): list each layer once")
    assert _raises(InvalidLayerIdError, lay.to_speculators_indices, [0, 3], 8) == (
        "layer id 0 (embeddings) has no speculators 0.3/0.4 equivalent: their ids start at the output "
        "of layer 0 (our 1)")
    assert _raises(InvalidLayerIdError, lay.eagle3_default_layers, 2) == (
        "the EAGLE-3 default set needs num_layers >= 3, got 2: pass layer ids explicitly (valid ids are "
        "0..2 (0 = embeddings output, 2 = final pre-norm state))")


def test_eagle3_extract_step_refuses_bad_aux_ids(tmp_path):
    from vllm_compat.eagle3.extract_step import aux_layer_ids_for
    from vllm_compat.testing.synthetic import write_target

    target = write_target(tmp_path / "t", num_hidden_layers=8)
    assert _raises(ValueError, aux_layer_ids_for, target, [2, 9]) == (
        "layer id 9 is above num_hidden_layers=8: the target has 8 decoder layers, so valid ids are 0..8 "
        "(0 = embeddings output, 8 = final pre-norm state)")


# ----------------------------------------------------------------------------- another target

@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Target A (hidden 16, vocab 96, 8 layers), a draft trained and exported for it, and
    targets B (hidden 32, vocab 128, another architecture) and C (A with 12 layers)."""
    from vllm_compat.eagle3.export import export
    from vllm_compat.testing.synthetic import write_dataset, write_target
    from vllm_compat.eagle3.training import TrainConfig, train
    from vllm_compat.eagle3.vocab import build_vocab

    d = tmp_path_factory.mktemp("another-target")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        write_target(d / "A")
        write_target(d / "B", hidden_size=32, vocab_size=128)
        cfg = json.loads((d / "B" / "config.json").read_text())
        cfg["architectures"] = ["Qwen2ForCausalLM"]
        (d / "B" / "config.json").write_text(json.dumps(cfg))
        write_target(d / "C", num_hidden_layers=12)
        write_dataset(d / "dsA", d / "A", num_samples=4)
        build_vocab(d / "dsA", 96, draft_vocab_size=32, output_dir=d / "vocabA")
        build_vocab(d / "dsA", 128, draft_vocab_size=32, output_dir=d / "vocab128")
        train(TrainConfig(dataset=str(d / "dsA"), target=str(d / "A"), vocab=str(d / "vocabA"),
                          output_dir=str(d / "runA"), batch_size=2, dtype="fp32", progress=False,
                          tensorboard=False))
    finally:
        torch.set_num_threads(n)
    export(d / "runA", d / "A", d / "ckptA")  # verifier.name_or_path = A's absolute path
    return d


def _validation_errors(ckpt, target):
    from vllm_compat.eagle3.validate import CheckpointValidationError, validate

    with pytest.raises(CheckpointValidationError) as info:
        validate(ckpt, target, with_vllm=False)
    return {p.code: p.message for p in info.value.problems}


def test_validate_refuses_a_draft_for_another_target(drafts):
    A, B = (drafts / "A").resolve(), drafts / "B"
    fix = ("validate against the target the draft was trained for, or re-export the draft with "
           f"verifier={str(B)!r} if it was trained on this one")
    errors = _validation_errors(drafts / "ckptA", B)
    assert errors == {
        "target_hidden": f"draft made for hidden size 16, the target {B} has 32",
        "target_vocab": f"draft made for a vocabulary of 96, the target {B} has 128",
        "target_arch": f"draft made for a ['LlamaForCausalLM'] verifier, the target {B} is "
                       f"['Qwen2ForCausalLM']: {fix}",
        "verifier_mismatch": f"speculators_config.verifier.name_or_path is {A}, a different model from "
                             f"the target {B}: `vllm serve` would pair the draft with {A}; {fix}",
        "t2d_shape": "t2d is bool [96], expected bool [128] (target vocab size)",
    }


def test_validate_refuses_a_draft_for_a_target_of_the_same_sizes(drafts):
    # C has A's hidden size, vocabulary and architecture but 12 layers: only the verifier
    # name tells them apart, and the draft's layers 2, 4, 5 would be the wrong states.
    A, C = (drafts / "A").resolve(), drafts / "C"
    fix = ("validate against the target the draft was trained for, or re-export the draft with "
           f"verifier={str(C)!r} if it was trained on this one")
    assert _validation_errors(drafts / "ckptA", C) == {
        "verifier_mismatch": f"speculators_config.verifier.name_or_path is {A}, a different model from "
                             f"the target {C}: `vllm serve` would pair the draft with {A}; {fix}",
    }


def test_validate_accepts_the_same_target_by_another_path(drafts, tmp_path):
    import shutil

    from vllm_compat.eagle3.validate import validate

    shutil.copytree(drafts / "A", tmp_path / "copy-of-A")
    assert validate(drafts / "ckptA", tmp_path / "copy-of-A", with_vllm=False).ok
    assert validate(drafts / "ckptA", with_vllm=False).ok  # found through verifier.name_or_path


@pytest.mark.parametrize("other, message", [
    ("B", "draft {run} was trained for a target with hidden size 16, but {t} has hidden size 32: "
          "export it with the target it was trained on, or train a draft for {t}"),
    ("C", "draft {run} was trained for a target with 8 decoder layers, but {t} has 12 decoder layers: "
          "export it with the target it was trained on, or train a draft for {t}"),
])
def test_export_refuses_another_target(drafts, tmp_path, other, message):
    from vllm_compat.eagle3.export import export

    t = drafts / other
    msg = _raises(TargetMismatchError, export, drafts / "runA", t, tmp_path / "out")
    assert msg == message.format(run=drafts / "runA", t=t)
    assert not (tmp_path / "out").exists()  # nothing half-written


def _train_cfg(drafts, tmp_path, target, vocab="vocabA"):
    from vllm_compat.eagle3.training import TrainConfig

    return TrainConfig(dataset=str(drafts / "dsA"), target=str(drafts / target), vocab=str(drafts / vocab),
                       output_dir=str(tmp_path / "run"), batch_size=2, dtype="fp32", progress=False,
                       tensorboard=False)


@pytest.mark.parametrize("target, vocab, message", [
    ("B", "vocab128",
     "dataset {ds} holds hidden states of size 16 (it was extracted from {A}), but the target {t} has "
     "hidden size 32: train with the target the dataset was extracted from, or re-extract the dataset "
     "from this one"),
    ("C", "vocabA",
     "dataset {ds} was extracted from a target with 8 decoder layers (it was extracted from {A}), but the "
     "target {t} has 12: train with the target the dataset was extracted from, or re-extract the dataset "
     "from this one"),
    ("A", "vocab128",
     "vocab mapping is over 128 ids, the target {t} has 96: build the mapping for this target "
     "(build_vocab(..., 96, ...))"),
])
def test_train_refuses_a_dataset_or_vocab_for_another_target(drafts, tmp_path, target, vocab, message):
    from vllm_compat.eagle3.training import train

    msg = _raises(TargetMismatchError, train, _train_cfg(drafts, tmp_path, target, vocab))
    assert msg == message.format(ds=drafts / "dsA", A=drafts / "A", t=drafts / target)
    assert not (Path(tmp_path) / "run" / "checkpoints").exists()
