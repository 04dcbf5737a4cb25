"""Tensors of a Kimi-K2.5 test checkpoint, under the real checkpoint's names.

Text weights are handled under transformers' ``DeepseekV3ForCausalLM`` names (``model.*``,
``lm_head.weight``) with one module per routed expert, and stored as
``language_model.model.*`` / ``language_model.lm_head.weight``. transformers 5 keeps the
experts of a layer in two 3-D tensors (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]); :func:`split_experts` and :func:`fuse_experts` convert.
The vision tower (MoonViT) and projector are random: nothing here trains them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from . import int4
from .config import INT4_GROUP_SIZE, KimiK25Shape
from .tokenizer import VOCAB_SIZE

TEXT_PREFIX = "language_model."
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PROJS = ("gate_proj", "up_proj", "down_proj")


def text_shapes(shape: KimiK25Shape) -> dict[str, tuple[int, ...]]:
    """Every text tensor of ``DeepseekV3ForCausalLM``, one module per expert."""
    s, H = shape, shape.hidden_size
    heads = s.num_attention_heads
    qk_head_dim, kv_head_dim = s.qk_nope_head_dim + s.qk_rope_head_dim, s.qk_nope_head_dim + s.v_head_dim
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB_SIZE, H), "model.norm.weight": (H,),
        "lm_head.weight": (VOCAB_SIZE, H)}
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_a_proj.weight": (s.q_lora_rank, H),
            p + "self_attn.q_a_layernorm.weight": (s.q_lora_rank,),
            p + "self_attn.q_b_proj.weight": (heads * qk_head_dim, s.q_lora_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": (s.kv_lora_rank + s.qk_rope_head_dim, H),
            p + "self_attn.kv_a_layernorm.weight": (s.kv_lora_rank,),
            p + "self_attn.kv_b_proj.weight": (heads * kv_head_dim, s.kv_lora_rank),
            p + "self_attn.o_proj.weight": (H, heads * s.v_head_dim)})
        if i < s.first_k_dense_replace:
            out.update(_mlp(p + "mlp.", H, s.intermediate_size))
            continue
        E, shared = s.n_routed_experts, s.moe_intermediate_size * s.n_shared_experts
        out.update({p + "mlp.gate.weight": (E, H), p + "mlp.gate.e_score_correction_bias": (E,)})
        out.update(_mlp(p + "mlp.shared_experts.", H, shared))
        for e in range(E):
            out.update(_mlp(f"{p}mlp.experts.{e}.", H, s.moe_intermediate_size))
    return out


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def vision_shapes(shape: KimiK25Shape) -> dict[str, tuple[int, ...]]:
    """MoonViT and the patch-merger projector (2 x 2 merge), under the checkpoint's names."""
    Hv, Iv = shape.vision_hidden_size, shape.vision_intermediate_size
    merged = 4 * Hv
    out: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (Hv, 3, 14, 14),
        "vision_tower.patch_embed.proj.bias": (Hv,),
        "vision_tower.patch_embed.pos_emb.weight": (64, 64, Hv),
        "vision_tower.encoder.final_layernorm.weight": (Hv,),
        "vision_tower.encoder.final_layernorm.bias": (Hv,),
        "mm_projector.pre_norm.weight": (Hv,), "mm_projector.pre_norm.bias": (Hv,),
        "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (shape.hidden_size, merged),
        "mm_projector.proj.2.bias": (shape.hidden_size,)}
    for b in range(shape.vision_num_layers):
        p = f"vision_tower.encoder.blocks.{b}."
        for name, dims in {"norm0": (Hv,), "norm1": (Hv,)}.items():
            out.update({p + name + ".weight": dims, p + name + ".bias": dims})
        for name, (o, i) in {"wqkv": (3 * Hv, Hv), "wo": (Hv, Hv),
                             "mlp.fc0": (Iv, Hv), "mlp.fc1": (Hv, Iv)}.items():
            out.update({p + name + ".weight": (o, i), p + name + ".bias": (o,)})
    return out


