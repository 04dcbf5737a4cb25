"""The Kimi-K2.5 test checkpoint: config, tensors, INT4 packing, tokenizer, image processor,
and the transformers reference. No vLLM here (tests/conformance checks it against vLLM)."""

from __future__ import annotations

import base64
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tiktoken")
pytest.importorskip("safetensors")

from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoTokenizer

from vllm_compat.testing.kimi_k25 import (
    KimiK25Shape,
    hf_text_config,
    int4,
    kimi_k25_config,
    kimi_k25_text_model_for_reference,
    tokenizer,
    weights,
    write_kimi_k25_checkpoint,
)

# The keys of Kimi-K2.5's config.json (moonshotai/Kimi-K2.5), by level.
REAL_TOP_KEYS = {
    "architectures", "auto_map", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "ignore_index", "media_placeholder_token_id", "use_unified_vision_chunk", "video_placeholder",
    "tie_word_embeddings", "torch_dtype", "text_config", "vision_config"}
REAL_TEXT_KEYS = {
    "architectures", "auto_map", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_nextn_predict_layers", "num_attention_heads", "num_key_value_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
    "first_k_dense_replace", "moe_layer_freq", "topk_method", "scoring_func", "n_group",
    "topk_group", "norm_topk_prob", "routed_scaling_factor", "aux_loss_alpha", "seq_aux", "ep_size",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
    "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "initializer_range", "pretraining_tp", "use_cache", "torch_dtype",
    "quantization_config"}
REAL_VISION_KEYS = {
    "vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads", "vt_intermediate_size",
    "patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "pos_emb_type",
    "merge_kernel_size", "merge_type", "video_attn_type", "mm_projector_type", "mm_hidden_size",
    "projector_hidden_act", "projector_ln_eps", "text_hidden_size"}
# What vLLM reads (its KimiK25VisionConfig ignores the vt_* spellings).
PLAIN_VISION_KEYS = {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"}
# Values the test model keeps from the real one.
REAL_TEXT_VALUES = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
    "num_nextn_predict_layers": 0, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839}
REAL_TOP_VALUES = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839, "ignore_index": -100,
    "media_placeholder_token_id": 163605, "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>", "tie_word_embeddings": False}
REAL_VISION_VALUES = {
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "video_attn_type": "spatial_temporal", "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5}
REAL_QUANTIZATION_CONFIG = json.loads(r"""
{"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
 "kv_cache_scheme": null,
 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null, "output_activations": null,
   "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32,
               "dynamic": false, "actorder": null, "block_structure": null, "observer": "minmax", "observer_kwargs": {}}}},
 "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}
""")
# Kimi-K2.5's named special tokens (tokenizer_config.json); the rest of 163584-163839 is reserved.
REAL_SPECIAL_IDS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
    "<|im_assistant|>": 163588, "<|start_header_id|>": 163590, "<|end_header_id|>": 163591,
    "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
    "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
    "<|media_pad|>": 163605, "<think>": 163606, "</think>": 163607, "[UNK]": 163838, "[PAD]": 163839}


@pytest.fixture(scope="module")
def ckpt_bf16(tmp_path_factory):
    return write_kimi_k25_checkpoint(tmp_path_factory.mktemp("kimi-bf16"), variant="bf16")


@pytest.fixture(scope="module")
def ckpt_int4(tmp_path_factory):
    return write_kimi_k25_checkpoint(tmp_path_factory.mktemp("kimi-int4"), variant="int4", seed=1)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi-tok")
    tokenizer.write_tokenizer(d)
    return d


# --------------------------------------------------------------------------- config


def test_config_has_exactly_the_real_keys_at_every_level(ckpt_int4):
    cfg = json.loads((ckpt_int4 / "config.json").read_text())
    assert set(cfg) == REAL_TOP_KEYS
    assert set(cfg["text_config"]) == REAL_TEXT_KEYS
    assert set(cfg["vision_config"]) == REAL_VISION_KEYS | PLAIN_VISION_KEYS
    assert cfg["text_config"]["quantization_config"] == REAL_QUANTIZATION_CONFIG


