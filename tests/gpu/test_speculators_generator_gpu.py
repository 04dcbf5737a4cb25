"""VllmHiddenStatesGenerator on the real engine, checked the way speculators checked its own
(GPU).

speculators 0.3/0.4 tested their generator on Qwen2-0.5B with two checks: its states for
``layer_ids=[2, L//2, L-3]`` equal HF ``output_hidden_states[i + 1]`` (their numbering: id i
is the output of decoder layer i) within a mean absolute difference of 0.02, and a batch of
prompts under chunked prefill (``max_num_batched_tokens=100``, ``layer_ids=[10]``) gives the
same states as the prompts one by one (mean difference below 0.01). The same checks here, on a
tiny Qwen2-shaped checkpoint built offline (``_tiny_qwen2``: tied embeddings, 12 layers, its
own tokenizer), plus the result's keys, dtypes and shapes, in both numberings:

* no ``layer_convention`` (the drop-in default): speculators' numbering and default ids, and
  the one-time warning;
* ``layer_convention="vllm"``: id k is the state entering layer k (HF ``hidden_states[k]``,
  k = L the final pre-norm state), with no warning.

Each check is also shown able to fail: the other numbering's states miss by several times
the tolerance. Engines run one at a time and are shut down.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from vllm_compat.speculators import LayerConventionWarning, VllmHiddenStatesGenerator
from vllm_compat.speculators import layers as spec_layers

from . import _models as M
from . import _tiny_qwen2 as Q

pytestmark = pytest.mark.gpu

L = Q.NUM_LAYERS
MEAN_TOL = 0.02  # speculators' accuracy threshold: mean |generator - HF| over the layers
BATCH_TOL = 0.01  # speculators' batch-vs-one-by-one threshold (mean absolute difference)
MAX_MODEL_LEN = 2048  # as in speculators' tests
GPU_MEM = 0.05

SENTENCES = [
    "Language models read a prompt one token at a time and keep what they saw in a cache.",
    "Small test models make it cheap to check that every layer returns the right numbers.",
    "Hello!",
]
CHAT = [  # eight user turns of different lengths, each wrapped in the chat template
    "What is 5+7?",
    "Please explain how a cache helps a language model answer faster.",
    "Name three colours.",
    "Describe the water cycle, from the ocean to the clouds and back, in a few short steps.",
    "Hi!",
    "Translate 'thank you very much' into French, Spanish and German.",
    "Which planet is the largest?",
    "Give one example of a prime number and one of a square number, and say why.",
]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> str:
    return Q.build(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="module")
def prompts(qwen2) -> dict[str, list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2)
    chat = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                    add_generation_prompt=True) for c in CHAT]
    return {"sentences": [tok(s)["input_ids"] for s in SENTENCES],
            "chat": [tok(c, add_special_tokens=False)["input_ids"] for c in chat]}


@pytest.fixture(scope="module")
def hf(qwen2, prompts) -> dict[str, list[torch.Tensor]]:
    """HF transformers states per prompt, [T, L+1, H] fp32, index k = state entering layer k
    (HF ``hidden_states[k]`` for k < L; k = L the last layer's output before the norm)."""
    ref = M.HFReference(qwen2)
    try:
        return {name: [ref.states(p) for p in ps] for name, ps in prompts.items()}
    finally:
        ref.close()


def make(path: str, layer_ids=None, max_num_batched_tokens=None, **kw):
    return VllmHiddenStatesGenerator(path, layer_ids, MAX_MODEL_LEN, GPU_MEM, 1,
                                     max_num_batched_tokens,
                                     extractor_kwargs=M.engine_kwargs(), **kw)


def check_results(results: list[dict], prompts: list[list[int]], n_slots: int) -> None:
    """speculators' result format: one dict per prompt, in input order."""
    assert isinstance(results, list) and len(results) == len(prompts)
    for r, p in zip(results, prompts):
        assert set(r) == {"input_ids", "hidden_states", "loss_mask"}
        assert r["loss_mask"] is None
        assert r["input_ids"].dtype == torch.long and r["input_ids"].tolist() == p
        assert isinstance(r["hidden_states"], list) and len(r["hidden_states"]) == n_slots
        for h in r["hidden_states"]:
            assert h.shape == (len(p), Q.HIDDEN) and h.dtype == torch.bfloat16
            assert h.device.type == "cpu"


def mean_diff(results: list[dict], refs: list[torch.Tensor], ks: list[int],
              slots: slice = slice(None)) -> float:
    """Mean |ours - HF| over all tokens of all prompts, layers concatenated (speculators'
    measure); result slot j (of ``slots``) is compared with HF state ks[j]."""
    ours = torch.cat([torch.cat(r["hidden_states"][slots], dim=-1).float() for r in results])
    want = torch.cat([torch.cat([ref[:, k] for k in ks], dim=-1) for ref in refs])
    return float((ours - want).abs().mean())


@pytest.mark.parametrize("layer_ids", [[2, L // 2, L - 3], None], ids=["their-ids", "default"])
def test_default_numbering_is_speculators(qwen2, prompts, hf, layer_ids, monkeypatch):
    monkeypatch.setattr(spec_layers, "_warned", False)  # as in a fresh process
    with pytest.warns(LayerConventionWarning, match="one layer deeper"):
        g = make(qwen2, layer_ids)
    try:
        want_ids = layer_ids or [2, L // 2, L - 3, L - 1]  # speculators 0.3/0.4's default
        assert g.layer_ids == want_ids and g.layer_convention == "speculators"
        results = g.generate(prompts["sentences"])
    finally:
        g.shutdown()
    check_results(results, prompts["sentences"], len(want_ids))
    refs = hf["sentences"]
    output_of_layer_i = [i + 1 for i in want_ids]  # HF hidden_states[i + 1]
    err = mean_diff(results, refs, output_of_layer_i)
    entering_layer_i = mean_diff(results, refs, want_ids)  # vLLM's numbering, same ids
    M.record("speculators_numbering_vs_hf", layer_ids=want_ids, mean_diff=err,
             mean_diff_other_numbering=entering_layer_i)
    assert err < MEAN_TOL, (want_ids, err)
    assert entering_layer_i > 3 * MEAN_TOL, entering_layer_i  # the check tells layers apart


def test_vllm_numbering_is_state_entering_layer_k(qwen2, prompts, hf, monkeypatch):
    monkeypatch.setattr(spec_layers, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = make(qwen2, layer_convention="vllm")
    try:
        assert not [w for w in caught if issubclass(w.category, LayerConventionWarning)]
        assert g.layer_ids == [2, L // 2, L - 3, L] and g.layer_convention == "vllm"
        results = g.generate(prompts["sentences"])
    finally:
        g.shutdown()
    check_results(results, prompts["sentences"], 4)
    refs = hf["sentences"]
    err = mean_diff(results, refs, [2, L // 2, L - 3, L])
    # speculators' numbering for the same aux ids (the final slot is the same state in both)
    one_deeper = mean_diff(results, refs, [3, L // 2 + 1, L - 2], slice(0, 3))
    M.record("vllm_numbering_vs_hf", mean_diff=err, mean_diff_one_layer_deeper=one_deeper)
    assert err < MEAN_TOL, err
    assert one_deeper > 3 * MEAN_TOL, one_deeper


def test_batch_equals_one_by_one_under_chunked_prefill(qwen2, prompts, hf):
    chat = prompts["chat"]
    assert sum(map(len, chat)) > 2 * 100  # the batch needs three or more 100-token steps
    g = make(qwen2, [10], max_num_batched_tokens=100)  # id 10: output of the 11th layer
    try:
        assert g.capture_layer_ids == [11]
        one_by_one = [g.generate([p])[0] for p in chat]
        batch = g.generate(chat)
        again = g.generate(chat)  # a repeated call must not see the previous one's state
    finally:
        g.shutdown()
    for results in (batch, again):
        check_results(results, chat, 1)
    worst = 0.0
    for i, p in enumerate(chat):
        single = one_by_one[i]["hidden_states"][0]
        for results in (batch, again):
            got = results[i]["hidden_states"][0]
            assert got.shape == single.shape == (len(p), Q.HIDDEN), i
            worst = max(worst, float((got.float() - single.float()).abs().mean()))
    err_hf = mean_diff(batch, hf["chat"], [11])
    M.record("speculators_batch_vs_one_by_one", worst_mean_diff=worst, mean_diff_hf=err_hf,
             tokens=sum(map(len, chat)))
    assert worst < BATCH_TOL, worst
    assert err_hf < MEAN_TOL, err_hf
