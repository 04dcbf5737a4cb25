"""Random-weight checkpoints for the GPU extraction benchmark (built, not downloaded).

    python -m bench.gpu_models --model llama-1b --out /tmp/vllm-compat-bench/llama-1b

Shapes (:data:`SPECS`): ``llama-1b`` (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocab 32000), ``llama-8b`` (Llama-3.1-8B's dimensions), ``deepseek-tiny``
(MLA + MoE, scaled down), ``llama-tiny`` (CPU tests), all built by
:func:`vllm_compat.testing.models.build_model` on the target device in bf16 with
transformers' own init (an 8B shape is a few GPU kernels); and ``kimi-tp8``, a Kimi-K2.5
checkpoint (:mod:`vllm_compat.testing.kimi_k25`) at the real model's per-GPU widths under
tensor parallelism 8. A finished build leaves ``.bench-spec.json``; a second call with the
same spec reuses the directory.
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

# The benchmark's models: shapes of vllm_compat.testing.models, and a Kimi-K2.5-shaped
# model at the real model's per-GPU widths under tensor parallelism 8 (hidden 7168, 8 heads,
# expert width 256, MLA 512/64), fewer layers and experts, INT4 routed experts, so the GPU and
# not the engine loop binds.
SPECS: dict[str, dict[str, Any]] = {
    "llama-1b": {"shape": "llama-1b"},
    "llama-8b": {"shape": "llama-8b"},
    "deepseek-tiny": {"shape": "deepseek-tiny"},
    "llama-tiny": {"shape": "llama-tiny"},
    "kimi-tp8": {"kimi_k25": dict(variant="int4", num_layers=12, hidden_size=7168,
                                  intermediate_size=2304, num_attention_heads=8, q_lora_rank=1536,
                                  n_routed_experts=48, num_experts_per_tok=8,
                                  moe_intermediate_size=256)},
}
SPEC_FILE = ".bench-spec.json"


def make_config(name: str) -> Any:
    from vllm_compat.testing.models import model_config

    return model_config(SPECS[name]["shape"])


def build(name: str, out: str | os.PathLike[str], *, device: str = "cuda", seed: int = 0,
          force: bool = False) -> dict[str, Any]:
    """Save ``name``'s random checkpoint in ``out`` (safetensors); returns build info. A build
    with the same spec already there is kept."""
    from vllm_compat.testing.models import SHAPES, build_model

    out = Path(out)
    spec = SPECS[name]
    want = {"name": name, "spec": SHAPES.get(spec.get("shape", ""), spec), "seed": seed}
    if "kimi_k25" in spec:  # its weights are drawn on `device`: another device, other weights
        want["device"] = device
    marker = out / SPEC_FILE
    if not force and marker.is_file():
        have = json.loads(marker.read_text())
        if {k: have.get(k) for k in want} == json.loads(json.dumps(want)):
            return dict(have, reused=True)
    t0 = time.perf_counter()
    if "kimi_k25" in spec:
        from vllm_compat.testing.kimi_k25 import write_kimi_k25_checkpoint

        write_kimi_k25_checkpoint(out, seed=seed, image_processor=True, device=device, **spec["kimi_k25"])
    else:
        build_model(spec["shape"], out, seed=seed, device=device)
    info = dict(want, params=count_params(out)["total"], build_s=round(time.perf_counter() - t0, 2),
                device=device, reused=False)
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
    numel = {k: _weights(k, s) for k, s in shapes.items()}
    total = sum(numel.values())
    emb = sum(v for k, v in numel.items() if k.endswith("embed_tokens.weight"))
    head = sum(v for k, v in numel.items() if k.endswith("lm_head.weight"))  # language_model.lm_head
    experts = sum(v for k, v in numel.items() if ".experts." in k)
    matmul = total - emb - head
    E = cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    k = cfg.get("num_experts_per_tok")
    inactive = experts - experts * k // E if experts and E and k else 0
    return {"total": total, "embedding": emb, "lm_head": head, "routed_experts": experts,
            "active": total - inactive, "matmul": matmul, "active_matmul": matmul - inactive}


def _weights(name: str, shape: list[int]) -> int:
    """Weights a tensor stands for: compressed-tensors INT4 packs 8 in each int32 of
    ``weight_packed``; its scales and shapes are no weights."""
    if name.endswith(("weight_scale", "weight_shape")):
        return 0
    return _prod(shape) * (8 if name.endswith("weight_packed") else 1)


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
