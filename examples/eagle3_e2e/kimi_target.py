"""A Kimi-K2.5-shaped target trained on the stdlib corpus, written as a Kimi-K2.5 checkpoint.

The text model is transformers' ``DeepseekV3ForCausalLM`` (MLA + MoE, Kimi's routing) with
the test checkpoint's sizes (:class:`vllm_compat.testing.kimi_k25.KimiK25Shape`), trained by
``target_train.train_target`` like the Llama; its tokenizer is Kimi's layout (tiktoken ranks,
the real special ids, remote code) with BPE merges learned from the training files. The
result is written with :func:`vllm_compat.testing.kimi_k25.write_kimi_k25_checkpoint`, so
vLLM loads it as ``KimiK25ForConditionalGeneration`` (bf16, or INT4 routed experts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from .corpus import TRAIN_DOCS, read_jsonl
from .target_train import Family, TargetTrainConfig


def write_kimi_tokenizer(corpus_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str]
                         ) -> dict[str, Any]:
    """Kimi's tokenizer files with merges learned from the training documents."""
    from vllm_compat.testing.kimi_k25.tokenizer import VOCAB_SIZE, write_tokenizer

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, merges_from=(d["text"] for d in read_jsonl(Path(corpus_dir) / TRAIN_DOCS)))
    rep = {"vocab_size": VOCAB_SIZE, **_special()}
    (out / "tokenizer_report.json").write_text(json.dumps(rep, indent=1))
    return rep


def _special() -> dict[str, int]:
    from vllm_compat.testing.kimi_k25.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS

    return {"bos_token_id": SPECIAL_TOKENS[BOS], "eos_token_id": SPECIAL_TOKENS[EOS],
            "pad_token_id": SPECIAL_TOKENS[PAD]}


def _tokenizer(tokenizer_dir: str) -> tuple[Callable[[list[str]], list[list[int]]], dict[str, int], int]:
    from vllm_compat.testing.kimi_k25.tokenizer import VOCAB_SIZE
    from vllm_compat.tokenizer import load_tokenizer

    # our own tokenizer code, written next to the ranks: trusted here by construction
    tok = load_tokenizer(tokenizer_dir, trust_remote_code=True)

    def encode(texts: list[str]) -> list[list[int]]:
        return [tok.encode(t, add_special_tokens=False) for t in texts]

    return encode, _special(), VOCAB_SIZE


def _shape(cfg: TargetTrainConfig) -> Any:
    from vllm_compat.testing.kimi_k25 import KimiK25Shape

    return KimiK25Shape(**cfg.extra.get("kimi_shape", {}))


def _build(cfg: TargetTrainConfig, vocab_size: int, special: dict[str, int]) -> Any:
    from transformers import DeepseekV3ForCausalLM

    from vllm_compat.testing.kimi_k25 import hf_text_config, kimi_k25_config

    text = kimi_k25_config(_shape(cfg))["text_config"]
    config = hf_text_config(text)
    config.use_cache = False
    return DeepseekV3ForCausalLM(config)


def _save(model: Any, cfg: TargetTrainConfig, out: Path, special: dict[str, int]) -> None:
    import shutil

    from vllm_compat.testing.kimi_k25 import write_kimi_k25_checkpoint

    write_kimi_k25_checkpoint(out, variant=cfg.extra.get("kimi_variant", "bf16"),
                              state_dict=model.state_dict(), tokenizer=False,
                              **cfg.extra.get("kimi_shape", {}))
    for name in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py",
                 "chat_template.jinja"):
        shutil.copy2(Path(cfg.tokenizer_dir) / name, out / name)


KIMI_K25 = Family("kimi_k25", _tokenizer, _build, _save)
