#!/usr/bin/env python3
"""A speculators 0.4 offline data-generation loop, ported to vllm_compat with one import.

The loop below is the shape of speculators 0.4.0's ``scripts/data_generation_offline.py``
(generator -> ``generate(batch_input_ids)`` -> ``data_{i}.pt`` + ``data_config.json``).
Only the generator import changed; it now runs on any vLLM vllm_compat supports, and the
same ``--layer-ids`` give the same states as before. ``--layer-convention vllm`` switches
to vLLM's layer numbering (the states an EAGLE-3 draft is fed when served).

    # a real model and tokenized data ({"input_ids": [...], "loss_mask": [...]} per line):
    python examples/speculators_offline.py --model /path/to/Llama-3.1-8B-Instruct \\
        --data tokenized.jsonl --output-dir ./training_data --batch-size 16

    # no arguments: builds a tiny random Llama with transformers and random prompts
    python examples/speculators_offline.py --output-dir /tmp/spec-demo

Needs a GPU, vLLM, torch (and transformers for the tiny model). For the full CLI with
speculators' flags (resume, --start-idx, speculators' own preprocessing) use
``python -m vllm_compat.speculators.offline``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

import torch

# before:
# from speculators.data_generation.vllm_hidden_states_generator import (
#     VllmHiddenStatesGenerator)
from vllm_compat.speculators import VllmHiddenStatesGenerator

# before: from speculators.data_generation.config_generator import DataGenerationConfig
from vllm_compat.speculators.config_generator import DataGenerationConfig


def generate(model_path: str, samples: list[dict], output_dir: str, *, batch_size: int = 8,
             layer_ids: list[int] | None = None, layer_convention: str | None = None,
             seq_length: int = 2048, gpu_memory_utilization: float = 0.8,
             extractor_kwargs: dict | None = None) -> int:
    """The speculators loop: batches in, one ``data_{i}.pt`` per sample out. ``extractor_kwargs``:
    more engine settings (``kv_cache_memory_bytes`` where the GPU is shared)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    generator = VllmHiddenStatesGenerator(
        model_path=model_path, layer_ids=layer_ids, max_model_len=seq_length,
        gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=1,
        layer_convention=layer_convention, extractor_kwargs=extractor_kwargs)
    try:
        file_idx = 0
        lengths = {}
        for i in range(0, len(samples), batch_size):
            batch = samples[i:i + batch_size]
            results = generator.generate([s["input_ids"] for s in batch])
            for j, result in enumerate(results):  # input order: results[j] is batch[j]
                n = len(result["input_ids"])
                torch.save({
                    "input_ids": result["input_ids"],
                    "hidden_states": [h.contiguous() for h in result["hidden_states"]],
                    "loss_mask": torch.as_tensor(batch[j]["loss_mask"][:n], dtype=torch.long),
                }, out / f"data_{file_idx}.pt")
                lengths[file_idx] = n
                file_idx += 1
        (out / "sample_lengths.json").write_text(json.dumps(lengths, indent=2))
        config = DataGenerationConfig.from_generator(
            generator=generator, train_data_path="(tokenized input)", seq_length=seq_length,
            cache_dir="", num_samples=len(samples))
        (out / "data_config.json").write_text(json.dumps(config.to_dict(), indent=2))
        return file_idx
    finally:
        generator.shutdown()


def tiny_llama(path: str) -> str:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="local checkpoint (default: a tiny random Llama)")
    p.add_argument("--data", help="tokenized .jsonl (default: random prompts)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--layer-ids", type=int, nargs="+")
    p.add_argument("--layer-convention", choices=("speculators", "vllm"),
                   help="numbering of --layer-ids (default: speculators 0.3/0.4's, output of "
                        "layer i; 'vllm': state entering layer k)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    a = p.parse_args()
    model = a.model or tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    if a.data:
        lines = Path(a.data).read_text().splitlines()
        samples = [json.loads(line) for line in lines if line.strip()]
    else:
        rng = random.Random(0)
        samples = []
        for n in (5, 16, 17, 33, 48, 1, 70, 9, 64, 31, 100, 2, 47):  # 13: one batch >= 11
            ids = [rng.randrange(3, 1024) for _ in range(n)]
            samples.append({"input_ids": ids, "loss_mask": [1] * n})
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    n = generate(model, samples, a.output_dir, batch_size=a.batch_size, layer_ids=a.layer_ids,
                 layer_convention=a.layer_convention, seq_length=a.seq_length,
                 gpu_memory_utilization=a.gpu_memory_utilization)
    print(f"wrote {n} samples to {a.output_dir}")


if __name__ == "__main__":
    main()
