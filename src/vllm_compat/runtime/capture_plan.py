"""Which capture mode an extraction uses, decided before any engine is built.

Layer ids follow :mod:`vllm_compat.extract.layers` (k = state entering decoder layer k,
L = final pre-norm state). Modes:

* ``"aux"``: vLLM's own EAGLE-3 aux-hidden-state path, configured before torch.compile and
  CUDA-graph capture (see :mod:`.capture_worker`); works under CUDA graphs.
* ``"hooks"``: forward(-pre) hooks on the decoder layers; Python hooks do not run inside a
  compiled graph or under CUDA-graph replay, so this mode forces ``enforce_eager=True``. Used
  when the model has no aux path or its aux path cannot express a requested id.
* ``"native"`` (0.17.1+): ``speculative_config.method="extract_hidden_states"`` with
  ``ExampleHiddenStatesConnector``; allowed where :mod:`.native_probe` finds, on the installed
  vLLM, that the connector keeps the states intact (for an MLA model, refused when it cannot
  tell).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import Sequence

import vllm

from ..resolve import get, probe, sym
from ..errors import UnsupportedFeatureError
from ..target import TargetInfo
from .native_probe import native_path_check

# 0.18.1: EagleModelMixin (index 0 = embeddings, index L = last-layer output) for
# Llama/Qwen2/Qwen3/Qwen3Moe inner models. Absent before (None).
EagleModelMixin = get("EagleModelMixin")
# present in every supported release (optional in the surface: None if a build drops it)
DeepseekV2ForCausalLM = get("DeepseekV2ForCausalLM")
DeepseekV2Model = getattr(sys.modules.get(getattr(DeepseekV2ForCausalLM, "__module__", "")),
                          "DeepseekV2Model", None)

# 0.15.0 added Kimi-K2.5 (vllm#33131); from 0.16 its language_model is a DeepseekV2ForCausalLM,
# from 0.18.1 it delegates set_aux_hidden_state_layers to it (vllm#36361).
KimiK25ForConditionalGeneration = get("KimiK25ForConditionalGeneration")

# Architectures a user may meet on a release that predates them.
ADDED_IN = {"KimiK25ForConditionalGeneration": "0.15.0"}



def deepseek_final_aux() -> bool:
    """vllm#46973 (0.25.0): DeepseekV2Model also captures hidden_states + residual at
    end_layer, after its loop, so its aux path returns the final state L (probed)."""
    return bool(probe("deepseek_aux_final_state"))


# "1": tap L on DeepSeek backbones even where vLLM's aux path returns it (to compare the two).
FORCE_TAP = "VLLM_COMPAT_FINAL_STATE_TAP"


def _model_class(target: TargetInfo) -> type | None:
    try_load = sym("ModelRegistry._try_load_model_cls")
    for arch in target.architectures:
        # _try_load_model_cls(arch) exists with this signature 0.10.2-0.34.0.
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
    if deepseek_backbone(model_cls):
        # DeepseekV2Model: `if idx in aux: aux.append(hidden_states + residual)` before
        # layer idx, residual is None at idx 0 (TypeError), so 0 is out; L from 0.25.0.
        # vllm#46973 (0.25.0) added the final state L
        top = L + 1 if deepseek_final_aux() else L
        return frozenset(range(1, top))
    # Pre-0.18.1 Llama-style loops: before layer idx, `hidden_states + residual` (0 fails,
    # L is never reached). Conservative for any other SupportsEagle3 model.
    return frozenset(range(1, L))


def deepseek_backbone(model_cls: type | None) -> bool:
    """A DeepSeek-V2/V3 decoder (``DeepseekV2Model``) behind this class: DeepseekV2/V3, and
    Kimi-K2.5, whose language model is always built as ``DeepseekV2ForCausalLM``."""
    if model_cls is None:
        return False
    if DeepseekV2ForCausalLM is not None and issubclass(model_cls, DeepseekV2ForCausalLM):
        return True
    return KimiK25ForConditionalGeneration is not None and issubclass(
        model_cls, KimiK25ForConditionalGeneration)


@dataclasses.dataclass(frozen=True)
class Plan:
    mode: str                      # "aux" | "hooks" | "native"
    layer_ids: tuple[int, ...]     # requested order
    native_ids: tuple[int, ...]    # sorted, what the model is configured with (aux/native)
    enforce_eager: bool
    model_cls: str
    note: str = ""
    # L through runtime.final_state_tap (compile-safe), not through vLLM's aux list
    tap_final: bool = False


def plan(target: TargetInfo, layer_ids: Sequence[int], *, backend: str,
         enforce_eager: bool) -> Plan:
    """How to capture ``layer_ids`` of ``target`` on the installed vLLM (see the module doc)."""
    num_layers = target.num_hidden_layers
    cls = _model_class(target)
    if cls is None:
        since = {a: ADDED_IN[a] for a in target.architectures if a in ADDED_IN}
        raise UnsupportedFeatureError(
            f"vLLM {vllm.__version__} has no model class for {target.architectures}"
            + (f" (added in vLLM {', '.join(sorted(set(since.values())))})" if since else "")
            + f": {target.path} cannot run on this release")
    name = cls.__name__
    ids = tuple(layer_ids)
    srt = tuple(sorted(set(ids) - {0}))
    supported = native_aux_ids(cls, num_layers)
    # 0.10.2: execute_model is the whole step and the runner keeps no execute_model_state
    # (the aux states are dropped inside it): only hooks can see them (0.11 split the step).
    if not probe("two_phase_step"):
        supported = frozenset()
    if supported:
        # id 0 (embeddings) is never taken from vLLM's aux list: EagleModelMixin's entry 0
        # is the embeddings tensor itself, which the first fused add-RMSNorm then updates
        # in place as the residual (seen on 0.26.0, eager: rel. error 3.0 vs HF). We
        # recompute it with the model's own embed function in _worker_collect instead.
        supported = supported | {0}
    note = ""
    if backend == "native":
        # 0.17.1 added the extract_hidden_states connector
        if not probe("native_extract_hidden_states"):
            raise ValueError(f"backend='native' needs vLLM 0.17.1+ (extract_hidden_states); "
                             f"installed {vllm.__version__}")
        # Whether vLLM's connector keeps the states intact depends on how this release groups
        # its hidden-state cache layer with the model's KV-cache layers: checked on the
        # installed vLLM (runtime.native_probe), not assumed from the architecture.
        check = native_path_check(target, ids)
        if check.ok is False or (check.ok is None and target.is_mla):
            raise ValueError(
                f"backend='native' is refused for {name} on vLLM {vllm.__version__}: "
                f"{check.reason}; use backend='auto' (vLLM's aux path, compiled)")
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
    if os.environ.get(FORCE_TAP) == "1" and deepseek_backbone(cls):
        supported = supported - {num_layers}  # compare the tap with vLLM's own L
    if backend in ("auto", "aux") and set(ids) <= supported:
        return Plan("aux", ids, srt, enforce_eager, name, note)
    # Before 0.25.0 DeepSeek's aux path stops short of L; the final norm's residual is L, and
    # the tap hands it out under torch.compile and CUDA graphs (0.11.2+: the aux path).
    if (backend in ("auto", "aux") and set(ids) - supported == {num_layers}
            and deepseek_backbone(cls) and supported):
        why = (f"{name}'s aux path on vLLM {vllm.__version__} cannot return {num_layers}: "
               "the final state is tapped from the final norm")
        return Plan("aux", ids, tuple(i for i in srt if i != num_layers), enforce_eager, name,
                    (note + "; " if note else "") + why, tap_final=True)
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
