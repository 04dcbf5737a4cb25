"""A tiny random Qwen2 checkpoint with its own tokenizer, built offline.

Shaped like the Qwen2-0.5B that speculators 0.3/0.4 tested their generator on: tied
embeddings, q/k/v biases, grouped-query attention, a ``Qwen2Tokenizer`` (byte-level BPE with
Qwen2's pre-tokenizer, trained here on a few sentences), ChatML chat template,
``<|endoftext|>`` as end of sequence and padding. 12 decoder layers, so speculators-numbered
ids up to 10 are valid (their batch test asks for ``[10]``).

Random weights are scaled (``RESIDUAL_STEP``) so that each decoder layer moves the residual
stream by a clear margin: on two sentences of about 64 tokens, HF ``hidden_states[3]``,
``[7]``, ``[10]`` differ from ``[2]``, ``[6]``, ``[9]`` by 0.13 in mean absolute value, while
bf16 and fp32 runs of the same layers differ by 0.005 (CPU, transformers 5.17). That is what
lets a comparison with HF ``output_hidden_states`` tell one layer from the next.

    python tests/gpu/_tiny_qwen2.py DIR     # writes the checkpoint and tokenizer to DIR
"""

from __future__ import annotations

import json
import os

import torch

NUM_LAYERS = 12
HIDDEN = 128  # 4 heads of 32 (a head size every vLLM attention backend takes)
MAX_POSITIONS = 2048  # speculators' tests run with max_model_len=2048
RESIDUAL_STEP = 8.0  # o_proj / down_proj scale: each layer moves the residual stream visibly

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_TARGET = 320  # 256 bytes, the specials and a few dozen merges: ~2-3 characters a token

# ChatML, as Qwen2 checkpoints ship it (a default system turn, then the conversation)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """
You are a helpful assistant. What is the answer? Explain it in simple terms, step by step.
The future of science and technology is bright and full of possibilities that will
transform the world. In a world where technology advances rapidly, we must carefully
consider the ethical implications of what we build. Write a short poem about the ocean,
the sea, the sky and the sun. What are the main differences between Python and
JavaScript? Hello! Good morning, good evening and good night. Translate the sentence to
French, Spanish, and German. What is the capital of Brazil, of France, of Spain? Describe
the process of photosynthesis: plants use light, water and air to make sugar. Artificial
intelligence, machine learning and language models help people read, write and reason.
The theory of relativity says that time and space depend on how fast you move. Numbers
such as 1, 2, 3, 4, 5, 10, 100 and 2+2 = 4 are simple. A haiku has three short lines.
Humanity must decide how to use its tools; computers, phones and networks change how we
live, work and learn. Please answer the question, then give one example and a summary.
"""


def build_tokenizer(path: str) -> None:
    """Train a small byte-level BPE on CORPUS with Qwen2's pre-tokenizer and save it as a
    ``Qwen2Tokenizer`` (what ``AutoTokenizer`` loads for a ``qwen2`` checkpoint)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    qwen = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, model_max_length=MAX_POSITIONS,
                          additional_special_tokens=SPECIALS[1:])
    qwen.chat_template = CHAT_TEMPLATE
    qwen.save_pretrained(path)


def build(path: str, *, seed: int = 0) -> str:
    """Save the bf16 checkpoint and its tokenizer under ``path``; returns ``path``."""
    import transformers as tf

    os.makedirs(path, exist_ok=True)
    build_tokenizer(path)
    vocab = -(-len(tf.AutoTokenizer.from_pretrained(path)) // 64) * 64  # rounded up, as usual
    torch.manual_seed(seed)
    cfg = tf.Qwen2Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = tf.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(RESIDUAL_STEP)
            layer.mlp.down_proj.weight.mul_(RESIDUAL_STEP)
    model.to(torch.bfloat16).save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved.setdefault("torch_dtype", "bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=1)
    return path


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1]))
