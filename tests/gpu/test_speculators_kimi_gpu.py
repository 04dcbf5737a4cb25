"""The speculators drop-in on Kimi-K2.5, the deployment it was written for: the generator class
and the offline command on the test checkpoint of :mod:`vllm_compat.testing.kimi_k25`, with
chats rendered by the checkpoint's own chat template (its tokenizer is code: opted in with
``trust_remote_code``), 18 prompts in chunks of 40 tokens, checked against transformers.

speculators numbering (the default): id i is the output of decoder layer i, HF
``hidden_states[i + 1]``; vLLM's (``layer_convention="vllm"``): id k enters layer k, L is the
final pre-norm state.
"""

from __future__ import annotations

import json

import pytest
import torch

from . import _models as M

pytestmark = pytest.mark.gpu

L = 8
CHUNK = 40
TOL = 0.05  # rel. error per layer, vLLM bf16 against HF fp32 on the same weights
_REF: dict[str, list[torch.Tensor]] = {}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> str:
    from vllm_compat.testing.kimi_k25 import write_kimi_k25_checkpoint

    return str(write_kimi_k25_checkpoint(tmp_path_factory.mktemp("kimi"), variant="bf16", seed=11))


@pytest.fixture(scope="module")
def chats(kimi, tmp_path_factory) -> list[dict]:
    """18 chats of different lengths through ``eagle3 prepare`` (the checkpoint's template,
    assistant-only loss mask): speculators' tokenized input."""
    from vllm_compat.eagle3.prepare import PREPARED, prepare

    d = tmp_path_factory.mktemp("chats")
    words = "the cache keeps every token a model has read so far in a prompt".split()
    with open(d / "chats.jsonl", "w") as f:
        for i in range(18):
            q = " ".join(words[: 2 + i % 11]) + f" #{i}?"
            a = " ".join(reversed(words[: 3 + (i * 7) % 12])) + "."
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a * (1 + i % 4)}]}) + "\n")
    rep = prepare(d / "chats.jsonl", kimi, d / "prep", max_length=1024, trust_remote_code=True)
    assert rep.kept == 18
    rows = [json.loads(x) for x in (d / "prep" / PREPARED).read_text().splitlines()]
    assert len({len(r["input_ids"]) for r in rows}) >= 11
    return [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows]


def reference(kimi, chats) -> list[torch.Tensor]:
    """HF fp32 per chat: ``[T, L+1, H]``, k = input of layer k, L = final pre-norm state."""
    if "ref" not in _REF:
        from vllm_compat.testing.kimi_k25 import kimi_k25_text_model_for_reference

        ref = M.HFReference.from_model(kimi_k25_text_model_for_reference(kimi).cuda())
        _REF["ref"] = [ref.states(c["input_ids"]) for c in chats]
        ref.close()
    return _REF["ref"]


def _generator(kimi, **kw):
    from vllm_compat.speculators import VllmHiddenStatesGenerator

    return VllmHiddenStatesGenerator(
        kimi, max_model_len=2048, gpu_memory_utilization=0.05, max_num_batched_tokens=CHUNK,
        trust_remote_code=True, extractor_kwargs=dict(M.engine_kwargs(), enforce_eager=True), **kw)


@pytest.mark.parametrize("convention", ["speculators", "vllm"])
def test_generator_class_on_kimi(kimi, chats, convention):
    kw = {"layer_convention": "vllm", "layer_ids": [1, 4, L]} if convention == "vllm" else {}
    gen = _generator(kimi, **kw)
    try:
        out = gen.generate([c["input_ids"] for c in chats])
        tok = gen.tokenizer  # the checkpoint's own tokenizer, opted in
        assert tok.convert_tokens_to_ids("<|im_end|>") == 163586
    finally:
        gen.shutdown()
    # speculators' default ids for 8 layers, [2, 4, 5, 7], are the outputs of those layers
    ours = [1, 4, L] if convention == "vllm" else [3, 5, 6, 8]
    ref = reference(kimi, chats)
    worst = 0.0
    for i, (r, c) in enumerate(zip(out, chats)):
        assert r["input_ids"].tolist() == c["input_ids"]  # input order
        assert len(r["hidden_states"]) == len(ours)
        for slot, k in zip(r["hidden_states"], ours):
            assert slot.shape == (len(c["input_ids"]), 256) and slot.dtype == torch.bfloat16
            worst = max(worst, M.rel_err(slot.float(), ref[i][:, k]))
    M.record(f"speculators_kimi:{convention}", worst_rel=worst, vllm_ids=ours)
    assert worst <= TOL


def test_offline_command_on_kimi(kimi, chats, tmp_path):
    from vllm_compat.speculators import offline

    data = tmp_path / "tokenized.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    out = tmp_path / "out"
    argv = ["--target-model-path", kimi, "--train-data-path", str(data), "--output-dir", str(out),
            "--token-freq-path", str(tmp_path / "freq.pt"), "--seq-length", "2048",
            "--batch-size", "18", "--gpu-memory-utilization", "0.05",
            "--max-num-batched-tokens", str(CHUNK), "--trust-remote-code"]
    # beside other test processes: a fixed KV cache, or vLLM's memory profiling asserts when
    # one of them frees memory meanwhile (seen on vLLM 0.26.0)
    argv += [x for n in M.engine_kwargs().values() for x in ("--kv-cache-memory-bytes", str(n))]
    assert offline.main(argv) == 0
    cfg = json.loads((out / "data_config.json").read_text())
    assert cfg["hidden_states"]["layer_convention"] == "speculators"
    ref = reference(kimi, chats)
    slots = cfg["hidden_states"]["vllm_layer_ids"]
    for i, c in enumerate(chats):
        s = torch.load(out / f"data_{i}.pt", weights_only=True)
        assert s["input_ids"].tolist() == c["input_ids"] and s["loss_mask"].tolist() == c["loss_mask"]
        for slot, k in zip(s["hidden_states"], slots):
            assert M.rel_err(slot.float(), ref[i][:, k]) <= TOL, (i, k)
