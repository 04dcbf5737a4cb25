"""Kimi-K2.5 as it is deployed: ``KimiK25ForConditionalGeneration`` on the test checkpoint of
:mod:`vllm_compat.testing.kimi_k25` (bf16 and INT4 routed experts), extraction compiled and
eager, default MLA backend and ``TRITON_MLA``, against a transformers fp32 reference on the
same (dequantized) weights.

Layer ids: the EAGLE-3 default + L, and a set with id 1 and L. Prompts of 12 lengths, chunks
of 40 tokens (not a multiple of the 16-token KV block). Results go to
``VLLM_COMPAT_GPU_RESULTS`` like the other GPU tests.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from . import _models as M

pytestmark = pytest.mark.gpu

L = 8
EAGLE3 = (2, 4, 5, L)
ID1 = (1, L)
CHUNK = 40
# vLLM bf16 against HF fp32, per layer; INT4 experts run Marlin kernels on bf16 activations
TOL_HF = {"bf16": 0.05, "int4": 0.06}
TOL_SAME = 0.03  # compiled vs eager, Triton MLA vs the default backend (MoE routing near-ties)
_RUNS: dict[tuple, dict] = {}


def _vllm_version():
    import vllm
    from packaging.version import Version

    return Version(Version(vllm.__version__).base_version)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    from vllm_compat.testing.kimi_k25 import write_kimi_k25_checkpoint

    return {v: str(write_kimi_k25_checkpoint(tmp_path_factory.mktemp(f"kimi-{v}"), variant=v,
                                             seed=5)) for v in ("bf16", "int4")}


def prompts() -> list[list[int]]:
    """Chat-shaped: Kimi's named special tokens and reserved ids (163584-163839, where its chat
    markers live) every 16 tokens, ordinary ids between them."""
    from vllm_compat.testing.kimi_k25 import SPECIAL_TOKENS

    special = tuple(sorted(set(SPECIAL_TOKENS.values()) | {163_650, 163_700, 163_837}))
    return M.prompts(7, vocab=163_584, special_ids=special)


_REF: dict[str, torch.Tensor] = {}


def reference(kimi, variant: str) -> torch.Tensor:
    """HF fp32 states ``[tokens, L+1, hidden]`` (k = input of layer k, L = pre-norm)."""
    if variant not in _REF:
        from vllm_compat.testing.kimi_k25 import kimi_k25_text_model_for_reference

        model = kimi_k25_text_model_for_reference(kimi[variant]).cuda()
        ref = M.HFReference.from_model(model)
        _REF[variant] = torch.cat([ref.states(p) for p in prompts()])
        ref.close()
    return _REF[variant]


def run(kimi, variant: str, ids, *, compiled: bool, attention_backend: str | None = None,
        env: dict | None = None) -> dict:
    key = (variant, ids, compiled, attention_backend, tuple(sorted((env or {}).items())))
    if key in _RUNS:
        return _RUNS[key]
    from vllm_compat.extract import HiddenStatesExtractor

    kw = dict(M.engine_kwargs(), layer_ids=ids, max_model_len=M.MAX_LEN,
              max_num_batched_tokens=CHUNK, enforce_eager=not compiled,
              gpu_memory_utilization=0.05, dtype="bfloat16")
    if attention_backend:
        kw["attention_backend"] = attention_backend
    if _vllm_version().release < (0, 21):  # tokenizer + processor at engine start (remote code)
        kw["trust_remote_code"] = True
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        ex = HiddenStatesExtractor(kimi[variant], **kw)
        try:
            t1 = time.perf_counter()
            samples = list(ex.extract(prompts()))
            t2 = time.perf_counter()
            free, total = ex.kv_blocks()
            info = ex.info
        finally:
            ex.close()
    res = dict(samples=samples, info=info, kv=(free, total), startup_s=round(t1 - t0, 1),
               extract_s=round(t2 - t1, 2))
    _RUNS[key] = res
    return res


def _cat(samples) -> torch.Tensor:
    return torch.cat([s.hidden_states.float() for s in samples])


def _check(kimi, variant: str, r: dict, ids) -> dict:
    assert [s.index for s in r["samples"]] == list(range(len(M.LENGTHS)))
    assert [len(s.token_ids) for s in r["samples"]] == M.LENGTHS
    free, total = r["kv"]
    assert free == total - 1, r["kv"]  # every KV block back (the null block is never free)
    ours, ref = _cat(r["samples"]), reference(kimi, variant)
    per_layer = {k: M.compare(ours[:, j], ref[:, k]) for j, k in enumerate(ids)}
    for k, c in per_layer.items():
        assert c["rel"] <= TOL_HF[variant], (variant, k, c)
    return per_layer


@pytest.mark.parametrize("variant", ["bf16", "int4"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_kimi_extraction_equals_the_reference(kimi, variant, compiled):
    r = run(kimi, variant, EAGLE3, compiled=compiled)
    info = r["info"]
    assert info["model"] == "KimiK25ForConditionalGeneration", info
    # compiled capture on Kimi: vLLM's aux path, L from vLLM (0.25.0+) or the final-state tap
    assert (info["mode"], info["enforce_eager"]) == ("aux", not compiled), info
    assert info["tap_final"] == (_vllm_version().release < (0, 25)), info
    per_layer = _check(kimi, variant, r, EAGLE3)
    M.record(f"kimi:{variant}:{'compiled' if compiled else 'eager'}", per_layer=per_layer,
             tol=TOL_HF[variant], info=info, startup_s=r["startup_s"], extract_s=r["extract_s"])


@pytest.mark.parametrize("variant", ["bf16", "int4"])
def test_kimi_compiled_equals_eager(kimi, variant):
    c, e = (run(kimi, variant, EAGLE3, compiled=x) for x in (True, False))
    rel = M.rel_err(_cat(c["samples"]), _cat(e["samples"]))
    M.record(f"kimi:{variant}:compiled_vs_eager", rel=rel)
    assert rel <= TOL_SAME


def test_kimi_layer_one_and_final(kimi):
    r = run(kimi, "bf16", ID1, compiled=True)
    assert r["info"]["mode"] == "aux" and r["info"]["enforce_eager"] is False, r["info"]
    per_layer = _check(kimi, "bf16", r, ID1)
    M.record("kimi:bf16:ids_1_L", per_layer=per_layer, info=r["info"])


@pytest.mark.parametrize("variant", ["bf16", "int4"])
def test_kimi_triton_mla_backend(kimi, variant):
    """What deployments on GPUs without FlashMLA (RTX PRO 6000, sm_120) run."""
    r = run(kimi, variant, EAGLE3, compiled=True, attention_backend="TRITON_MLA")
    per_layer = _check(kimi, variant, r, EAGLE3)
    default = run(kimi, variant, EAGLE3, compiled=True)
    rel = M.rel_err(_cat(r["samples"]), _cat(default["samples"]))
    M.record(f"kimi:{variant}:triton_mla", per_layer=per_layer, rel_vs_default=rel,
             info=r["info"])
    assert rel <= TOL_SAME


def test_final_state_tap_equals_vllms_own_final_state(kimi):
    """Where vLLM returns L itself (0.25.0+), the tap must hand out the same tensor."""
    if _vllm_version().release < (0, 25):
        pytest.skip("vLLM returns L itself from 0.25.0; before, the tap is the only route")
    own = run(kimi, "bf16", EAGLE3, compiled=True)
    tap = run(kimi, "bf16", EAGLE3, compiled=True, env={"VLLM_COMPAT_FINAL_STATE_TAP": "1"})
    assert tap["info"]["tap_final"] and not own["info"]["tap_final"]
    a, b = _cat(own["samples"])[:, -1], _cat(tap["samples"])[:, -1]
    M.record("kimi:tap_vs_vllm_final", max_abs=float((a - b).abs().max()),
             equal=bool(torch.equal(a, b)))
    assert torch.equal(a, b)


def test_kimi_starts_the_full_multimodal_way(kimi):
    """With its tokenizer and image processor (remote code), not text-only: a chat prompt
    rendered by the checkpoint's own template goes through ``LLM.generate``."""
    from transformers import AutoTokenizer

    from vllm_compat.runtime import llm as serve

    tok = AutoTokenizer.from_pretrained(kimi["bf16"], trust_remote_code=True)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello, 世界"}], tokenize=False,
                                   add_generation_prompt=True)
    llm = serve.open_llm(kimi["bf16"], trust_remote_code=True, enforce_eager=True,
                         max_model_len=M.MAX_LEN, gpu_memory_utilization=0.05,
                         **M.engine_kwargs())
    try:
        from vllm import SamplingParams

        out = llm.generate([text], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        mm = llm.llm_engine.model_config.multimodal_config
        assert mm is not None and not getattr(mm, "language_model_only", False)
    finally:
        serve.close_llm(llm)
    M.record("kimi:multimodal_start", prompt=text, tokens=list(out[0].outputs[0].token_ids))


# --------------------------------------------------------------------------- the real model

KIMI = os.environ.get("VLLM_COMPAT_KIMI_K25_PATH")
KIMI_DRAFT = os.environ.get("VLLM_COMPAT_KIMI_K25_DRAFT")  # a public EAGLE-3 draft, optional


@pytest.mark.skipif(not KIMI, reason="set VLLM_COMPAT_KIMI_K25_PATH to a Kimi-K2.5 checkpoint")
@pytest.mark.skipif(torch.cuda.device_count() < 8, reason="Kimi-K2.5 needs >= 8 GPUs (TP=8)")
def test_real_kimi_k25_tp8():
    """What the tiny lane checks, on the real checkpoint at TP=8: the EAGLE-3 ids + L
    (2, 30, 58, 61), compiled, in input order, finite, every KV block back; and, given
    ``VLLM_COMPAT_KIMI_K25_DRAFT``, what the installed vLLM makes of a public draft."""
    from vllm_compat.extract import HiddenStatesExtractor
    from vllm_compat.target import read_target

    target = read_target(KIMI)
    L = target.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    lengths = [17, 900, 3, 256, 1500, 64, 33, 700, 5, 128, 2048]
    ps = [torch.randint(100, 163_000, (n,), generator=g).tolist() for n in lengths]
    t0 = time.perf_counter()
    with HiddenStatesExtractor(target, tensor_parallel_size=8, max_model_len=4096,
                               max_num_batched_tokens=1024, gpu_memory_utilization=0.85,
                               trust_remote_code=True) as ex:
        out = list(ex.extract(ps))
        free, total = ex.kv_blocks()
        info = ex.info
    M.record("kimi_k25:tp8", info=info, wall_s=round(time.perf_counter() - t0, 1))
    assert (info["mode"], info["enforce_eager"]) == ("aux", False), info
    assert free == total - 1
    assert [s.index for s in out] == list(range(len(ps)))
    for s, p in zip(out, ps):
        assert s.layer_ids == (2, L // 2, L - 3, L)
        assert s.hidden_states.shape == (len(p), 4, target.hidden_size)
        assert torch.isfinite(s.hidden_states.float()).all()
    if KIMI_DRAFT:
        from vllm_compat.eagle3 import validate

        rep = validate(KIMI_DRAFT, KIMI, raise_on_error=False)
        M.record("kimi_k25:draft", ok=rep.ok, problems=[p.code for p in rep.problems],
                 serving=vars(rep.serving) if rep.serving else None)
        assert rep.ok, [p.message for p in rep.errors]
