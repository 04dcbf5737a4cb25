"""A tiktoken BPE tokenizer with the file layout and interface of Kimi's remote tokenizer.

Written by vllm-compat for its Kimi-K2.5 test checkpoints (Apache-2.0); it is not Moonshot's
code. It reads ``tiktoken.model`` (lines of ``base64(token bytes) rank``), splits text with
Kimi's Han-aware pre-tokenization pattern, and takes its special tokens (ids after the last
rank) from ``added_tokens_decoder`` in ``tokenizer_config.json``. Tokens are shown as
byte-level strings (every byte mapped to one printable character), so any id sequence
decodes, including ones that cut a UTF-8 character in two.

Loading it runs this file, so transformers asks for ``trust_remote_code=True``.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, ClassVar

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

# Kimi's pre-tokenization: runs of Han characters stand alone; letter runs exclude Han
# (character-class intersection, supported by tiktoken's regex engine); digits in threes.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _NOT_HAN_UPPER + "*" + _NOT_HAN_LOWER + "+" + _CONTRACTION,
    r"[^\r\n\p{L}\p{N}]?" + _NOT_HAN_UPPER + "+" + _NOT_HAN_LOWER + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED_SPECIAL_TOKENS = 256


def byte_alphabet() -> dict[int, str]:
    """One printable character per byte: printable Latin-1 bytes stand for themselves, the
    others (controls, space, ...) take the code points from 256 upwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names: ClassVar[dict[str, str]] = {"vocab_file": "tiktoken.model"}
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        added_tokens_decoder: dict[int, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        ranks = load_tiktoken_bpe(vocab_file)
        self.vocab_file = vocab_file
        self._bpe = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(vocab_file))) or "kimi",
            pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
        to_char = byte_alphabet()
        self._byte_of = {c: b for b, c in to_char.items()}
        self._id_to_token = {rank: "".join(to_char[b] for b in token)
                             for token, rank in ranks.items()}
        self._token_to_id = {t: i for i, t in self._id_to_token.items()}
        # The base class looks tokens up while it initialises: the tables above come first.
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         pad_token=pad_token, added_tokens_decoder=added_tokens_decoder or {},
                         **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def get_vocab(self) -> dict[str, int]:
        vocab = dict(self._token_to_id)
        vocab.update(self.get_added_vocab())
        return vocab

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self._id_to_token[i] for i in self._bpe.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self._token_to_id:
            return self._token_to_id[token]
        return self.get_added_vocab().get(str(self.unk_token), 0)

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_token.get(index, str(self.unk_token))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        added = self.get_added_vocab()
        out = bytearray()
        for token in tokens:
            if token in added:
                out += token.encode("utf-8")
            else:
                out += bytes(self._byte_of[c] for c in token)
        return out.decode("utf-8", errors="replace")

    def _decode(self, token_ids: Any, skip_special_tokens: bool = False,
                clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        # Byte-level tokens carry their own spaces; transformers 4 would add more around
        # special tokens by default (5 dropped the option).
        kwargs.setdefault("spaces_between_special_tokens", False)
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        prefix = filename_prefix + "-" if filename_prefix else ""
        name = prefix + self.vocab_files_names["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
