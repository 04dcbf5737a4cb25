"""The Kimi-K2.5 test checkpoint as the installed vLLM reads it at engine start (CPU).

vLLM builds Kimi-K2.5's multimodal processing when the engine starts, text-only runs
included: it loads the config, the tokenizer and the image processor, and profiles the
vision tower with dummy media. These tests take each of those steps with vLLM's own
functions on the checkpoint ``vllm_compat.testing.kimi_k25`` writes.
"""

from __future__ import annotations

import importlib
import importlib.util
import json

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec(
        "vllm.model_executor.models.kimi_k25") is None:
    pytest.skip("this vLLM has no Kimi-K2.5 model (added in 0.15.0)", allow_module_level=True)
pytest.importorskip("tiktoken")

import torch

from vllm_compat.testing.kimi_k25 import (
    KimiK25Shape,
    int4,
    kimi_k25_config,
    write_kimi_k25_checkpoint,
)

from . import reference

MEDIA_PAD = 163605


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_kimi_k25_checkpoint(tmp_path_factory.mktemp("kimi-int4"), variant="int4")


@pytest.fixture(scope="module")
def model_config(ckpt):
    ModelConfig = reference.attr("vllm.config", "ModelConfig")

    return ModelConfig(model=str(ckpt), tokenizer=str(ckpt), trust_remote_code=True,
                       dtype="bfloat16", max_model_len=32768, enforce_eager=True, seed=0)


def _image(w, h, seed=0):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def test_vllm_reads_the_scaled_towers_and_sizes(ckpt):
    get_config = reference.attr("vllm.transformers_utils.config", "get_config")

    cfg = get_config(str(ckpt), trust_remote_code=False)
    assert cfg.model_type == "kimi_k25"
    v, t = cfg.vision_config, cfg.text_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size) == (144, 2, 2, 288)
    # 0.33 reads transformers' Kimi_K25Config, which renames the text model type deepseek_v3
    assert t.model_type in ("kimi_k2", "deepseek_v3")
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.n_routed_experts,
            t.num_experts_per_tok, t.kv_lora_rank, t.qk_rope_head_dim, t.vocab_size) == (
        256, 8, 8, 8, 2, 512, 64, 163840)
    assert t.quantization_config["quant_method"] == "compressed-tensors"
    if type(cfg).__name__ == "KimiK25Config":
        # vLLM's own config class (0.15-0.32) copies the quantization config up and widens
        # the projector output to the text width when it equals the tower width
        assert cfg.quantization_config["format"] == "pack-quantized"
        assert v.mm_hidden_size == 256