def test_config_keeps_the_real_values_and_scales_the_sizes(ckpt_bf16):
    cfg = json.loads((ckpt_bf16 / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert {k: cfg[k] for k in REAL_TOP_VALUES} == REAL_TOP_VALUES
    assert {k: text[k] for k in REAL_TEXT_VALUES} == REAL_TEXT_VALUES
    assert {k: vision[k] for k in REAL_VISION_VALUES} == REAL_VISION_VALUES
    assert "quantization_config" not in text  # the bf16 variant declares none
    s = KimiK25Shape()
    assert (text["num_hidden_layers"], text["hidden_size"], text["num_attention_heads"],
            text["num_key_value_heads"], text["q_lora_rank"], text["n_routed_experts"],
            text["num_experts_per_tok"], text["moe_intermediate_size"]) == (8, 256, 8, 8, 128, 8, 2, 256)
    for key in PLAIN_VISION_KEYS:  # both spellings, same sizes
        assert vision[key] == vision["vt_" + key] == getattr(s, {
            "hidden_size": "vision_hidden_size", "num_hidden_layers": "vision_num_layers",
            "num_attention_heads": "vision_num_heads",
            "intermediate_size": "vision_intermediate_size"}[key])
    # equal to the tower width, as in the real config (1152), so vLLM widens it to the text width
    assert vision["mm_hidden_size"] == vision["hidden_size"] == 144
    assert vision["text_hidden_size"] == text["hidden_size"]
    gen = json.loads((ckpt_bf16 / "generation_config.json").read_text())
    assert gen["eos_token_id"] == REAL_SPECIAL_IDS["<|im_end|>"]


def test_shape_rejects_sizes_vllm_cannot_build():
    with pytest.raises(ValueError, match="MoE layer"):
        KimiK25Shape(num_layers=1, first_k_dense_replace=1)
    with pytest.raises(ValueError, match="multiple of 4"):
        KimiK25Shape(vision_hidden_size=144, vision_num_heads=8)  # head dim 18
    KimiK25Shape(vision_hidden_size=144, vision_num_heads=3)  # head dim 48


# --------------------------------------------------------------------------- tensors and INT4


def test_int4_packs_eight_offset_nibbles_lowest_index_first():
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [-8] * 8, [7] * 8, [-1, 0, 0, 0, 0, 0, 0, -8]],
                     dtype=torch.int8)
    packed = int4.pack(q)
    assert packed.dtype == torch.int32
    # nibbles 8,9,...,15 from the low end: 0xFEDCBA98; all -8 -> 0; all 7 -> 0xFFFFFFFF; 7 | 0 << 28
    assert packed[:, 0].tolist() == [0xFEDCBA98 - 2**32, 0, -1, 0x08888887]
    assert torch.equal(int4.unpack(packed), q)


def test_int4_round_trip_is_exact_and_dequantizes_to_q_times_scale():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (64, 256), generator=g, dtype=torch.int8)
    assert torch.equal(int4.unpack(int4.pack(q)), q)
    w = torch.randn(64, 256, generator=g) * 0.02
    stored = int4.compress(w, 32)
    assert stored["weight_packed"].shape == (64, 32) and stored["weight_packed"].dtype == torch.int32
    assert stored["weight_scale"].shape == (64, 8) and stored["weight_scale"].dtype == torch.bfloat16
    assert stored["weight_shape"].tolist() == [64, 256] and stored["weight_shape"].dtype == torch.int32
    qq, scale = int4.quantize(w, 32)
    deq = int4.decompress(stored)
    assert torch.equal(deq, (qq.float().reshape(64, 8, 32) * scale.float()[..., None]).reshape(64, 256))
    step = scale.float().repeat_interleave(32, dim=1)
    # round to nearest: half a step, a little more at the clamped top (the bf16 scale rounds)
    assert ((deq - w).abs() <= step * 0.55).all()


