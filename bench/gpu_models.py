"""Random-weight checkpoints for the GPU extraction benchmark (built, not downloaded).

    python -m bench.gpu_models --model llama-1b --out /tmp/vllm-compat-bench/llama-1b

Shapes: ``llama-1b`` (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192,
vocab 32000), ``llama-8b`` (Llama-3.1-8B's dimensions), ``deepseek-tiny`` (the MLA + MoE
model of ``tests/gpu/_models.py``, with a longer position range for 2048-token prompts) and
``llama-tiny`` (CPU tests). Weights are built on the target device directly in bf16 with
transformers' own init (normal, std ``initializer_range`` = 0.02, norms at 1): an 8B shape
is a few GPU kernels, and the states stay finite through 32 layers. A finished build leaves
``.bench-spec.json``; a second call with the same spec reuses the directory.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

MAX_POS = 4096
_COMMON = dict(max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, initializer_range=0.02)

SPECS: dict[str, dict[str, Any]] = {
    "llama-1b": dict(kind="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192, vocab_size=32000),
    # meta-llama/Llama-3.1-8B: rope theta 500000 (its llama3 rope scaling changes no cost).
    "llama-8b": dict(kind="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                     rope_theta=500000.0),
    # tests/gpu/_models.py "deepseek_v3" (Kimi-K2.5's backbone, scaled down), max_pos 4096.
    "deepseek-tiny": dict(
        kind="deepseek_v3", vocab_size=1024, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=192, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_scaling=None),
    "llama-tiny": dict(kind="llama", hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=128, vocab_size=512),
}
SPEC_FILE = ".bench-spec.json"


def make_config(name: str) -> Any:
    import transformers as tf
    spec = dict(SPECS[name])
    kind = spec.pop("kind")
    cls = {"llama": tf.LlamaConfig, "deepseek_v3": tf.DeepseekV3Config}[kind]
    return cls(**{**_COMMON, **spec})


def build(name: str, out: str | os.PathLike[str], *, device: str = "cuda", seed: int = 0,
          force: bool = False) -> dict[str, Any]:
    """Save ``name``'s random bf16 checkpoint in ``out`` (safetensors); returns build info."""
    import torch
    import transformers as tf
    out = Path(out)
    want = {"name": name, "spec": SPECS[name], "common": _COMMON, "seed": seed}
    marker = out / SPEC_FILE
    if not force and marker.is_file():
        have = json.loads(marker.read_text())
        if {k: have.get(k) for k in want} == json.loads(json.dumps(want)):
            return dict(have, reused=True)
    cfg = make_config(name)
    t0 = time.perf_counter()
    cls = {"llama": tf.LlamaForCausalLM,
           "deepseek_v3": tf.DeepseekV3ForCausalLM}[SPECS[name]["kind"]]
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=torch.bfloat16)
    model.to(device)  # a no-op unless transformers built it elsewhere
    with torch.no_grad():
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if n.endswith("e_score_correction_bias"):  # non-trivial routing, as in real ckpts
                t.uniform_(-0.05, 0.05)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_init = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    cfg_path = out / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved.setdefault("torch_dtype", "bfloat16")
    if SPECS[name]["kind"] == "deepseek_v3":  # vLLM's loader needs these explicit
        saved.update(topk_method="noaux_tc", scoring_func="sigmoid")
    cfg_path.write_text(json.dumps(saved, indent=1))
    info = dict(want, params=n_params, init_s=round(t_init, 2),
                build_s=round(time.perf_counter() - t0, 2), device=device, reused=False)
    marker.write_text(json.dumps(info, indent=1))
    return info


def _safetensors_headers(ckpt: str | os.PathLike[str]) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def count_params(ckpt: str | os.PathLike[str]) -> dict[str, int]:
    """Parameter counts read from the safetensors headers (no weights loaded).

    ``active``: ``total`` with routed experts counted at ``num_experts_per_tok /
    n_routed_experts`` (MoE; equal to ``total`` for dense models). ``matmul`` /
    ``active_matmul``: the same without the embeddings and the LM head (a prefill applies
    the head to each prompt's last token only).
    """
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    cfg = cfg.get("text_config") or cfg
    shapes = _safetensors_headers(ckpt)
    numel = {k: int(_prod(s)) for k, s in shapes.items()}
    total = sum(numel.values())
    emb = sum(v for k, v in numel.items() if k.endswith("embed_tokens.weight"))
    head = sum(v for k, v in numel.items() if k.startswith("lm_head."))
    experts = sum(v for k, v in numel.items() if ".experts." in k)
    matmul = total - emb - head
    E = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    k = cfg.get("num_experts_per_tok")
    inactive = experts - experts * k // E if experts and E and k else 0
    return {"total": total, "embedding": emb, "lm_head": head, "routed_experts": experts,
            "active": total - inactive, "matmul": matmul, "active_matmul": matmul - inactive}


def _prod(shape: list[int]) -> int:
    p = 1
    for s in shape:
        p *= int(s)
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(SPECS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    info = build(a.model, a.out, device=a.device, seed=a.seed, force=a.force)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