def random_tensors(shapes: Mapping[str, tuple[int, ...]], gen: torch.Generator, *,
                   std: float = 0.02, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded init: norms at one (their biases at zero), linear weights and biases ~ N(0, std),
    routing biases ~ U(-0.05, 0.05) (non-trivial, as in real checkpoints), the LM head x10
    so a random model's logits are not near-uniform."""
    out = {}
    dev = gen.device  # a CUDA generator draws on the GPU (the same seed gives other values)
    for name in sorted(shapes):
        dims = shapes[name]
        if re.search(r"(norm\d?|layernorm|pre_norm)\.weight$", name):
            t = torch.ones(dims, dtype=dtype)
        elif re.search(r"(norm\d?|layernorm|pre_norm)\.bias$", name):
            t = torch.zeros(dims, dtype=dtype)
        elif name.endswith("e_score_correction_bias"):
            t = (torch.rand(dims, generator=gen, device=dev) * 0.1 - 0.05).cpu()  # fp32 in the checkpoint
        else:
            t = torch.randn(dims, generator=gen, dtype=dtype, device=dev)
            t = t.mul_(std * 10 if name == "lm_head.weight" else std).cpu()
        out[name] = t
    return out


def split_experts(state_dict: Mapping[str, torch.Tensor],
                  shape: KimiK25Shape) -> dict[str, torch.Tensor]:
    """transformers-5 fused expert tensors -> one ``gate/up/down_proj.weight`` per expert."""
    out: dict[str, torch.Tensor] = {}
    inter = shape.moe_intermediate_size
    for name, t in state_dict.items():
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def fuse_experts(state_dict: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """One tensor per expert -> transformers-5 ``experts.gate_up_proj`` / ``experts.down_proj``."""
    out: dict[str, torch.Tensor] = {}
    layers = sorted({int(m.group(1)) for k in state_dict if (m := _EXPERT.match(k))})
    for name, t in state_dict.items():
        if not _EXPERT.match(name):
            out[name] = t
    for i in layers:
        p = f"model.layers.{i}.mlp.experts."
        w = {proj: [state_dict[f"{p}{e}.{proj}.weight"] for e in range(num_experts)]
             for proj in _PROJS}
        out[p + "gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(w["gate_proj"], w["up_proj"])])
        out[p + "down_proj"] = torch.stack(w["down_proj"])
    return out


def check_text_state_dict(state_dict: Mapping[str, torch.Tensor], shape: KimiK25Shape) -> None:
    want = text_shapes(shape)
    have = {k: tuple(v.shape) for k, v in state_dict.items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    wrong = sorted(f"{k}: {have[k]} != {want[k]}"
                   for k in set(want) & set(have) if have[k] != want[k])
    if missing or extra or wrong:
        raise ValueError(f"the text weights do not fit {shape}: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}")


def kimi_text_tensors(state_dict: Mapping[str, torch.Tensor], shape: KimiK25Shape,
                      *, quantize_experts: bool) -> dict[str, torch.Tensor]:
    """HF ``DeepseekV3ForCausalLM`` weights -> the checkpoint's text tensors: bf16, routing
    bias fp32, routed experts INT4 (``pack-quantized``, group 32) when ``quantize_experts``."""
    sd = split_experts({k: v.detach().cpu() for k, v in state_dict.items()}, shape)
    check_text_state_dict(sd, shape)
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        key = TEXT_PREFIX + name
        if name.endswith("e_score_correction_bias"):
            out[key] = t.float().contiguous()
        elif quantize_experts and _EXPERT.match(name):
            base = key[: -len("weight")]
            out.update({base + k: v for k, v in int4.compress(t, INT4_GROUP_SIZE).items()})
        else:
            out[key] = t.to(torch.bfloat16).contiguous()
    return out


def text_state_dict_from_checkpoint(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's text tensors -> HF names in fp32, INT4 experts dequantized exactly."""
    out: dict[str, torch.Tensor] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if not key.startswith(TEXT_PREFIX):
            continue
        name = key[len(TEXT_PREFIX):]
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            if name.endswith(suffix):
                packed.setdefault(name[: -len(suffix)] + "weight", {})[suffix] = t
                break
        else:
            out[name] = t.float()
    for name, parts in packed.items():
        out[name] = int4.decompress(parts)
    return out
