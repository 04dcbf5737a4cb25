"""vllm_compat.speculators.VllmHiddenStatesGenerator accepts exactly what speculators' does.

Reference: speculators 0.3.0 and 0.4.0.1's ``VllmHiddenStatesGenerator``
(``speculators/data_generation/vllm_hidden_states_generator.py``), read three ways:

* always: the committed snapshot ``tests/data/speculators_signatures.json`` (extracted
  with ``ast`` from the PyPI wheels by ``tests/data/extract_speculators_signatures.py``);
* when speculators is installed: its source, located through its distribution metadata
  and parsed the same way (no import, so no vLLM needed), must equal the snapshot;
* when speculators *and* a vLLM it can import are installed: the live class, through
  ``inspect.signature``.

"Compatible" means: speculators' parameters are a prefix of ours with the same names,
kinds and defaults (so every positional or keyword call that worked still works and
means the same); each parameter after them has a default, and those of vllm_compat's own
(not in any speculators release) are keyword-only.
``generate`` must be identical.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import pathlib
import sys

import pytest

from vllm_compat.speculators import VllmHiddenStatesGenerator

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
SNAPSHOT = json.loads((DATA / "speculators_signatures.json").read_text())
VERSIONS = sorted(SNAPSHOT["versions"])
MISSING = object()


def _extractor_module():
    spec = importlib.util.spec_from_file_location("extract_speculators_signatures",
                                                  DATA / "extract_speculators_signatures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ours(fn) -> list[dict]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        d: dict = {"name": p.name, "kind": p.kind.name, "has_default": p.default is not p.empty}
        if d["has_default"]:
            d["default"] = p.default
        out.append(d)
    return out


def _core(params: list[dict]) -> list[tuple]:
    return [(p["name"], p["kind"], p["has_default"], p.get("default", MISSING)) for p in params]


# Parameters some speculators release takes positionally (0.4.0 appended one to 0.3.0's).
SPECULATORS_PARAMS = {p["name"] for v in VERSIONS for p in SNAPSHOT["versions"][v]["__init__"]}


def assert_compatible(theirs: list[dict], ours: list[dict]) -> None:
    t, o = _core(theirs), _core(ours)
    assert o[:len(t)] == t, f"speculators' parameters {t} are not a prefix of ours {o}"
    for name, kind, has_default, _ in o[len(t):]:
        assert has_default, f"added parameter {name!r} has no default"
        if name not in SPECULATORS_PARAMS:  # vllm_compat's own additions
            assert kind == "KEYWORD_ONLY", (
                f"added parameter {name!r} must be keyword-only, is {kind}")


def test_snapshot_holds_both_reference_releases():
    assert {"0.3.0", "0.4.0.1"} <= set(VERSIONS)
    for v in VERSIONS:
        assert SNAPSHOT["versions"][v]["__init__"][1]["name"] == "model_path"


@pytest.mark.parametrize("version", VERSIONS)
def test_constructor_matches_snapshot(version):
    assert_compatible(SNAPSHOT["versions"][version]["__init__"],
                      _ours(VllmHiddenStatesGenerator.__init__))


@pytest.mark.parametrize("version", VERSIONS)
def test_generate_matches_snapshot_exactly(version):
    ref = SNAPSHOT["versions"][version]
    assert _core(_ours(VllmHiddenStatesGenerator.generate)) == _core(ref["generate"])
    ret = inspect.signature(VllmHiddenStatesGenerator.generate).return_annotation
    assert ret == ref["generate_returns"] == "list[dict]"


def test_0_4_added_max_num_batched_tokens_after_0_3_parameters():
    a, b = (_core(SNAPSHOT["versions"][v]["__init__"]) for v in ("0.3.0", "0.4.0.1"))
    assert b[:len(a)] == a and [p[0] for p in b[len(a):]] == ["max_num_batched_tokens"]


def test_the_check_rejects_incompatible_signatures():
    ref = SNAPSHOT["versions"]["0.4.0.1"]["__init__"]

    def renamed(self, model, layer_ids=None, max_model_len=2048, gpu_memory_utilization=0.8,
                tensor_parallel_size=1, max_num_batched_tokens=None):
        pass

    def other_default(self, model_path, layer_ids=None, max_model_len=4096,
                      gpu_memory_utilization=0.8, tensor_parallel_size=1,
                      max_num_batched_tokens=None):
        pass

    def positional_extra(self, model_path, layer_ids=None, max_model_len=2048,
                         gpu_memory_utilization=0.8, tensor_parallel_size=1,
                         max_num_batched_tokens=None, legacy=False):
        pass

    for fn in (renamed, other_default, positional_extra):
        with pytest.raises(AssertionError):
            assert_compatible(ref, _ours(fn))


def test_snapshot_is_what_the_extractor_reads_from_source():
    """The ast reader gives the snapshot's entries for a source with the same class."""
    mod = _extractor_module()
    src = (
        "class VllmHiddenStatesGenerator:\n"
        "    def __init__(self, model_path: str, layer_ids: list[int] | None = None,\n"
        "                 max_model_len: int = 2048, gpu_memory_utilization: float = 0.8,\n"
        "                 tensor_parallel_size: int = 1):\n"
        "        pass\n"
        "    def generate(self, token_ids: list[list[int]] | torch.Tensor) -> list[dict]:\n"
        "        pass\n"
    )
    got = mod.signatures_from_source(src)
    ref = SNAPSHOT["versions"]["0.3.0"]
    assert got["__init__"] == ref["__init__"] and got["generate"] == ref["generate"]


