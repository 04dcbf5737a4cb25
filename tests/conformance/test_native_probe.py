"""backend="native" is decided per release by running vLLM's own KV-cache grouping (and its
connector's group lookup) on the target's layer specs, not by the target's architecture."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_compat.target import read_target


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from vllm_compat.testing.models import model_config

    out = {}
    for name, shape, arch in (("llama", "llama-tiny", "LlamaForCausalLM"),
                              ("deepseek_v3", "deepseek_v3", "DeepseekV3ForCausalLM")):
        d = tmp_path_factory.mktemp(name)
        cfg = model_config(shape)
        cfg.architectures = [arch]
        cfg.save_pretrained(str(d))
        out[name] = read_target(str(d))
    return out


def _has_connector(info) -> bool:
    return bool(info.probes.get("native_extract_hidden_states"))


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_the_check_runs_and_the_plan_follows_it(configs, name, info):
    from vllm_compat.runtime import capture_plan
    from vllm_compat.runtime.native_probe import native_path_check

    t = configs[name]
    ids = (1, 2, 3)
    check = native_path_check(t, ids)
    if not _has_connector(info):
        assert check.ok is None  # nothing to check before 0.17.1
        with pytest.raises(ValueError, match="needs vLLM 0.17.1"):
            capture_plan.plan(t, ids, backend="native", enforce_eager=True)
        return
    assert check.ok is not None, check.reason  # vLLM's own pieces ran on this release
    if check.ok:
        p = capture_plan.plan(t, ids, backend="native", enforce_eager=True)
        assert p.mode == "native" and p.native_ids == ids
    else:
        with pytest.raises(ValueError, match="backend='native' is refused"):
            capture_plan.plan(t, ids, backend="native", enforce_eager=True)
    if name == "llama":  # the path vLLM built the connector for
        assert check.ok is True, check.reason


def test_the_check_sees_a_mis_grouped_hidden_state_layer(configs, info, monkeypatch):
    """Give the hidden-state layer the MLA layers' own spec with its K x H shape: vLLM's real
    grouping then merges it into the model's one MLA group under the 1 x 576 spec
    (``MLAAttentionSpec.merge`` keeps the first layer's head shape), and the check must
    say the states would come back mis-shaped."""
    if not _has_connector(info):
        pytest.skip("no extract_hidden_states connector before vLLM 0.17.1")
    from vllm_compat.runtime import native_probe

    real = native_probe._layer_specs

    def same_kind(target, num_ids, cfg, tp):
        specs, hidden = real(target, num_ids, cfg, tp)
        mla = specs["model.layers.0.self_attn.attn"]
        hidden = dataclasses.replace(mla, num_kv_heads=hidden.num_kv_heads,
                                     head_size=hidden.head_size)
        try:  # vLLM's own merge: does this release ignore the head shape?
            type(mla).merge([mla, hidden])
        except AssertionError:
            pytest.skip("this release's MLAAttentionSpec.merge refuses different head shapes: "
                        "the mis-grouping cannot happen here")
        specs[native_probe._HIDDEN_LAYER] = hidden
        return specs, hidden

    monkeypatch.setattr(native_probe, "_layer_specs", same_kind)
    check = native_probe.native_path_check(configs["deepseek_v3"], (1, 2, 3))
    assert check.ok is False and "mis-shaped" in check.reason, (check, check.groups)
