"""A byte-level BPE tokenizer trained locally with ``tokenizers``, saved for transformers and vLLM.

Byte-level pre-tokenizer and decoder (every byte string round-trips, no unknown token),
special tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` (ids 0, 1, 2), and a post-processor
that puts ``<|bos|>`` in front when ``add_special_tokens`` is on -- the same framing the
target is trained with (``<|bos|> file <|eos|>``). Saved as a ``PreTrainedTokenizerFast``
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) so
``AutoTokenizer.from_pretrained(dir)`` and vLLM load it from a checkpoint directory.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)


def train_bpe(
    files: Iterable[str | os.PathLike[str]] | None = None,
    *,
    texts: Iterable[str] | None = None,
    vocab_size: int = 8192,
    min_frequency: int = 2,
) -> Any:
    """A trained ``tokenizers.Tokenizer`` (from text files, or from an iterator of strings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if (files is None) == (texts is None):
        raise ValueError("pass exactly one of files= or texts=")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    if files is not None:
        tok.train([str(f) for f in files], trainer)
    else:
        tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)])
    return tok


def save_for_transformers(tok: Any, directory: str | os.PathLike[str], *, model_max_length: int = 2048) -> dict[str, int]:
    """Save ``tok`` as a ``PreTrainedTokenizerFast``; returns the special token ids."""
    from transformers import PreTrainedTokenizerFast

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=model_max_length)
    fast.save_pretrained(str(d))
    # transformers 5 writes its own class name ("TokenizersBackend"), which 4.x does not
    # know; "PreTrainedTokenizerFast" loads the same tokenizer.json in both.
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return special_ids(tok)


def special_ids(tok: Any) -> dict[str, int]:
    return {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
            "pad_token_id": tok.token_to_id(PAD)}


def train_tokenizer(
    text_file: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    model_max_length: int = 2048,
) -> dict[str, Any]:
    """Train on ``text_file``, save into ``output_dir``, write ``tokenizer_report.json``."""
    t0 = time.perf_counter()
    tok = train_bpe([text_file], vocab_size=vocab_size, min_frequency=min_frequency)
    ids = save_for_transformers(tok, output_dir, model_max_length=model_max_length)
    rep = {"vocab_size": tok.get_vocab_size(), "requested_vocab_size": vocab_size, **ids,
           "train_bytes": Path(text_file).stat().st_size, "wall_s": round(time.perf_counter() - t0, 2)}
    (Path(output_dir) / "tokenizer_report.json").write_text(json.dumps(rep, indent=1))
    return rep
