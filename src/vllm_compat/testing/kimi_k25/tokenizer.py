"""The tokenizer files of a Kimi-K2.5 test checkpoint: ranks, special tokens, chat template.

Kimi ships no ``tokenizer.json``: its tokenizer is remote code (``tokenization_kimi.py``)
over a tiktoken rank file with 163,584 ranks and 256 special tokens at ids 163584-163839.
We write the same layout with our own code and our own ranks. The ranks are a valid BPE:
each token of two or more bytes is the concatenation of two tokens of lower rank, so the
merge order that tiktoken applies can produce it.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

NUM_RANKS = 163_584
NUM_SPECIAL = 256
VOCAB_SIZE = NUM_RANKS + NUM_SPECIAL

# The special tokens Kimi-K2.5 names; every other id in 163584-163839 is reserved.
SPECIAL_TOKENS: dict[str, int] = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
    "<|im_assistant|>": 163588, "<|start_header_id|>": 163590, "<|end_header_id|>": 163591,
    "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
    "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
    "<|media_pad|>": 163605, "<think>": 163606, "</think>": 163607, "[UNK]": 163838, "[PAD]": 163839,
}
BOS, EOS, UNK, PAD = "[BOS]", "[EOS]", "[UNK]", "[PAD]"
MEDIA_PAD = "<|media_pad|>"
_FILES = resources.files(__package__) / "files"


def special_tokens() -> dict[int, str]:
    """All 256 special ids with their names (``<|reserved_token_ID|>`` for the unnamed ones)."""
    names = {i: f"<|reserved_token_{i}|>" for i in range(NUM_RANKS, VOCAB_SIZE)}
    names.update({i: t for t, i in SPECIAL_TOKENS.items()})
    return names


def default_ranks(num_ranks: int = NUM_RANKS) -> list[bytes]:
    """Tokens in rank order: the 256 bytes, printable-ASCII pairs, every CJK Unified Ideograph
    (U+4E00-U+9FFF, after the two-byte prefixes they merge from), then printable-ASCII
    triples, as many as ``num_ranks`` needs."""
    ranks = [bytes([b]) for b in range(256)]
    printable = [bytes([b]) for b in range(0x20, 0x7F)]
    pairs = [a + b for a in printable for b in printable]
    ranks += pairs
    han = [chr(c).encode() for c in range(0x4E00, 0xA000)]
    ranks += list(dict.fromkeys(h[:2] for h in han)) + han
    for pair in pairs:
        if len(ranks) >= num_ranks:
            break
        ranks += [pair + c for c in printable[: num_ranks - len(ranks)]]
    return _checked(ranks[:num_ranks], num_ranks)


def learned_ranks(texts: Iterable[str], *, num_merges: int = 32_000,
                  num_ranks: int = NUM_RANKS) -> list[bytes]:
    """Bytes, then BPE merges learned from ``texts`` (split with Kimi's pattern), then the
    tokens of :func:`default_ranks` the merges did not produce, up to ``num_ranks``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokenization_module().PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + num_merges, min_frequency=2,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    to_byte = {c: b for b, c in tokenization_module().byte_alphabet().items()}
    ranks = [bytes([b]) for b in range(256)]
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        ranks.append(bytes(to_byte[c] for c in left + right))
    seen = set(ranks)
    ranks += [t for t in default_ranks(num_ranks) if t not in seen]
    return _checked(ranks[:num_ranks], num_ranks)


@functools.cache
def tokenization_module() -> ModuleType:
    """The ``tokenization_kimi.py`` we write into checkpoints, imported (needs tiktoken)."""
    with resources.as_file(_FILES / "tokenization_kimi.py") as path:
        spec = importlib.util.spec_from_file_location("vllm_compat_tokenization_kimi", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def _checked(ranks: list[bytes], num_ranks: int) -> list[bytes]:
    if len(ranks) != num_ranks or len(set(ranks)) != num_ranks:
        raise ValueError(f"expected {num_ranks} distinct tokens, got {len(set(ranks))} "
                         f"distinct of {len(ranks)}")
    return ranks


def unreachable_tokens(ranks: list[bytes]) -> list[bytes]:
    """Tokens of two or more bytes that no split into two lower-ranked tokens produces."""
    rank = {t: i for i, t in enumerate(ranks)}
    return [t for i, t in enumerate(ranks) if len(t) > 1 and not any(
        rank.get(t[:k], i) < i and rank.get(t[k:], i) < i for k in range(1, len(t)))]


def write_tiktoken_model(path: str | os.PathLike[str], ranks: list[bytes]) -> None:
    lines = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(ranks)]
    Path(path).write_text("\n".join(lines) + "\n")


def chat_template() -> str:
    return (_FILES / "chat_template.jinja").read_text()


def tokenizer_config() -> dict[str, Any]:
    named = [t for t in SPECIAL_TOKENS if t not in (BOS, EOS, UNK, PAD)]
    return {
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in special_tokens().items()},
        "additional_special_tokens": named,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
        "tokenizer_class": "TikTokenTokenizer",
    }


def write_tokenizer(directory: str | os.PathLike[str], *,
                    merges_from: Iterable[str] | None = None) -> None:
    """``tiktoken.model``, ``tokenizer_config.json``, ``tokenization_kimi.py`` and
    ``chat_template.jinja`` in ``directory``; never a ``tokenizer.json``."""
    d = Path(directory)
    ranks = default_ranks() if merges_from is None else learned_ranks(merges_from)
    write_tiktoken_model(d / "tiktoken.model", ranks)
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (d / "tokenizer_config.json").write_text(config + "\n")
    (d / "tokenization_kimi.py").write_text((_FILES / "tokenization_kimi.py").read_text())
    (d / "chat_template.jinja").write_text(chat_template())
