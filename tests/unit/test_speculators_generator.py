"""CPU tests of VllmHiddenStatesGenerator's own logic: input handling, ordering, layer ids.

The engine-side capture is vllm_compat.extract's (GPU; tests/gpu). What the generator
adds on top — prompt preparation, the mapping of extractor samples to speculators'
result list, the layer-id conventions — is pure and is tested here with real torch
tensors and extractor-shaped samples.
"""

from __future__ import annotations

import io
import random
import warnings
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from vllm_compat.speculators import layers
from vllm_compat.speculators.vllm_hidden_states_generator import (
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


def test_default_layer_ids_both_conventions():
    legacy, reported, canonical = resolve_layer_ids(None, 32, True)
    assert legacy and reported == [2, 16, 29, 31] and canonical == [3, 17, 30, 32]
    legacy, reported, canonical = resolve_layer_ids(None, 32, None)
    assert not legacy and reported == canonical == [2, 16, 29, 32]


def test_legacy_final_slot_is_the_same_state_as_the_new_final_slot():
    L = 61  # DeepSeek-V3
    _, _, old = resolve_layer_ids(None, L, True)
    _, _, new = resolve_layer_ids(None, L, False)
    assert old[-1] == new[-1] == L
    assert [o - n for o, n in zip(old[:3], new[:3])] == [1, 1, 1]


def test_explicit_ids_without_the_flag_warn_and_use_the_new_convention():
    with pytest.warns(UserWarning, match="legacy_layer_indices=True"):
        legacy, reported, canonical = resolve_layer_ids([2, 16], 32, None)
    assert not legacy and reported == canonical == [2, 16]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_layer_ids([2, 16], 32, True)[2] == [3, 17]
        assert resolve_layer_ids([2, 16], 32, False)[2] == [2, 16]


def test_bounds_per_convention():
    assert resolve_layer_ids([0, 32], 32, False)[2] == [0, 32]  # embeddings .. final pre-norm
    with pytest.raises(ValueError, match="out of bounds"):
        resolve_layer_ids([33], 32, False)
    with pytest.raises(ValueError, match=r"out of bounds \[0, 31\]"):
        resolve_layer_ids([32], 32, True)  # what speculators 0.3/0.4 rejected too
    with pytest.raises(ValueError):
        resolve_layer_ids([-1], 32, True)
    with pytest.raises(ValueError, match="at least 4"):
        resolve_layer_ids(None, 2, False)


def test_legacy_flag_selects_the_states_0_3_captured():
    """Legacy id i must be the output of layer i == the extractor's state entering i+1."""
    L = 6
    prompts = prompts_of([7, 3])
    everything = list(range(L + 1))  # extractor states 0..L
    samples = [sample(i, p, everything) for i, p in enumerate(prompts)]
    _, reported, canonical = resolve_layer_ids([0, 2, 5], L, True)
    res = samples_to_results(samples, prompts, canonical)
    assert reported == [0, 2, 5]
    got = [int(h[0, 0].item()) % 1000 // 10 for h in res[0]["hidden_states"]]
    assert got == [1, 3, 6]  # 6 == L: the final pre-norm state, as 0.3's L-1


def test_converters_round_trip_and_agree_with_the_extraction_api():
    for L in (4, 8, 32, 61):
        ids = list(range(L))
        assert layers.to_legacy(layers.from_legacy(ids, L), L) == ids
    with pytest.raises(ValueError, match="embeddings"):
        layers.to_legacy([0, 3])
    ext = pytest.importorskip("vllm_compat.extract.layers")
    for L in (8, 32, 61):
        ids = [2, L // 2, L - 3, L - 1]
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


@pytest.fixture
def tiny_model(tmp_path, monkeypatch):
    import json

    import vllm_compat.extract as ext

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H,
        intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=6, vocab_size=1024, max_position_embeddings=256)))
    RecordingExtractor.calls = []
    monkeypatch.setattr(ext, "HiddenStatesExtractor", RecordingExtractor)
    return str(tmp_path)


def test_generator_translates_speculators_arguments(tiny_model):
    from vllm_compat.speculators import VllmHiddenStatesGenerator

    g = VllmHiddenStatesGenerator(tiny_model, None, 64, 0.3, 1, legacy_layer_indices=True)
    (path, kw), = RecordingExtractor.calls
    assert path == tiny_model
    # legacy default [2, 3, 3, 5] -> extractor ids [3, 4, 6], each once
    assert g.layer_ids == [2, 3, 3, 5] and g.capture_layer_ids == [3, 4, 4, 6]
    assert kw["layer_ids"] == [3, 4, 6]
    assert kw["max_model_len"] == 64 and kw["gpu_memory_utilization"] == 0.3
    assert kw["max_num_batched_tokens"] == 8192  # speculators: max(8192, max_model_len)
    assert kw["tensor_parallel_size"] == 1 and kw["enforce_eager"] is True
    assert g.vllm_config.cache_config.gpu_memory_utilization == 0.3
    prompts = prompts_of(LENGTHS)  # 13 prompts, one longer than max_model_len - 1
    results = g.generate([torch.tensor(p) for p in prompts])
    assert [r["input_ids"].tolist() for r in results] == [p[:63] for p in prompts]
    assert [int(h[0, 0].item()) % 1000 // 10 for h in results[4]["hidden_states"]] == [3, 4, 4, 6]
    ex = g.extractor
    g.shutdown()
    assert ex.closed
    with pytest.raises(RuntimeError, match="shut down"):
        g.generate([[1, 2]])


def test_generator_extractor_kwargs_and_layer_validation(tiny_model):
    from vllm_compat.speculators import VllmHiddenStatesGenerator

    g = VllmHiddenStatesGenerator(tiny_model, [0, 6], max_num_batched_tokens=512,
                                  legacy_layer_indices=False,
                                  extractor_kwargs={"enforce_eager": False, "dtype": "bfloat16"})
    kw = RecordingExtractor.calls[-1][1]
    assert kw["layer_ids"] == [0, 6] and kw["max_num_batched_tokens"] == 512
    assert kw["enforce_eager"] is False and kw["dtype"] == "bfloat16"
    assert kw["trust_remote_code"] is False  # speculators 0.4 forced True; ours is opt-in
    g.shutdown()
    VllmHiddenStatesGenerator(tiny_model, [0, 6], legacy_layer_indices=False, trust_remote_code=True).shutdown()
    assert RecordingExtractor.calls[-1][1]["trust_remote_code"] is True
    with pytest.raises(ValueError, match="out of bounds"):
        VllmHiddenStatesGenerator(tiny_model, [6], legacy_layer_indices=True)
    assert len(RecordingExtractor.calls) == 2  # no engine started for invalid ids