def test_vision_sizes_only_under_vt_names_give_the_full_tower(ckpt, tmp_path):
    """Why the checkpoint spells the tower sizes twice: vLLM ignores the real config's vt_* keys."""
    get_config = reference.attr("vllm.transformers_utils.config", "get_config")

    cfg = json.loads((ckpt / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        del cfg["vision_config"][key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    v = get_config(str(tmp_path), trust_remote_code=False).vision_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size) == (
        1152, 27, 16, 4304)


def test_engine_config_and_tokenizer_load_as_at_engine_start(model_config):
    cached_tokenizer_from_config = reference.attr("vllm.tokenizers", "cached_tokenizer_from_config")

    assert model_config.hf_config.model_type == "kimi_k25"
    assert model_config.quantization == "compressed-tensors"
    assert model_config.is_multimodal_model
    tok = cached_tokenizer_from_config(model_config)
    assert "TikTokenTokenizer" in type(tok).__name__  # vLLM's cached wrapper of our remote class
    assert len(tok) == 163840 and tok.max_token_id >= 163839
    # what Kimi-K2.5's processing info resolves when it starts
    assert tok.convert_tokens_to_ids("<|media_pad|>") == MEDIA_PAD and tok.decode(MEDIA_PAD) == "<|media_pad|>"
    text = "<|im_user|>user<|im_middle|>Hello 世界 🙂<|im_end|><|im_assistant|>assistant<|im_middle|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 163587 and tok.decode(ids) == text


def test_tokenizer_without_trust_remote_code_is_refused_or_not_ours(ckpt):
    get_tokenizer = reference.attr("vllm.tokenizers", "get_tokenizer")
    get_config = reference.attr("vllm.transformers_utils.config", "get_config")

    if type(get_config(str(ckpt), trust_remote_code=False)).__module__.startswith("vllm."):
        # vLLM registers its own KimiK25Config (0.15-0.32), which transformers cannot map to a
        # tokenizer class: only the checkpoint's code is left, and it needs the flag
        with pytest.raises(Exception, match="trust_remote_code"):  # vLLM's error, whichever
            get_tokenizer(str(ckpt), trust_remote_code=False)
    else:
        # 0.33 reads transformers' Kimi_K25Config; transformers then converts tiktoken.model
        # into its generic fast tokenizer (as for the real checkpoint), never our class
        tok = get_tokenizer(str(ckpt), trust_remote_code=False)
        assert "TikTokenTokenizer" not in type(tok).__name__ and tok.is_fast


def _skip_without_image_processor_backend():
    """transformers 5.17's AutoImageProcessor is a placeholder without torchvision, which the
    CPU test envs leave out (vLLM's own install brings it); 5.19 dropped the requirement."""
    from transformers import AutoImageProcessor

    try:
        AutoImageProcessor.from_pretrained  # noqa: B018 -- the placeholder raises on access
    except ImportError:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} loads no image processor without torchvision")


def _dummy_mm_inputs(model_config, processor):
    MULTIMODAL_REGISTRY = reference.attr("vllm.multimodal", "MULTIMODAL_REGISTRY")

    if hasattr(processor, "get_dummy_mm_inputs"):  # 0.33 moved it from the registry to the processor
        return processor.get_dummy_mm_inputs({"vision_chunk": 1})
    return MULTIMODAL_REGISTRY.get_dummy_mm_inputs(model_config, {"vision_chunk": 1}, processor=processor)


@pytest.mark.parametrize("numba", [True, False], ids=["as-installed", "without-numba"])
def test_engine_start_profiles_the_vision_tower_with_our_files(model_config, monkeypatch, numba):
    MULTIMODAL_REGISTRY = reference.attr("vllm.multimodal", "MULTIMODAL_REGISTRY")

    kimi = reference.module("vllm.model_executor.models.kimi_k25")
    if not numba:
        if not hasattr(kimi, "is_numba_available"):
            pytest.skip("this vLLM always loads the checkpoint's image processor (no fused one before 0.26)")
        # 0.26+ uses its own fused processor when numba imports, ours otherwise
        monkeypatch.setattr(kimi, "is_numba_available", lambda: False)
        _skip_without_image_processor_backend()
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    info = processor.info
    if not numba or not hasattr(kimi, "is_numba_available"):
        # 0.15-0.16 call it media_processor
        image_processor = getattr(info, "image_processor", None) or info.media_processor
        assert type(image_processor).__name__ == "KimiK25VisionProcessor"
    assert info.media_token_id == MEDIA_PAD
    mm = _dummy_mm_inputs(model_config, processor)
    # vLLM's dummy item: a 3000 x 3000 image (4225 tokens) beats a 4-frame chunk of them (1089)
    (placeholder,) = mm["mm_placeholders"]["vision_chunk"]
    assert placeholder.length == 4225


def test_an_image_prompt_through_vllms_kimi_processor(model_config):
    MULTIMODAL_REGISTRY = reference.attr("vllm.multimodal", "MULTIMODAL_REGISTRY")

    info = MULTIMODAL_REGISTRY.create_processor(model_config).info
    hf = info.get_hf_processor()
    prompt = ("<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|>"
              "<|media_end|>What is this?<|im_end|><|im_assistant|>assistant<|im_middle|>")
    image = {"type": "image", "image": _image(300, 200), "uuid": None}
    expands = not _kimi_processor_takes_token_ids()
    text = prompt if expands else hf.tokenizer.encode(prompt)
    out = hf(text=text, vision_chunks=[dict(image)], return_tensors="pt")
    t, gh, gw = out["grid_thws"][0].tolist()
    assert (t, gh, gw) == (1, 16, 22) and out["pixel_values"].shape == (t * gh * gw, 3, 14, 14)
    assert info.media_tokens_calculator(dict(image)) == 8 * 11
    assert int((out["input_ids"] == MEDIA_PAD).sum()) == (8 * 11 if expands else 1)


def _kimi_processor_takes_token_ids():
    """vLLM 0.15's MoonshotKimiVAutoProcessor takes token ids only and leaves ``<|media_pad|>``
    to the prompt updates; 0.16 (models/kimi_k25.py) tokenizes text and expands it itself."""
    from packaging.version import Version
    return Version(Version(reference.vllm_version()).base_version) < Version("0.16")


def test_a_chat_with_an_image_renders_one_media_placeholder(model_config):
    from PIL import Image
    _detect_content_format = reference.attr("vllm.renderers.hf", "_detect_content_format")
    cached_tokenizer_from_config = reference.attr("vllm.tokenizers", "cached_tokenizer_from_config")

    # 0.32 moved chat_utils under renderers (0.33 made it a package, same export)
    chat_utils = ("vllm.entrypoints.chat_utils" if reference.has_module("vllm.entrypoints.chat_utils")
                  else "vllm.renderers.chat_utils")
    parse_chat_messages = reference.attr(chat_utils, "parse_chat_messages")
    tok = cached_tokenizer_from_config(model_config)
    fmt = _detect_content_format(tok.chat_template, default="string")
    assert fmt == "openai"  # the template walks the content parts
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": Image.new("RGB", (64, 48))},
                                         {"type": "text", "text": "What?"}]}]
    conversation, mm_data, _ = parse_chat_messages(msgs, model_config, fmt)
    assert tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == (
        "<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
        "What?<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    assert len(mm_data["vision_chunk"]) == 1  # use_unified_vision_chunk: images become chunks


def test_our_image_processor_matches_vllms_fused_one(ckpt):
    cached_get_image_processor = reference.attr("vllm.transformers_utils.processor", "cached_get_image_processor")

    fused_mod = pytest.importorskip("vllm.transformers_utils.processors.kimi_k25_vision_fused",
                                    reason="no fused Kimi processor before vLLM 0.26")
    pytest.importorskip("numba")
    _skip_without_image_processor_backend()
    ours = cached_get_image_processor(str(ckpt), trust_remote_code=True)
    assert type(ours).__name__ == "KimiK25VisionProcessor"
    fused = fused_mod.KimiK25FusedVisionProcessor.from_pretrained(str(ckpt))
    items = [{"type": "image", "image": _image(w, h, i)} for i, (w, h) in
             enumerate([(28, 28), (100, 50), (333, 777), (2000, 90), (2500, 2500), (3000, 3000)])]
    for w, h in [(640, 480), (1700, 1100)]:  # the second is scaled down, to 1119 x 724
        items.append({"type": "video_chunk", "video_chunk": [_image(w, h, s) for s in range(4)]})
    for item in items:
        assert ours.media_tokens_calculator(dict(item)) == fused.media_tokens_calculator(dict(item))
    a = ours.preprocess([dict(x) for x in items], return_tensors="pt")
    b = fused.preprocess([dict(x) for x in items], return_tensors="pt")
    assert torch.equal(a["grid_thws"], b["grid_thws"])
    assert torch.allclose(a["pixel_values"], b["pixel_values"], atol=1e-6, rtol=0)


def test_int4_packing_is_compressed_tensors_own():
    for name in ("compressed_tensors.compressors.pack_quantized.helpers",  # 0.14+
                 "compressed_tensors.compressors.quantized_compressors.pack_quantized"):
        try:
            ct = importlib.import_module(name)
            break
        except ImportError:
            continue
    else:
        pytest.fail("compressed-tensors has no pack_to_int32 where we know to look")
    q = torch.randint(-8, 8, (48, 96), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(int4.pack(q), ct.pack_to_int32(q, 4))
    assert torch.equal(ct.unpack_from_int32(int4.pack(q), 4, torch.Size([48, 96])), q)


def test_vllm_quantizes_only_the_routed_experts():
    CompressedTensorsConfig = reference.attr(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
        "CompressedTensorsConfig")
    should_ignore_layer = reference.attr(
        "vllm.model_executor.layers.quantization.compressed_tensors.utils", "should_ignore_layer")

    qc = kimi_k25_config(KimiK25Shape(), int4=True)["text_config"]["quantization_config"]
    cfg = CompressedTensorsConfig.from_config(json.loads(json.dumps(qc)))
    weights = cfg.target_scheme_map["Linear"]["weights"]
    assert (weights.num_bits, weights.group_size, weights.symmetric) == (4, 32, True)
    p = "language_model.model.layers."
    for name, ignored in [(p + "3.mlp.experts.0.gate_proj", False), (p + "3.mlp.experts.7.down_proj", False),
                          (p + "3.self_attn.q_a_proj", True), (p + "3.self_attn.kv_b_proj", True),
                          (p + "3.mlp.shared_experts.up_proj", True), (p + "0.mlp.gate_up_proj", True),
                          (p + "0.mlp.down_proj", True)]:
        assert should_ignore_layer(name, ignore=cfg.ignore, fused_mapping={}) == ignored, name


def test_yarn_frequencies_of_vllm_and_the_transformers_reference_agree(monkeypatch):
    """The reference runs transformers' YaRN; vLLM has its own: same inverse frequencies."""
    import types

    rope = pytest.importorskip("vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from vllm_compat.testing.kimi_k25 import hf_text_config

    text = kimi_k25_config()["text_config"]
    rs = text["rope_scaling"]
    # the attributes _compute_inv_freq reads; building the layer itself needs a vLLM config
    fields = types.SimpleNamespace(
        base=text["rope_theta"], rotary_dim=text["qk_rope_head_dim"], beta_fast=rs["beta_fast"],
        beta_slow=rs["beta_slow"], max_position_embeddings=rs["original_max_position_embeddings"],
        extrapolation_factor=1)
    if getattr(getattr(rope, "current_platform", None), "device_type", None) == "":
        # vLLM <= 0.15 builds the frequencies on current_platform.device_type, which is empty
        # where no platform is detected (a CPU-only install); 0.16 builds them on the CPU
        monkeypatch.setattr(rope, "current_platform", types.SimpleNamespace(device_type="cpu"))
    ours = rope.DeepseekScalingRotaryEmbedding._compute_inv_freq(fields, rs["factor"])
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_text_config(text), "cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0) and attention_factor == 1.0
