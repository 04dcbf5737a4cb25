"""Which capture path the extractor picks, against this release's real model classes (CPU).

``runtime.capture_plan.plan`` resolves the architecture through vLLM's own ``ModelRegistry`` and
decides between vLLM's aux-hidden-state path (works with torch.compile / CUDA graphs) and
forward hooks (eager only). The table below is what the real wheels hold, each row with the
vLLM change behind it; the GPU tests (tests/gpu/test_extract_gpu.py) check the states
themselves.
"""

from __future__ import annotations

import warnings

import pytest
from packaging.version import Version

from vllm_compat.errors import UnsupportedFeatureError
from vllm_compat.runtime import capture_plan as X
from vllm_compat.target import TargetInfo

L = 4
# (architecture, final state L asked for) -> first release whose aux path serves it
AUX_SINCE = {
    # 0.11.2: the runner keeps execute_model_state, so the aux states outlive execute_model;
    # before, only hooks see them (drift map E.2). Llama's loop captured before layer idx,
    # so L was never reached until EagleModelMixin (0.18.1) added idx + 1 after each layer.
    ("LlamaForCausalLM", False): Version("0.11.2"),
    ("LlamaForCausalLM", True): Version("0.18.1"),
    # DeepseekV2ForCausalLM became SupportsEagle3 in 0.18.1; its end-layer capture (id L)
    # came with vllm#46973 in 0.25.0, before which the final-state tap hands L out.
    ("DeepseekV3ForCausalLM", False): Version("0.18.1"),
    ("DeepseekV3ForCausalLM", True): Version("0.18.1"),
    # Kimi-K2.5 delegates the aux path to its DeepseekV2ForCausalLM from 0.18.1 (vllm#36361);
    # the class exists from 0.15.0 (before it, the registry does not know the architecture).
    ("KimiK25ForConditionalGeneration", False): Version("0.18.1"),
    ("KimiK25ForConditionalGeneration", True): Version("0.18.1"),
}
TAP_UNTIL = Version("0.25.0")  # DeepSeek backbones: L through the tap before vLLM returns it
KIMI_SINCE = Version("0.15.0")
CONFIGS = {
    "LlamaForCausalLM": {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": L},
    "DeepseekV3ForCausalLM": {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": L,
                              "kv_lora_rank": 512},
    "KimiK25ForConditionalGeneration": {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"model_type": "kimi_k2", "num_hidden_layers": L, "kv_lora_rank": 512},
        "vision_config": {"hidden_size": 144}},
}


def _plan(tmp_path, arch, ids, eager):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = X.plan(TargetInfo(str(tmp_path), CONFIGS[arch]), ids, backend="auto",
                   enforce_eager=eager)
    return p, [str(x.message) for x in w]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("with_final", [False, True], ids=["aux-layers", "with-final-L"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_capture_path_per_release(tmp_path, vllm_version, arch, with_final, eager):
    ids = tuple(range(0, L + 1)) if with_final else tuple(range(0, L))
    if arch.startswith("Kimi") and vllm_version < KIMI_SINCE:
        with pytest.raises(UnsupportedFeatureError, match=(
                rf"vLLM {X.vllm.__version__} has no model class for \['{arch}'\] "
                r"\(added in vLLM 0\.15\.0\): .* cannot run on this release")):
            _plan(tmp_path, arch, ids, eager)
        return
    p, warned = _plan(tmp_path, arch, ids, eager)
    assert p.model_cls == arch  # the registry resolved the real class
    if vllm_version >= AUX_SINCE[(arch, with_final)]:
        tapped = with_final and arch != "LlamaForCausalLM" and vllm_version < TAP_UNTIL
        assert (p.mode, p.enforce_eager, p.tap_final, warned) == ("aux", eager, tapped, [])
        # id 0 is recomputed, not asked of vLLM; a tapped L is not asked of vLLM either
        assert p.native_ids == tuple(i for i in ids if i != 0 and not (tapped and i == L))
        assert ("tapped from the final norm" in p.note) == tapped
        return
    assert p.mode == "hooks" and p.enforce_eager is True and p.native_ids == ()
    # the note always says why auto chose hooks (it was empty for eager runs before)
    # only L is missing where the aux path serves the other layers; else every id is
    missing = [L] if with_final and vllm_version >= AUX_SINCE[(arch, False)] else list(ids)
    assert f"{arch}'s aux path on vLLM {X.vllm.__version__} cannot return {missing}" in p.note, p.note
    if eager:
        assert warned == [] and "forced" not in p.note
    else:  # compile was asked for and is overridden: a warning, and the note says so
        assert "enforce_eager=True is forced" in p.note and len(warned) == 1 and warned[0] == p.note
