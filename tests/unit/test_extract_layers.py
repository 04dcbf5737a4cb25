"""Layer-index convention and converters (no vLLM, no torch)."""

import json

import pytest

from vllm_compat.extract import layers as lay


def test_eagle3_default_plus_final():
    assert lay.eagle3_default_layers(32) == (2, 16, 29, 32)
    assert lay.eagle3_default_layers(61) == (2, 30, 58, 61)  # Kimi-K2.5 / DeepSeek-V3
    assert lay.eagle3_default_layers(32, include_final=False) == (2, 16, 29)


def test_eagle3_default_drops_collisions_for_tiny_models():
    assert lay.eagle3_default_layers(4) == (2, 1, 4)
    assert lay.eagle3_default_layers(5) == (2, 5)
    with pytest.raises(ValueError, match="num_layers >= 3, got 2"):
        lay.eagle3_default_layers(2)


@pytest.mark.parametrize("bad, msg", [
    ([1, -1], "layer id -1 is negative"),
    ([0, 5], "layer id 5 is above num_hidden_layers=4"),
    ([2, 3, 2], "layer id 2 is requested more than once"),
    ([1.5], "must be an integer, got 1.5"),
    ([True], "must be an integer, got True"),
    ([], "no layer ids requested"),
])
def test_validate_rejects_with_the_offending_value(bad, msg):
    with pytest.raises(ValueError, match=msg):
        lay.validate_layer_ids(bad, 4)


def test_validate_keeps_order_and_bounds_inclusive():
    assert lay.validate_layer_ids([4, 0, 2], 4) == (4, 0, 2)


def test_resolve_default_and_string():
    assert lay.resolve_layer_ids(None, 32) == (2, 16, 29, 32)
    with pytest.raises(ValueError):
        lay.resolve_layer_ids("123", 32)


def test_from_hf_indices_below_L_is_identity():
    assert lay.from_hf_indices([0, 3, 7], 8) == (0, 3, 7)
    assert lay.from_hf_indices([-2], 8) == (7,)  # 9 entries: -2 -> 7


def test_from_hf_index_L_is_post_norm_and_refused_when_tied():
    with pytest.raises(ValueError, match="AFTER the final norm"):
        lay.from_hf_indices([8], 8)
    with pytest.raises(ValueError, match="AFTER the final norm"):
        lay.from_hf_indices([-1], 8)
    assert lay.from_hf_indices([8], 8, tied_last=False) == (8,)
    with pytest.raises(ValueError, match="index 9 is out of range"):
        lay.from_hf_indices([9], 8)
    with pytest.raises(ValueError, match="index -10 is out of range"):
        lay.from_hf_indices([-10], 8)


def test_speculators_ids_are_layer_outputs_shifted_by_one():
    # speculators 0.3/0.4 default [2, L//2, L-3, L-1] for L=32
    assert lay.from_speculators_indices([2, 16, 29, 31], 32) == (3, 17, 30, 32)
    assert lay.to_speculators_indices((3, 17, 30, 32), 32) == (2, 16, 29, 31)
    with pytest.raises(ValueError, match="speculators layer id 32 is out of range"):
        lay.from_speculators_indices([32], 32)
    with pytest.raises(ValueError, match="layer id 0"):
        lay.to_speculators_indices([0], 32)


def test_config_readers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["KimiK25ForConditionalGeneration"],
         "text_config": {"num_hidden_layers": 61, "hidden_size": 7168}}))
    cfg = lay.read_model_config(tmp_path)
    assert lay.num_layers_from_config(cfg) == 61
    assert lay.hidden_size_from_config(cfg) == 7168
    assert lay.num_layers_from_config({"num_hidden_layers": 4, "text_config": {
        "num_hidden_layers": 9}}) == 4
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        lay.num_layers_from_config({"hidden_size": 3})
    with pytest.raises(FileNotFoundError):
        lay.read_model_config(tmp_path / "nope")


def test_layers_module_imports_neither_vllm_nor_torch():
    import ast
    import pathlib
    for name in ("layers.py", "ordering.py", "__init__.py"):
        src = pathlib.Path(lay.__file__).with_name(name).read_text()
        top = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                top |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top.add(node.module.split(".")[0])
        assert "vllm" not in top, name
        if name == "layers.py":
            assert "torch" not in top
