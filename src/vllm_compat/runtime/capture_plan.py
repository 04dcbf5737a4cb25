"""Which capture mode an extraction uses, decided before any engine is built.

Layer ids follow :mod:`vllm_compat.extract.layers` (k = state entering decoder layer k,
L = final pre-norm state). Modes:

* ``"aux"``: vLLM's own EAGLE-3 aux-hidden-state path, configured before torch.compile and
  CUDA-graph capture (see :mod:`.capture_worker`); works under CUDA graphs.
* ``"hooks"``: forward(-pre) hooks on the decoder layers; Python hooks do not run inside a
  compiled graph or under CUDA-graph replay, so this mode forces ``enforce_eager=True``. Used
  when the model has no aux path or its aux path cannot express a requested id.
* ``"native"`` (0.17.1+): ``speculative_config.method="extract_hidden_states"`` with
  ``ExampleHiddenStatesConnector``; it refuses MLA verifiers (the hidden-state KV group cannot
  be isolated), so MLA models fall back to ``"aux"``.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Mapping, Sequence

import vllm
from packaging.version import Version

VLLM_VERSION = Version(Version(vllm.__version__).base_version)

from ..adapters._resolve import get, sym

# 0.18.1: EagleModelMixin (index 0 = embeddings, index L = last-layer output) for
# Llama/Qwen2/Qwen3/Qwen3Moe inner models. Absent before (None).
EagleModelMixin = get("EagleModelMixin")
# present in every supported release (optional in the surface: None if a build drops it)
DeepseekV2ForCausalLM = get("DeepseekV2ForCausalLM")
DeepseekV2Model = getattr(sys.modules.get(getattr(DeepseekV2ForCausalLM, "__module__", "")),
                          "DeepseekV2Model", None)


def _model_class(model_path: str, cfg: Mapping[str, Any]) -> type | None:
    try_load = sym("ModelRegistry._try_load_model_cls")
    for arch in cfg.get("architectures") or ():
        # _try_load_model_cls(arch) exists with this signature 0.10.2-0.33.0.
        cls = try_load(arch)
        if cls is not None:
            return cls
    return None


def native_aux_ids(model_cls: type | None, num_layers: int) -> frozenset[int]:
    """The ids vLLM's own aux path can return for this model class on this release."""
    L = num_layers
    if model_cls is None or not callable(getattr(model_cls, "set_aux_hidden_state_layers", None)):
        return frozenset()
    mod = sys.modules.get(model_cls.__module__)
    if EagleModelMixin is not None and mod is not None and any(
            isinstance(o, type) and issubclass(o, EagleModelMixin) and o is not EagleModelMixin
            and o.__module__ == mod.__name__ for o in vars(mod).values()):
        # 0.18.1+: _maybe_add_hidden_state(aux, 0, ...) before the loop, idx + 1 after
        # each layer: 0..L all work.
        return frozenset(range(0, L + 1))
    if DeepseekV2ForCausalLM is not None and issubclass(model_cls, DeepseekV2ForCausalLM):
        # DeepseekV2Model: `if idx in aux: aux.append(hidden_states + residual)` before
        # layer idx, residual is None at idx 0 (TypeError), so 0 is out. The end_layer
        # capture (index L) came with vllm#46973 in 0.25.1.
        top = L + 1 if VLLM_VERSION >= Version("0.25.1") else L
        return frozenset(range(1, top))
    # Pre-0.18.1 Llama-style loops: before layer idx, `hidden_states + residual` (0 fails,
    # L is never reached). Conservative for any other SupportsEagle3 model.
    return frozenset(range(1, L))


def is_mla_config(cfg: Mapping[str, Any]) -> bool:
    tc = cfg.get("text_config") if "kv_lora_rank" not in cfg else cfg
    return bool((tc or {}).get("kv_lora_rank"))


@dataclasses.dataclass(frozen=True)
class Plan:
    mode: str                      # "aux" | "hooks" | "native"
    layer_ids: tuple[int, ...]     # requested order
    native_ids: tuple[int, ...]    # sorted, what the model is configured with (aux/native)
    enforce_eager: bool
    model_cls: str
    note: str = ""


def plan(model_path: str, cfg: Mapping[str, Any], layer_ids: Sequence[int], num_layers: int,
         *, backend: str, enforce_eager: bool) -> Plan:
    cls = _model_class(model_path, cfg)
    name = cls.__name__ if cls is not None else "?"
    ids = tuple(layer_ids)
    srt = tuple(sorted(set(ids) - {0}))
    supported = native_aux_ids(cls, num_layers)
    # 0.10.2: execute_model is the whole step and the runner keeps no execute_model_state
    # (the aux states are dropped inside it): only hooks can see them (drift map E.2).
    if VLLM_VERSION < Version("0.11.2"):
        supported = frozenset()
    if supported:
        # id 0 (embeddings) is never taken from vLLM's aux list: EagleModelMixin's entry 0
        # is the embeddings tensor itself, which the first fused add-RMSNorm then updates
        # in place as the residual (seen on 0.26.0, eager: rel. error 3.0 vs HF). We
        # recompute it with the model's own embed function in _worker_collect instead.
        supported = supported | {0}
    note = ""
    if backend == "native":
        if VLLM_VERSION < Version("0.17.1"):
            raise ValueError(f"backend='native' needs vLLM 0.17.1+ (extract_hidden_states); "
                             f"installed {vllm.__version__}")
        if is_mla_config(cfg):
            note = ("backend='native' refuses MLA models (ExampleHiddenStatesConnector cannot "
                    "isolate the hidden-state KV group: 'MLA verifiers are unsupported'); "
                    "falling back to backend='aux'")
            warnings.warn(note, stacklevel=3)
            backend = "auto"
        elif not set(ids) <= supported:
            raise ValueError(f"backend='native': {name} on vLLM {vllm.__version__} cannot "
                             f"return layer ids {sorted(set(ids) - supported)}")
        elif 0 in ids:
            raise ValueError(
                "backend='native' cannot return layer id 0: vLLM's aux entry 0 is the "
                "embeddings tensor that the first fused add-RMSNorm updates in place as the "
                "residual; use backend='auto' (it recomputes the embeddings)")
        else:
            return Plan("native", ids, srt, enforce_eager, name)
    if backend in ("auto", "aux") and set(ids) <= supported:
        return Plan("aux", ids, srt, enforce_eager, name, note)
    if backend == "aux":
        raise ValueError(
            f"backend='aux': vLLM {vllm.__version__}'s aux path of {name} cannot return layer "
            f"ids {sorted(set(ids) - supported)}; use backend='auto' or 'hooks'")
    if backend not in ("auto", "hooks"):
        raise ValueError(f"unknown backend {backend!r}: auto, aux, hooks or native")
    why = ("backend='hooks'" if backend == "hooks" else
           f"{name}'s aux path on vLLM {vllm.__version__} cannot return "
           f"{sorted(set(ids) - supported)}")
    msg = f"{why}: capturing with forward hooks"
    if not enforce_eager:
        msg += ", which do not run under torch.compile / CUDA graphs, so enforce_eager=True is forced"
        warnings.warn(msg, stacklevel=3)
    if backend == "auto" or not enforce_eager:  # say why auto chose hooks, even when eager anyway
        note = (note + "; " if note else "") + msg
    return Plan("hooks", ids, (), True, name, note)
