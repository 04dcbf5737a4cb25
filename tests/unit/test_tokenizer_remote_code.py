"""A tokenizer shipped as code runs only with trust_remote_code=True, and the refusal says
which file declares which code and what to pass."""

from __future__ import annotations

import json

import pytest

from vllm_compat.tokenizer import RemoteCodeRefusedError, check_remote_code, remote_code


def _checkpoint(tmp_path, tokenizer_map=None, processor_map=None):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TikTokenTokenizer", **({"auto_map": tokenizer_map} if tokenizer_map else {})}))
    if processor_map:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({"auto_map": processor_map}))
    return tmp_path


def test_remote_code_names_each_declared_class(tmp_path):
    ck = _checkpoint(tmp_path, {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                     {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor"})
    assert remote_code(ck) == {
        "tokenizer_config.json": "tokenization_kimi.TikTokenTokenizer",
        "preprocessor_config.json": "kimi_k25_vision_processing.KimiK25VisionProcessor"}


def test_code_is_refused_without_trust_and_allowed_with_it(tmp_path):
    ck = _checkpoint(tmp_path, {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]})
    with pytest.raises(RemoteCodeRefusedError, match=(
            r"ships its tokenizer as code: tokenization_kimi.TikTokenTokenizer "
            r"\(tokenizer_config.json\)\. Loading it runs that code; pass trust_remote_code=True "
            r"if you trust this checkpoint")):
        check_remote_code(ck, False)
    check_remote_code(ck, True)


def test_a_plain_tokenizer_needs_no_trust(tmp_path):
    check_remote_code(_checkpoint(tmp_path), False)
    assert remote_code(tmp_path) == {}
