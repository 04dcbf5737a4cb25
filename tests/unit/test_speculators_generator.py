"""CPU tests of VllmHiddenStatesGenerator's own logic: input handling, ordering, layer ids.

The engine-side capture is vllm_compat.extract's (GPU; tests/gpu). What the generator
adds on top — prompt preparation, the mapping of extractor samples to speculators'
result list, the layer numberings and their warning — is pure and is tested here with real
torch tensors and extractor-shaped samples.
"""

from __future__ import annotations

import io
import json
import random
import warnings
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from vllm_compat.speculators import layers
from vllm_compat.speculators.vllm_hidden_states_generator import (
    VllmHiddenStatesGenerator,
    prepare_prompts,
    resolve_layer_ids,
    samples_to_results,
)

try:  # the extraction API's sample type, once it exists
    from vllm_compat.extract import ExtractedSample
except ImportError:
    @dataclass(frozen=True)
    class ExtractedSample:  # the documented fields of vllm_compat.extract.ExtractedSample
        index: int
        token_ids: object
        hidden_states: object
        layer_ids: tuple


H = 8


def state(token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """[T, K, H] where every value encodes (token id, layer id, channel): mispairing shows."""
    t = torch.tensor(token_ids, dtype=torch.float32)[:, None, None]
    k = torch.tensor(layer_ids, dtype=torch.float32)[None, :, None]
    c = torch.arange(H, dtype=torch.float32)[None, None, :]
    return t * 1000 + k * 10 + c / 10


def sample(i: int, ids: list[int], layer_ids: list[int]) -> ExtractedSample:
    return ExtractedSample(index=i, token_ids=torch.tensor(ids, dtype=torch.int64),
                           hidden_states=state(ids, layer_ids), layer_ids=tuple(layer_ids))


def prompts_of(lengths: list[int]) -> list[list[int]]:
    return [[100 + 7 * i + j for j in range(n)] for i, n in enumerate(lengths)]


# --------------------------------------------------------------------------- ordering

LENGTHS = [5, 16, 17, 33, 48, 1, 70, 9, 64, 31, 100, 2, 47]  # 13 prompts, distinct lengths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_results_follow_input_order_for_13_prompts(seed):
    prompts = prompts_of(LENGTHS)
    ids = [3, 17, 30, 32]
    samples = [sample(i, p, ids) for i, p in enumerate(prompts)]
    random.Random(seed).shuffle(samples)  # whatever order the engine finishes in
    results = samples_to_results(samples, prompts, ids)
    assert [r["input_ids"].tolist() for r in results] == prompts
    for p, r in zip(prompts, results):
        assert len(r["hidden_states"]) == 4 and r["loss_mask"] is None
        for lid, h in zip(ids, r["hidden_states"]):
            assert h.shape == (len(p), H)
            assert torch.equal(h, state(p, [lid])[:, 0])


def test_the_0_4_sorted_request_id_order_would_mispair():
    """What 0.4.x did: iterate sorted('req_0_{i}') and pair with the batch's loss masks."""
    n = 11
    rid = [f"req_0_{i}" for i in range(n)]
    order = [rid.index(r) for r in sorted(rid)]
    assert order != list(range(n))  # req_0_10 sorts before req_0_2
    assert order[:3] == [0, 1, 10]
    # ours pairs by the extractor's index, whatever the ids would sort to
    prompts = prompts_of(LENGTHS[:n])
    results = samples_to_results([sample(i, prompts[i], [1]) for i in order], prompts, [1])
    assert [len(r["input_ids"]) for r in results] == LENGTHS[:n]


def test_slots_may_repeat_and_follow_the_requested_order():
    prompts = prompts_of([4, 6])
    extracted = [4, 1, 2]  # extractor order need not be the slot order
    results = samples_to_results([sample(i, p, extracted) for i, p in enumerate(prompts)],
                                 prompts, [2, 2, 1, 4])
    hs = results[1]["hidden_states"]
    assert [int(h[0, 0].item()) % 1000 // 10 for h in hs] == [2, 2, 1, 4]


def test_each_slot_owns_its_storage():
    """torch.save of one slot must not write the whole [T, K, H] block (views would)."""
    prompts = prompts_of([64])
    ids = [1, 2, 3, 4]
    (r,) = samples_to_results([sample(0, prompts[0], ids)], prompts, ids)
    for h in r["hidden_states"]:
        assert h.is_contiguous() and h.untyped_storage().nbytes() == h.numel() * h.element_size()
    buf = io.BytesIO()
    torch.save(r["hidden_states"][0], buf)
    assert buf.tell() < 64 * H * 4 * 2


@pytest.mark.parametrize("case", ["dup", "out_of_range", "missing", "tokens", "shape", "layer"])
def test_inconsistent_extractor_output_is_an_error(case):
    prompts = prompts_of([3, 4, 5])
    ids = [1, 2]
    s = [sample(i, p, ids) for i, p in enumerate(prompts)]
    if case == "dup":
        s.append(s[0])
    elif case == "out_of_range":
        s[2] = sample(3, prompts[2], ids)
    elif case == "missing":
        s = s[:2]
    elif case == "tokens":  # a sample carrying another prompt's tokens
        s[1] = ExtractedSample(1, s[2].token_ids, s[2].hidden_states, s[2].layer_ids)
    elif case == "shape":
        s[1] = ExtractedSample(1, s[1].token_ids, s[1].hidden_states[:, :1], s[1].layer_ids)
    elif case == "layer":
        s[1] = sample(1, prompts[1], [1, 3])
    with pytest.raises(RuntimeError):
        samples_to_results(s, prompts, ids)


# --------------------------------------------------------------------------- inputs


def test_prepare_prompts_accepts_speculators_input_forms():
    t = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert prepare_prompts(t, 100) == [[1, 2, 3], [4, 5, 6]]
    two = [torch.tensor([1, 2]), torch.tensor([3, 4, 5])]
    assert prepare_prompts(two, 100) == [[1, 2], [3, 4, 5]]
    assert prepare_prompts([[1, 2], (3,)], 100) == [[1, 2], [3]]


def test_prepare_prompts_truncates_to_max_model_len_minus_one():
    assert prepare_prompts([list(range(1, 20))], 8) == [list(range(1, 8))]


def test_no_tensor_truthiness_anywhere():
    # `if not x` on a multi-element tensor raises; a list of such tensors must work
    multi = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    assert prepare_prompts(multi, 10) == [[5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="cannot be empty"):
        prepare_prompts([], 10)
    with pytest.raises(ValueError, match="cannot be empty"):
        prepare_prompts(torch.zeros((0, 3), dtype=torch.long), 10)
    with pytest.raises(ValueError, match="empty"):
        prepare_prompts([[1], []], 10)
    with pytest.raises(ValueError, match="2-D"):
        prepare_prompts(torch.tensor([1, 2, 3]), 10)
    with pytest.raises(ValueError, match="not an integer"):
        prepare_prompts([[1, 2.5]], 10)


# --------------------------------------------------------------------------- layer ids

SPECULATORS_0_4_DEFAULT = "[2, L//2, L-3, L-1]"  # speculators 0.3.0/0.4.0.1 generator


def spec_default(L: int) -> list[int]:
    return [2, L // 2, L - 3, L - 1]


def slot_layers(result: dict) -> list[int]:
    """The vLLM layer id each result tensor holds (state() encodes it in the values)."""
    return [int(h[0, 0].item()) % 1000 // 10 for h in result["hidden_states"]]


@pytest.mark.parametrize("L", [3, 4, 6, 11, 12, 24, 32, 61])
def test_default_ids_are_speculators_defaults(L):
    reported, slots = resolve_layer_ids(None, L, "speculators")
    assert reported == spec_default(L)
    # one slot per distinct id, ascending, each the output of layer i = vLLM state i + 1
    assert slots == [i + 1 for i in sorted(set(spec_default(L)))]


def test_too_few_layers_fail_as_speculators_failed():
    with pytest.raises(ValueError, match=r"Layer index 2 out of bounds \[0, 1\]"):
        resolve_layer_ids(None, 2, "speculators")


def test_speculators_id_i_is_the_output_of_layer_i():
    """HF ``hidden_states[i + 1]`` (what speculators' own test compares with) is the state
    entering layer i + 1; the extractor's id i + 1. Every id, L-1 (final pre-norm) included."""
    L = 6
    prompts = prompts_of([7, 3])
    everything = list(range(L + 1))  # extractor states 0..L
    samples = [sample(i, p, everything) for i, p in enumerate(prompts)]
    reported, slots = resolve_layer_ids([0, 2, 5], L, "speculators")
    res = samples_to_results(samples, prompts, slots)
    assert reported == [0, 2, 5]
    assert slot_layers(res[0]) == [1, 3, 6]  # 6 == L: the final pre-norm state


def test_unsorted_and_repeated_ids_come_back_as_speculators_returned_them():
    """0.3/0.4 captured ``if layer_idx in frozenset(layer_ids)`` inside the layer loop: one
    state per distinct id, in layer order. A fork's data must not change slot order."""
    reported, slots = resolve_layer_ids([29, 2, 16, 2], 32, "speculators")
    assert reported == [29, 2, 16, 2] and slots == [3, 17, 30]
    # vLLM numbering keeps the caller's order and repeats (vllm_compat's own API)
    assert resolve_layer_ids([29, 2, 16, 2], 32, "vllm") == ([29, 2, 16, 2], [29, 2, 16, 2])


def test_vllm_numbering_defaults_and_bounds():
    assert resolve_layer_ids(None, 32, "vllm") == ([2, 16, 29, 32], [2, 16, 29, 32])
    assert resolve_layer_ids([0, 32], 32, "vllm")[1] == [0, 32]  # embeddings .. final pre-norm
    with pytest.raises(ValueError, match="out of bounds"):
        resolve_layer_ids([33], 32, "vllm")
    with pytest.raises(ValueError, match="at least 4"):
        resolve_layer_ids(None, 3, "vllm")


def test_speculators_bounds():
    with pytest.raises(ValueError, match=r"Layer index 32 out of bounds \[0, 31\]"):
        resolve_layer_ids([32], 32, "speculators")  # what speculators 0.3/0.4 rejected too
    with pytest.raises(ValueError, match="out of bounds"):
        resolve_layer_ids([-1], 32, "speculators")
    with pytest.raises(ValueError, match="empty"):
        resolve_layer_ids([], 32, "speculators")


def test_final_slot_is_the_same_state_in_both_numberings():
    L = 61  # DeepSeek-V3
    _, old = resolve_layer_ids(None, L, "speculators")
    _, new = resolve_layer_ids(None, L, "vllm")
    assert old[-1] == new[-1] == L
    assert [o - n for o, n in zip(old[:3], new[:3])] == [1, 1, 1]


@pytest.mark.parametrize(("convention", "legacy", "want"), [
    (None, None, ("speculators", False)),
    ("speculators", None, ("speculators", True)),
    ("vllm", None, ("vllm", True)),
    (None, True, ("speculators", True)),
    (None, False, ("vllm", True)),
    ("speculators", True, ("speculators", True)),
    ("vllm", False, ("vllm", True)),
])
def test_choose_convention(convention, legacy, want):
    assert layers.choose_convention(convention, legacy) == want


@pytest.mark.parametrize(("convention", "legacy", "match"), [
    ("vllm", True, "layer_convention='vllm' contradicts legacy_layer_indices=True"),
    ("speculators", False,
     "layer_convention='speculators' contradicts legacy_layer_indices=False"),
    ("legacy", None, "must be 'speculators' or 'vllm'"),
    ("VLLM", None, "must be 'speculators' or 'vllm'"),
    (None, 1, "must be True, False or None"),
])
def test_contradictory_or_unknown_choices_are_refused(convention, legacy, match):
    with pytest.raises(ValueError, match=match):
        layers.choose_convention(convention, legacy)


def test_converters_round_trip_and_agree_with_the_extraction_api():
    for L in (4, 8, 32, 61):
        ids = list(range(L))
        assert layers.to_legacy(layers.from_legacy(ids, L), L) == ids
    with pytest.raises(ValueError, match="embeddings"):
        layers.to_legacy([0, 3])
    ext = pytest.importorskip("vllm_compat.extract.layers")
    for L in (8, 32, 61):
        ids = spec_default(L)
        assert list(ext.from_speculators_indices(ids, L)) == layers.from_legacy(ids, L)
        assert list(ext.eagle3_default_layers(L)) == layers.default_layer_ids(L)


# --------------------------------------------------------------------------- wiring


class RecordingExtractor:
    """Stands in for vllm_compat.extract.HiddenStatesExtractor, whose engine needs a GPU
    (tests/gpu runs the real one): records the constructor call and yields real
    ExtractedSample objects, in reverse input order, with states encoding (token, layer)."""

    calls: list = []

    def __init__(self, model_path, **kw):
        RecordingExtractor.calls.append((model_path, kw))
        self.layer_ids = tuple(kw["layer_ids"])
        self.closed = False

    def extract(self, prompts):
        prompts = [list(p) for p in prompts]
        for i in reversed(range(len(prompts))):
            yield sample(i, prompts[i], list(self.layer_ids))

    def close(self):
        self.closed = True


def write_config(path, num_layers: int) -> str:
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": H,
        "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": num_layers, "vocab_size": 1024, "max_position_embeddings": 256,
        "tie_word_embeddings": True}))
    return str(path)


@pytest.fixture
def recording(monkeypatch):
    import vllm_compat.extract as ext

    RecordingExtractor.calls = []
    monkeypatch.setattr(ext, "HiddenStatesExtractor", RecordingExtractor)
    monkeypatch.setattr(layers, "_warned", False)  # a fresh process, as far as the warning goes
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # offline.main sets it
    return RecordingExtractor.calls


@pytest.fixture
def tiny_model(tmp_path, recording):
    return write_config(tmp_path, 6)


@pytest.fixture
def qwen12(tmp_path, recording):
    """Qwen2-shaped config with 12 layers: speculators' test ids [10] and [2, 6, 9] are valid."""
    return write_config(tmp_path, 12)


def make(path, *args, **kw):
    from vllm_compat.speculators import VllmHiddenStatesGenerator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", layers.LayerConventionWarning)
        return VllmHiddenStatesGenerator(path, *args, **kw)


def test_generator_default_numbering_is_speculators(qwen12):
    """speculators' own accuracy test: layer_ids [2, L//2, L-3] must hold HF
    hidden_states[3], [L//2 + 1], [L-2], i.e. extractor ids + 1."""
    g = make(qwen12, [2, 6, 9], 2048, 0.3, 1)
    res = g.generate([[5, 6, 7], [8, 9]])
    assert [slot_layers(r) for r in res] == [[3, 7, 10]] * 2
    assert g.layer_ids == [2, 6, 9] and g.capture_layer_ids == [3, 7, 10]
    assert recording_ids() == [3, 7, 10]
    assert g.layer_convention == "speculators" and g.legacy_layer_indices is True
    g.shutdown()
    # its batch test: [10] on a model of >= 11 layers is the output of the 11th layer
    g = make(qwen12, [10], 2048, 0.3, 1, 100)
    assert g.capture_layer_ids == [11] and RecordingExtractor.calls[-1][1][
        "max_num_batched_tokens"] == 100
    g.shutdown()


def recording_ids() -> list[int]:
    return list(RecordingExtractor.calls[-1][1]["layer_ids"])


def test_generator_default_ids_are_speculators_defaults(qwen12):
    g = make(qwen12)
    assert g.layer_ids == [2, 6, 9, 11] and g.capture_layer_ids == [3, 7, 10, 12]
    (r,) = g.generate([[1, 2, 3]])
    assert slot_layers(r) == [3, 7, 10, 12] and r["loss_mask"] is None
    g.shutdown()


def test_generator_returns_distinct_ids_in_layer_order(qwen12):
    g = make(qwen12, [9, 2, 9])
    (r,) = g.generate([[1, 2, 3]])
    assert g.layer_ids == [9, 2, 9] and slot_layers(r) == [3, 10]
    g.shutdown()


@pytest.mark.parametrize("kw", [{"layer_convention": "vllm"}, {"legacy_layer_indices": False},
                                {"layer_convention": "vllm", "legacy_layer_indices": False}])
def test_generator_vllm_numbering_is_one_keyword_away(qwen12, kw):
    g = make(qwen12, **kw)
    assert g.layer_convention == "vllm" and g.legacy_layer_indices is False
    assert g.layer_ids == g.capture_layer_ids == [2, 6, 9, 12]
    g.shutdown()
    g = make(qwen12, [9, 2, 9], **kw)
    (r,) = g.generate([[1, 2, 3]])
    assert slot_layers(r) == [9, 2, 9]  # the caller's order, repeats kept
    g.shutdown()


@pytest.mark.parametrize("kw", [{"layer_convention": "speculators"},
                                {"legacy_layer_indices": True},
                                {"layer_convention": "speculators", "legacy_layer_indices": True}])
def test_generator_speculators_numbering_chosen_explicitly(qwen12, kw):
    g = make(qwen12, [2, 6, 9], **kw)
    assert g.layer_convention == "speculators" and g.capture_layer_ids == [3, 7, 10]
    g.shutdown()


def test_generator_refuses_contradictions_before_starting_an_engine(qwen12):
    with pytest.raises(ValueError, match="contradicts"):
        make(qwen12, layer_convention="vllm", legacy_layer_indices=True)
    with pytest.raises(ValueError, match="contradicts"):
        make(qwen12, layer_convention="speculators", legacy_layer_indices=False)
    with pytest.raises(ValueError, match="must be 'speculators' or 'vllm'"):
        make(qwen12, layer_convention="eagle3")
    with pytest.raises(ValueError, match=r"out of bounds \[0, 11\]"):
        make(qwen12, [12])  # speculators numbering: 0..L-1
    assert make(qwen12, [12], layer_convention="vllm").capture_layer_ids == [12]
    assert len(RecordingExtractor.calls) == 1


# --------------------------------------------------------------------------- the warning

WARNING_TEXT = (
    "layer_ids follow speculators 0.3/0.4's numbering (id i = output of decoder layer i), so "
    "these hidden states are one layer deeper than what vLLM feeds an EAGLE-3 draft for the "
    "same ids at serving time; pass layer_convention='vllm' (CLI: --layer-convention vllm) "
    "for vLLM's numbering, or layer_convention='speculators' to keep this one without this "
    "warning."
)


def caught(fn):
    """Run fn with every warning recorded (Python's own once-filters off: ours must hold)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    return out, [x for x in w if issubclass(x.category, layers.LayerConventionWarning)]


def test_warning_once_when_the_numbering_is_implicit(qwen12):
    from vllm_compat.speculators import VllmHiddenStatesGenerator

    g, w = caught(lambda: VllmHiddenStatesGenerator(qwen12))
    assert [str(x.message) for x in w] == [WARNING_TEXT]
    assert issubclass(w[0].category, UserWarning)
    assert w[0].filename == __file__  # points at the caller's line, not ours
    g.shutdown()
    for args in ((), ([2, 6, 9],)):  # a second generator in the same process: silent
        g, w = caught(lambda a=args: VllmHiddenStatesGenerator(qwen12, *a))
        assert w == []
        g.shutdown()


@pytest.mark.parametrize("kw", [{"layer_convention": "speculators"}, {"layer_convention": "vllm"},
                                {"legacy_layer_indices": True}, {"legacy_layer_indices": False}])
def test_no_warning_when_the_numbering_is_chosen(qwen12, kw):
    from vllm_compat.speculators import VllmHiddenStatesGenerator

    g, w = caught(lambda: VllmHiddenStatesGenerator(qwen12, [2, 6, 9], **kw))
    assert w == []
    g.shutdown()
    # an explicit choice does not use up the warning of a later implicit one
    g, w = caught(lambda: VllmHiddenStatesGenerator(qwen12))
    assert [str(x.message) for x in w] == [WARNING_TEXT]
    g.shutdown()


def test_warning_is_one_sentence_naming_the_depth_and_the_switch():
    text = layers.SPECULATORS_NUMBERING_WARNING
    assert text == WARNING_TEXT
    assert text.count(". ") == 0 and text.endswith(".")
    assert "one layer deeper than what vLLM feeds" in text
    assert "layer_convention='vllm'" in text and "--layer-convention vllm" in text


# --------------------------------------------------------------------------- arguments


def test_generator_translates_speculators_arguments(tiny_model):
    g = make(tiny_model, None, 64, 0.3, 1)
    (path, kw), = RecordingExtractor.calls
    assert path == tiny_model
    # speculators default [2, 3, 3, 5] -> one state per distinct id: extractor ids [3, 4, 6]
    assert g.layer_ids == [2, 3, 3, 5] and g.capture_layer_ids == [3, 4, 6]
    assert kw["layer_ids"] == [3, 4, 6]
    assert kw["max_model_len"] == 64 and kw["gpu_memory_utilization"] == 0.3
    assert kw["max_num_batched_tokens"] == 8192  # speculators: max(8192, max_model_len)
    assert kw["tensor_parallel_size"] == 1 and kw["enforce_eager"] is True
    assert g.vllm_config.cache_config.gpu_memory_utilization == 0.3
    prompts = prompts_of(LENGTHS)  # 13 prompts, one longer than max_model_len - 1
    results = g.generate([torch.tensor(p) for p in prompts])
    assert [r["input_ids"].tolist() for r in results] == [p[:63] for p in prompts]
    assert slot_layers(results[4]) == [3, 4, 6]
    ex = g.extractor
    g.shutdown()
    assert ex.closed
    with pytest.raises(RuntimeError, match="shut down"):
        g.generate([[1, 2]])


def test_generator_extractor_kwargs_and_layer_validation(tiny_model):
    g = make(tiny_model, [0, 6], max_num_batched_tokens=512, layer_convention="vllm",
             extractor_kwargs={"enforce_eager": False, "dtype": "bfloat16"})
    kw = RecordingExtractor.calls[-1][1]
    assert kw["layer_ids"] == [0, 6] and kw["max_num_batched_tokens"] == 512
    assert kw["enforce_eager"] is False and kw["dtype"] == "bfloat16"
    assert kw["trust_remote_code"] is False  # speculators 0.4 forced True; ours is opt-in
    g.shutdown()
    make(tiny_model, [0, 6], layer_convention="vllm", trust_remote_code=True).shutdown()
    assert RecordingExtractor.calls[-1][1]["trust_remote_code"] is True
    with pytest.raises(ValueError, match="out of bounds"):
        make(tiny_model, [6], legacy_layer_indices=True)
    assert len(RecordingExtractor.calls) == 2  # no engine started for invalid ids


# --------------------------------------------------------------------------- command line


def cli_args(model: str, tmp_path, *extra: str) -> list[str]:
    rows = [{"input_ids": [3 + i + j for j in range(4 + i)]} for i in range(3)]
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return ["--target-model-path", model, "--train-data-path", str(data),
            "--output-dir", str(tmp_path / "out"), "--token-freq-path", str(tmp_path / "tf.pt"),
            "--tensor-parallel-size", "1", *extra]


@pytest.mark.parametrize(("extra", "numbering", "slots", "warned"), [
    ((), "speculators", [3, 7, 10, 12], True),
    (("--layer-convention", "speculators"), "speculators", [3, 7, 10, 12], False),
    (("--legacy-layer-indices",), "speculators", [3, 7, 10, 12], False),
    (("--layer-convention", "vllm"), "vllm", [2, 6, 9, 12], False),
    (("--no-legacy-layer-indices",), "vllm", [2, 6, 9, 12], False),
])
def test_cli_numbering(qwen12, tmp_path, extra, numbering, slots, warned):
    from vllm_compat.speculators import offline

    n, w = caught(lambda: offline.main(cli_args(qwen12, tmp_path, *extra)))
    assert n == 0 and len(w) == int(warned)
    assert recording_ids() == slots
    cfg = json.loads((tmp_path / "out" / "data_config.json").read_text())["hidden_states"]
    assert cfg["layer_convention"] == numbering and cfg["vllm_layer_ids"] == slots
    assert cfg["layer_ids"] == ([2, 6, 9, 11] if numbering == "speculators" else [2, 6, 9, 12])
    s = torch.load(tmp_path / "out" / "data_0.pt", weights_only=True)
    assert [int(h[0, 0].item()) % 1000 // 10 for h in s["hidden_states"]] == slots


@pytest.mark.parametrize("extra", [("--layer-convention", "vllm", "--legacy-layer-indices"),
                                   ("--layer-convention", "speculators",
                                    "--no-legacy-layer-indices")])
def test_cli_refuses_contradictory_flags(qwen12, tmp_path, extra, capsys):
    from vllm_compat.speculators import offline

    with pytest.raises(SystemExit) as exc:
        offline.main(cli_args(qwen12, tmp_path, *extra))
    assert exc.value.code == 2
    assert f"--layer-convention {extra[1]} contradicts {extra[2]}" in capsys.readouterr().err
    assert RecordingExtractor.calls == []


def test_a_tokenizer_shipped_as_code_needs_the_opt_in(tmp_path):
    """Kimi-K2.5's tokenizer is code in the checkpoint: the drop-in runs it only with
    trust_remote_code=True (speculators ran it unasked), and says which code otherwise."""
    pytest.importorskip("tiktoken")
    from vllm_compat.testing.kimi_k25 import write_kimi_k25_checkpoint
    from vllm_compat.tokenizer import RemoteCodeRefusedError

    kimi = str(write_kimi_k25_checkpoint(tmp_path / "kimi", num_layers=2, hidden_size=128,
                                         image_processor=False))
    gen = VllmHiddenStatesGenerator.__new__(VllmHiddenStatesGenerator)  # the engine is not needed
    gen.model_path, gen._tokenizer = kimi, None
    gen.trust_remote_code = False
    with pytest.raises(RemoteCodeRefusedError, match="tokenization_kimi.TikTokenTokenizer"):
        gen.tokenizer
    gen.trust_remote_code = True
    assert gen.tokenizer.convert_tokens_to_ids("<|im_end|>") == 163586


def test_config_read_from_config_json_where_remote_code_is_named_but_not_shipped(tmp_path):
    """A checkpoint whose ``auto_map`` names a configuration module it does not ship (a
    Kimi-K2.5 directory holding weights and config.json only): with ``trust_remote_code``
    transformers looks for that file and raises OSError; vLLM has its own config class for
    the model type, so its config.json is what the generator reads."""
    pytest.importorskip("transformers")
    from vllm_compat.speculators.vllm_hidden_states_generator import _model_config

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": {"num_hidden_layers": 8, "hidden_size": 256}}))
    cfg = _model_config(str(tmp_path), trust_remote_code=True)
    assert cfg.model_type == "kimi_k25" and cfg.text_config.num_hidden_layers == 8