def test_checkpoint_tensors_have_the_real_names_dtypes_and_packing(ckpt_int4):
    tensors = load_file(str(ckpt_int4 / "model.safetensors"))
    s = KimiK25Shape()
    want = set()
    for name in weights.text_shapes(s):
        if weights._EXPERT.match(name):
            base = "language_model." + name[: -len("weight")]
            want |= {base + "weight_packed", base + "weight_scale", base + "weight_shape"}
        else:
            want.add("language_model." + name)
    assert set(tensors) == want | set(weights.vision_shapes(s))
    p = "language_model.model.layers.3.mlp."
    assert tensors[p + "experts.5.down_proj.weight_packed"].shape == (256, 32)
    assert tensors[p + "experts.5.down_proj.weight_scale"].shape == (256, 8)
    assert tensors[p + "experts.5.up_proj.weight_shape"].tolist() == [256, 256]
    assert tensors[p + "gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors[p + "gate.e_score_correction_bias"].abs().max() > 0.01  # non-trivial routing
    assert tensors[p + "shared_experts.down_proj.weight"].dtype == torch.bfloat16
    assert tensors["language_model.model.layers.0.mlp.gate_proj.weight"].shape == (512, 256)
    assert tensors["language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 256)
    assert tensors["vision_tower.encoder.blocks.1.wqkv.weight"].shape == (432, 144)
    assert tensors["mm_projector.proj.2.weight"].shape == (256, 576)
    bf16 = {k: v.dtype for k, v in tensors.items() if "experts." not in k or "shared" in k}
    assert {d for k, d in bf16.items() if not k.endswith("e_score_correction_bias")} == {torch.bfloat16}


def test_same_seed_same_weights_other_seed_others(tmp_path):
    kw = {"num_layers": 2, "tokenizer": False, "image_processor": False}
    a = load_file(str(write_kimi_k25_checkpoint(tmp_path / "a", seed=3, **kw) / "model.safetensors"))
    b = load_file(str(write_kimi_k25_checkpoint(tmp_path / "b", seed=3, **kw) / "model.safetensors"))
    c = load_file(str(write_kimi_k25_checkpoint(tmp_path / "c", seed=4, **kw) / "model.safetensors"))
    key = "language_model.model.layers.1.self_attn.q_a_proj.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])
    assert not (tmp_path / "a" / "tiktoken.model").exists()


# --------------------------------------------------------------------------- tokenizer


def test_ranks_are_a_complete_valid_bpe():
    ranks = tokenizer.default_ranks()
    assert len(ranks) == len(set(ranks)) == 163_584
    assert ranks[:256] == [bytes([b]) for b in range(256)]
    assert tokenizer.unreachable_tokens(ranks) == []
    swapped = list(ranks)
    i = ranks.index(b"ab")
    swapped[300], swapped[i] = swapped[i], swapped[300]  # "ab" before its parts' merge order allows
    assert b"ab" not in tokenizer.unreachable_tokens(swapped)  # both parts are bytes: still fine
    j = ranks.index("世".encode())
    swapped = list(ranks)
    swapped[300], swapped[j] = swapped[j], swapped[300]  # a CJK token ranked before its prefix
    assert "世".encode() in tokenizer.unreachable_tokens(swapped)


def test_tiktoken_model_file_is_base64_token_and_rank_lines(tok_dir):
    from tiktoken.load import load_tiktoken_bpe

    lines = (tok_dir / "tiktoken.model").read_text().splitlines()
    assert len(lines) == 163_584
    assert lines[65] == f"{base64.b64encode(b'A').decode()} 65"
    ranks = load_tiktoken_bpe(str(tok_dir / "tiktoken.model"))
    assert len(ranks) == 163_584 and max(ranks.values()) == 163_583
    assert not (tok_dir / "tokenizer.json").exists()


def test_pattern_splits_as_kimis_han_aware_regex():
    regex = pytest.importorskip("regex")
    pat = tokenizer.tokenization_module().PAT_STR
    # `&&` (class intersection) needs regex's V1 syntax; tiktoken's engine supports it natively.
    compiled = regex.compile(pat, flags=regex.V1)
    assert compiled.findall("Hello世界 don't 12345") == ["Hello", "世界", " don't", " ", "123", "45"]
    assert compiled.findall("ÉTÉ中文Abc") == ["ÉTÉ", "中文", "Abc"]
    import tiktoken

    bpe = tiktoken.Encoding("t", pat_str=pat, special_tokens={},
                            mergeable_ranks={t: i for i, t in enumerate(tokenizer.default_ranks())})
    for text in ["Hello世界 don't 12345", "a1b2 x+y=z\n\n  end", "中文English混合123", "ÉTÉ中文Abc"]:
        cuts, pos = set(), 0
        for piece in compiled.findall(text):
            pos += len(piece.encode())
            cuts.add(pos)
        ends, pos = set(), 0
        for token in bpe.encode_ordinary(text):
            pos += len(bpe.decode_single_token_bytes(token))
            ends.add(pos)
        assert cuts <= ends, text  # no token crosses a pre-tokenization boundary
    assert len(bpe.encode_ordinary("a1")) == 2 and len(bpe.encode_ordinary("ab")) == 1


def test_tokenizer_loads_as_kimis_remote_tokenizer_and_round_trips(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=True)
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    assert len(tok) == 163_840 and tok.vocab_size == 163_584
    for name, i in REAL_SPECIAL_IDS.items():
        assert tok.convert_tokens_to_ids(name) == i, name
        assert tok.convert_ids_to_tokens(i) == name
    assert tok.convert_ids_to_tokens(163589) == "<|reserved_token_163589|>"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        163584, 163585, 163839, 163838)
    for text in ["plain ASCII, with punctuation!", "中文和English混合 123456", "emoji 🙂 and é ü ß",
                 "tabs\tand\n\nnewlines  ", "<|im_user|>user<|im_middle|>你好<|im_end|><think>x</think>"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    ids = tok.encode("<|im_system|>system<|im_middle|>hi<|im_end|><|media_pad|>", add_special_tokens=False)
    assert ids[0] == 163594 and ids.count(163601) == 1 and ids[-2:] == [163586, 163605]
    assert tok.decode(ids, skip_special_tokens=True) == "systemhi"
    # a single byte of a CJK character decodes to the replacement character, as byte-level BPE does
    assert tok.decode([0xE4]) == "\ufffd"


def test_chat_template_renders_the_k25_markers(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 世界"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi 世界<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>")
    no_think = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True, thinking=False)
    assert no_think.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    assert tok.apply_chat_template(image, tokenize=False) == (
        "<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|>"
        "<|media_end|>What?<|im_end|>")
    # the rendering with a generation prompt is a prefix of the one with the answer
    through = tok.apply_chat_template(msgs[:3], tokenize=False)
    assert through.startswith(tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True))
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == (tok_dir / "chat_template.jinja").read_text()


