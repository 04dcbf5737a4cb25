"""Small synthetic targets and datasets: run the whole pipeline on CPU in seconds.

The target is a ``config.json`` plus the only tensors training reads (embedding, final
norm, lm_head). The dataset's tokens follow a
successor table and its final-layer state makes the target predict the true next token, so
a working trainer shows a falling loss and a rising accuracy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..eagle3.data import ShardWriter


def write_target(
    directory: str | os.PathLike[str],
    *,
    vocab_size: int = 96,
    hidden_size: int = 16,
    num_hidden_layers: int = 8,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    intermediate_size: int = 32,
    seed: int = 0,
) -> str:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        torch_dtype="float32", bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)
    save_file({
        "model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=g),
        "model.norm.weight": torch.ones(hidden_size),
        "lm_head.weight": 2.0 * torch.randn(vocab_size, hidden_size, generator=g),
    }, str(d / "model.safetensors"))
    return str(d)


def write_dataset(
    directory: str | os.PathLike[str],
    target_dir: str | os.PathLike[str],
    *,
    num_samples: int = 8,
    min_len: int = 10,
    max_len: int = 16,
    aux_layer_ids: tuple[int, ...] = (2, 4, 5),
    hot_tokens: int = 24,
    seed: int = 0,
    samples_per_shard: int = 3,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Token chains over ``hot_tokens`` fixed random ids that mostly follow a fixed successor
    table, with a final state from which the target predicts exactly the next token. The
    draft can learn the table; the first quarter of each sample is "prompt" (not trained on).
    ``dtype``: the stored states' (float8_e4m3fn: FP8 with scales)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    lm_head = load_file(str(Path(target_dir) / "model.safetensors"))["lm_head.weight"]
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    fixed = torch.Generator().manual_seed(1234)
    hot_ids = torch.randperm(cfg["vocab_size"], generator=fixed)[:hot_tokens]  # scattered over the vocab
    successor = torch.randperm(hot_tokens, generator=fixed)
    with ShardWriter(directory, hidden_size=hidden, aux_layer_ids=list(aux_layer_ids),
                     final_layer_id=layers, dtype=dtype, samples_per_shard=samples_per_shard,
                     target={"name_or_path": str(target_dir), "vocab_size": cfg["vocab_size"],
                             "num_hidden_layers": layers}) as w:
        for _ in range(num_samples):
            t = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            ids = [int(torch.randint(0, hot_tokens, (1,), generator=g))]
            for _ in range(t - 1):
                jump = float(torch.rand(1, generator=g)) < 0.1
                ids.append(int(torch.randint(0, hot_tokens, (1,), generator=g)) if jump else int(successor[ids[-1]]))
            ids_t = hot_ids[torch.tensor(ids)]
            aux = torch.randn(t, len(aux_layer_ids), hidden, generator=g)
            nxt = torch.cat([ids_t[1:], ids_t[-1:]])
            last = 4.0 * lm_head[nxt]  # the target's prediction at t is x[t+1]
            w.add({"input_ids": ids_t, "loss_mask": torch.arange(t) >= t // 4,
                   "hidden_states": torch.cat([aux, last[:, None]], dim=1)})
    return str(directory)
