"""What the installed vLLM makes of a speculators EAGLE-3 checkpoint (imports vLLM).

Runs vLLM's own config path on CPU: the checkpoint's ``config.json`` through
``SpeculatorsConfig`` and, with a local target, a real ``SpeculativeConfig`` (which builds the
draft ``ModelConfig`` exactly as ``vllm serve`` does). What the model class then sizes from
that config (``fc`` width, aux layer ids) is replayed from the rules of the installed
``llama_eagle3``, found by probing its source, because building the model needs a GPU.
The pure checks live in :mod:`vllm_compat.eagle3.validate`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import vllm

from ..resolve import get, sym

_LLAMA_EAGLE3 = "vllm.model_executor.models.llama_eagle3"


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    return Path(spec.origin).read_text() if spec and spec.origin else ""


def speculative_config_dict(config_dict: dict[str, Any]) -> dict[str, Any]:
    """vLLM's validation + translation of the speculators keys into speculative-config keys."""
    sym("SpeculatorsConfig.validate_speculators_config")(config_dict)
    extract = get("SpeculatorsConfig.extract_vllm_speculative_config")
    # 0.11 split the translation out as extract_vllm_speculative_config; 0.10 only has
    # convert_speculators_to_vllm (which also folds in transformer_layer_config).
    if extract is not None:
        return extract(config_dict)
    out = sym("SpeculatorsConfig.convert_speculators_to_vllm")(config_dict)
    out["num_speculative_tokens"] = out.get("num_lookahead_tokens")
    return out


def draft_hf_config(checkpoint_dir: str, target_dir: str | None = None) -> Any:
    """The draft ``PretrainedConfig`` vLLM serves with: via a real ``SpeculativeConfig`` when the
    target is a local directory, else ``SpeculatorsConfig.from_pretrained`` alone."""
    if target_dir is None:
        return sym("SpeculatorsConfig.from_pretrained")(checkpoint_dir)
    from ..scheduling import make_vllm_config

    target = make_vllm_config(target_dir)
    sc = sym("SpeculativeConfig")(
        model=checkpoint_dir, method="eagle3",
        num_speculative_tokens=_num_tokens(checkpoint_dir),
        target_model_config=target.model_config, target_parallel_config=target.parallel_config,
    )
    return sc.draft_model_config.hf_config


def _num_tokens(checkpoint_dir: str) -> int:
    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    return int(speculative_config_dict(cfg)["num_speculative_tokens"])


def fc_input_size(hf: Any) -> int:
    """Input width of ``fc`` as the installed ``Eagle3LlamaForCausalLM`` sizes it."""
    src = _source(_LLAMA_EAGLE3)
    eagle_config = getattr(hf, "eagle_config", None) or {}
    # 0.22 sized fc from num_aux_hidden_states (or the nested eagle_config layer ids);
    # before, fc always took three aux states.
    if "num_aux_hidden_states" in src:
        n = getattr(hf, "num_aux_hidden_states", None)
        if n is None:
            ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
            n = len(ids) if ids else 3
    else:
        n = 3
    hidden = getattr(hf, "target_hidden_size", None) or hf.hidden_size
    return int(hidden) * int(n)


def _supported(architectures: list[str]) -> bool:
    return all(a in sym("ModelRegistry.get_supported_archs")() for a in architectures)


def serving_view(checkpoint_dir: str, target_dir: str | None = None) -> dict[str, Any]:
    """The fields of :class:`vllm_compat.eagle3.validate.ServingView`: what the installed vLLM
    builds from the checkpoint (``config_error`` set when its own config parsing raised)."""
    # vLLM treats a relative path that is not an existing directory as a hub id
    checkpoint_dir = str(Path(checkpoint_dir).resolve())
    target_dir = str(Path(target_dir).resolve()) if target_dir is not None else None
    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    n_layers = None
    if target_dir is not None:
        tcfg = json.loads((Path(target_dir) / "config.json").read_text())
        n_layers = int((tcfg.get("text_config") or tcfg)["num_hidden_layers"])
    default = [2, n_layers // 2, n_layers - 3] if n_layers is not None else []
    try:
        spec = speculative_config_dict(cfg)
        hf = draft_hf_config(checkpoint_dir, target_dir)
    except (ValueError, TypeError, KeyError) as exc:
        return dict(vllm_version=vllm.__version__, num_speculative_tokens=0, architectures=[],
                    draft_vocab_size=None, norm_before_residual=True, aux_layer_ids=None,
                    default_aux_layer_ids=default, fc_input_size=0,
                    config_error=f"{type(exc).__name__}: {exc}")
    # 0.11 started reading the draft's eagle_aux_hidden_state_layer_ids (vllm#25961);
    # 0.10 always feeds the target's get_eagle3_aux_hidden_state_layers() default.
    ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
    archs = list(getattr(hf, "architectures", None) or [])
    return dict(
        vllm_version=vllm.__version__,
        num_speculative_tokens=int(spec["num_speculative_tokens"]),
        architectures=archs,
        draft_vocab_size=getattr(hf, "draft_vocab_size", None),
        norm_before_residual=bool(getattr(hf, "norm_before_residual", False)),
        aux_layer_ids=list(ids) if ids else None,
        default_aux_layer_ids=default,
        fc_input_size=fc_input_size(hf),
        supported_architectures=_supported(archs),
    )