def test_tokenizer_needs_trust_remote_code(tok_dir, ckpt_bf16):
    # transformers runs a tokenizer's own code only when asked to; without config.json it has
    # nothing else to load and refuses.
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
    # Next to a kimi_k25 config.json, a transformers that knows the model type (native
    # Kimi-K2.5 support) instead converts tiktoken.model into its generic fast tokenizer, as it
    # would for the real checkpoint: never our remote class.
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if "kimi_k25" in TOKENIZER_MAPPING_NAMES:
        tok = AutoTokenizer.from_pretrained(str(ckpt_bf16), trust_remote_code=False)
        assert type(tok).__name__ != "TikTokenTokenizer" and tok.is_fast
    else:
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            AutoTokenizer.from_pretrained(str(ckpt_bf16), trust_remote_code=False)


def test_merges_learned_from_a_corpus_tokenize_it_in_fewer_tokens(tmp_path):
    corpus = ["the quick brown fox jumps over the lazy dog; 狐狸跳过懒狗"] * 50
    ranks = tokenizer.learned_ranks(corpus, num_merges=200)
    assert len(ranks) == len(set(ranks)) == 163_584
    assert tokenizer.unreachable_tokens(ranks) == []
    assert b" quick" in ranks[:456]  # learned merges come right after the bytes
    write_kimi_k25_checkpoint(tmp_path, num_layers=2, image_processor=False, merges_from=corpus)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)
    default = AutoTokenizer.from_pretrained(str(_default_tok(tmp_path)), trust_remote_code=True)
    text = corpus[0]
    assert len(tok.encode(text, add_special_tokens=False)) < len(default.encode(text, add_special_tokens=False)) / 2
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def _default_tok(tmp_path):
    d = tmp_path / "default-tok"
    d.mkdir()
    tokenizer.write_tokenizer(d)
    return d


# --------------------------------------------------------------------------- image processor


def _image(w, h, seed=0):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def _image_processor(path):
    try:
        return AutoImageProcessor.from_pretrained(str(path), trust_remote_code=True)
    except ImportError as exc:  # transformers 5.17's AutoImageProcessor wants torchvision, even for remote code
        if "Torchvision" not in str(exc):
            raise
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    ref = json.loads((path / "preprocessor_config.json").read_text())["auto_map"]["AutoImageProcessor"]
    return get_class_from_dynamic_module(ref, str(path)).from_pretrained(str(path))


def test_image_processor_loads_with_remote_code_and_counts_tokens(ckpt_bf16):
    proc = _image_processor(ckpt_bf16)
    assert type(proc).__name__ == "KimiK25VisionProcessor"
    assert proc.num_frames_per_chunk == 4
    count = proc.media_tokens_calculator
    assert count({"type": "image", "image": _image(28, 28)}) == 1
    assert count({"type": "image", "image": _image(100, 50)}) == 8  # padded to 112 x 56
    # 3000 x 3000 (vLLM's profiling item): at most 16384 patches -> 1794 px -> 1820 padded -> 65 x 65
    assert count({"type": "image", "image": _image(3000, 3000)}) == 4225
    # a 4-frame chunk: at most 4096 patches per frame -> 897 px -> 924 -> 33 x 33, frames pooled
    assert count({"type": "video_chunk", "video_chunk": [_image(3000, 3000, s) for s in range(4)]}) == 1089


