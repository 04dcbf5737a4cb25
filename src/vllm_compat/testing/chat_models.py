"""A tiny chat checkpoint: random weights plus a BPE tokenizer trained here, with a chat
template, so the chat endpoints, ``prepare``-style rendering and tokenizer loading can be
tested end to end without a download.

The tokenizer is trained on a few sentences and knows the special tokens of Llama-3's chat
template (``<|start_header_id|>``, ``<|eot_id|>``, ...), so rendered prompts carry special
token ids as real chat data does.
"""

from __future__ import annotations

import os
from typing import Any

from .models import build_model

__all__ = ["CORPUS", "LLAMA3_TEMPLATE", "build_chat_model", "build_chat_tokenizer",
           "conversations"]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "Hello there, how are you today?", "I am fine, thank you very much.",
    "What is the capital of France?", "Paris is the capital of France.",
    "Tell me a joke about numbers 1 2 3.", "Why did the seven eat nine? Because 7 8 9.",
    "Name three colours.", "Red, green and blue.", "system user assistant",
]


def build_chat_tokenizer(directory: str | os.PathLike[str], *, template: str = LLAMA3_TEMPLATE,
                         vocab_size: int = 400) -> str:
    """A byte-level BPE tokenizer with ``template`` as its chat template, saved in
    ``directory``; returns the path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    return str(directory)


def build_chat_model(directory: str | os.PathLike[str], shape: str = "llama-tiny",
                     **overrides: Any) -> str:
    """:func:`~.models.build_model` of ``shape`` (default ``llama-tiny``: 8 layers, so the
    EAGLE-3 default ids ``[2, 4, 5, 8]`` are distinct) with a chat tokenizer beside it."""
    overrides.setdefault("vocab_size", 512)
    path = build_model(shape, directory, **overrides)
    build_chat_tokenizer(path)
    return path


def conversations(n: int) -> list[dict[str, Any]]:
    """``n`` chat records (ShareGPT and OpenAI shapes mixed), one to three turns each."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        turns = [(CORPUS[(i + 2 * t) % len(CORPUS)], CORPUS[(i + 2 * t + 1) % len(CORPUS)])
                 for t in range(1 + i % 3)]
        if i % 2:
            out.append({"conversations": [m for q, a in turns for m in
                                          ({"from": "human", "value": q}, {"from": "gpt", "value": a})]})
        else:
            out.append({"messages": [m for q, a in turns for m in
                                     ({"role": "user", "content": q},
                                      {"role": "assistant", "content": a})]})
    return out