# --------------------------------------------------------------------------- live package


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:
        return None


INSTALLED = _installed_version()
needs_speculators = pytest.mark.skipif(
    INSTALLED is None,
    reason="speculators is not installed (pip install 'vllm-compat[speculators]' or "
           "speculators==0.4.0.1 --no-deps); the snapshot tests still ran")


def _installed_source() -> str:
    dist = importlib.metadata.distribution("speculators")
    for f in dist.files or ():
        if str(f).replace("\\", "/") == SNAPSHOT["module"]:
            return pathlib.Path(dist.locate_file(f)).read_text()
    pytest.skip(f"speculators {INSTALLED} has no {SNAPSHOT['module']} (not an Era-A release)")


@needs_speculators
def test_installed_speculators_source_equals_snapshot():
    if INSTALLED not in SNAPSHOT["versions"]:
        pytest.skip(f"speculators {INSTALLED} is not a snapshotted release ({VERSIONS})")
    got = _extractor_module().signatures_from_source(_installed_source())
    ref = SNAPSHOT["versions"][INSTALLED]
    for key in ("__init__", "generate", "generate_returns"):
        assert got[key] == ref[key], key


@needs_speculators
def test_installed_speculators_class_matches_ours():
    """Import the real class (its module imports vLLM) and compare with inspect."""
    name = "speculators.data_generation.vllm_hidden_states_generator"
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # vLLM missing or a release this speculators cannot import
        pytest.skip(f"cannot import {name} here ({type(exc).__name__}: {exc}); "
                    "the source-level test compared it without importing")
    cls = mod.VllmHiddenStatesGenerator
    theirs_init, theirs_gen = _ours(cls.__init__), _ours(cls.generate)
    assert_compatible(theirs_init, _ours(VllmHiddenStatesGenerator.__init__))
    assert _core(theirs_gen) == _core(_ours(VllmHiddenStatesGenerator.generate))
    if INSTALLED in SNAPSHOT["versions"]:
        ref = SNAPSHOT["versions"][INSTALLED]
        assert _core(theirs_init) == _core(ref["__init__"])
        assert _core(theirs_gen) == _core(ref["generate"])
    assert "vllm" in sys.modules  # the real module really was imported