def test_image_processor_patches_are_normalised_channels_first_row_major(ckpt_bf16):
    import numpy as np

    proc = _image_processor(ckpt_bf16)
    img, small = _image(100, 50), _image(28, 28, seed=1)
    out = proc.preprocess([{"type": "image", "image": img}, {"type": "image", "image": small}],
                          return_tensors="pt")
    assert out["grid_thws"].tolist() == [[1, 4, 8], [1, 2, 2]]
    pv = out["pixel_values"]
    assert pv.shape == (4 * 8 + 2 * 2, 3, 14, 14) and pv.dtype == torch.float32
    px = (np.asarray(img, dtype=np.float32) / 255.0 - 0.5) / 0.5  # no resize: it fits
    # patch (row 1, col 2) of the first image holds pixels [14:28, 28:42], channels first
    assert torch.allclose(pv[1 * 8 + 2], torch.from_numpy(px[14:28, 28:42].transpose(2, 0, 1)), atol=1e-6)
    # the last column of patches covers x = 98..111: two real columns, then black padding
    last = pv[7]
    assert torch.allclose(last[:, :, :2], torch.from_numpy(px[0:14, 98:100].transpose(2, 0, 1)), atol=1e-6)
    assert torch.all(last[:, :, 2:] == -1.0)
    assert proc.media_tokens_calculator({"type": "image", "image": img}) == 4 * 8 // 4


# --------------------------------------------------------------------------- transformers reference


def test_reference_model_holds_the_dequantized_experts_and_runs(ckpt_int4):
    model = kimi_k25_text_model_for_reference(ckpt_int4)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    tensors = load_file(str(ckpt_int4 / "model.safetensors"))
    state = weights.split_experts(model.state_dict(), KimiK25Shape())
    for layer, e, proj in [(1, 0, "gate_proj"), (4, 7, "up_proj"), (7, 3, "down_proj")]:
        base = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
        stored = {k: tensors["language_model." + base + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
        assert torch.equal(state[base + "weight"], int4.decompress(stored))
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert torch.equal(state[bias], tensors["language_model." + bias])
    with torch.no_grad():
        logits = model(torch.tensor([[163587, 100, 2000, 30000, 163601]])).logits
    assert logits.shape == (1, 5, 163_840) and torch.isfinite(logits).all()
    assert logits[0, -1].std() > 1.0  # the spread LM head: not near-uniform


def test_trained_deepseek_v3_weights_are_written_in_the_kimi_layout(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    sizes = {"num_layers": 3, "n_routed_experts": 4, "moe_intermediate_size": 64}
    cfg = hf_text_config(kimi_k25_config(KimiK25Shape(**sizes))["text_config"])
    torch.manual_seed(0)
    trained = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, t in trained.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.uniform_(-0.1, 0.1)
    ids = torch.tensor([[5, 900, 70000, 163587, 12]])
    for variant in ("bf16", "int4"):
        path = write_kimi_k25_checkpoint(tmp_path / variant, variant=variant, state_dict=trained.state_dict(),
                                         tokenizer=False, image_processor=False, **sizes)
        ref = kimi_k25_text_model_for_reference(path)
        got, want = ref.state_dict(), trained.state_dict()
        assert set(got) == set(want)
        for name, t in want.items():
            if name.endswith("e_score_correction_bias"):
                assert torch.equal(got[name], t.float()), name
            elif variant == "int4" and ".experts." in name and "shared" not in name:
                assert not torch.equal(got[name], t.to(torch.bfloat16).float())  # quantized
            else:
                assert torch.equal(got[name], t.to(torch.bfloat16).float()), name
    # the bf16 copy computes what the trained model does with bf16-rounded weights
    ref = kimi_k25_text_model_for_reference(tmp_path / "bf16")
    rounded = DeepseekV3ForCausalLM(cfg).eval()
    rounded.load_state_dict({k: (v if k.endswith("correction_bias") else v.to(torch.bfloat16).float())
                             for k, v in trained.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, rounded(ids).logits)


def test_text_weights_of_another_shape_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        write_kimi_k25_checkpoint(tmp_path, state_dict={"model.embed_tokens.weight": torch.zeros(163840, 128)},
                                  tokenizer=False, image_processor=False)
