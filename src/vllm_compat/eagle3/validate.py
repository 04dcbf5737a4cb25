"""Will vLLM serve this EAGLE-3 checkpoint, and serve it right? Pure rule checks (no vLLM import).

:func:`check` compares a speculators-format checkpoint with its target and, when given,
with what the installed vLLM makes of it (a :class:`ServingView`, produced by
``vllm_compat.runtime.speculative``). Each failure is a :class:`Problem` with a stable code and
a message that says what vLLM would do. :func:`validate` loads everything and raises
:class:`CheckpointValidationError` listing every error found.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import VllmCompatError
from .target import TargetInfo, read_target

LAYER_WEIGHTS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
)
REQUIRED_WEIGHTS = ("fc.weight", "norm.weight", "lm_head.weight", *(f"layers.0.{w}" for w in LAYER_WEIGHTS))
OPTIONAL_WEIGHTS = ("d2t", "t2d", "embed_tokens.weight")


class CheckpointValidationError(VllmCompatError, ValueError):
    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"[{p.code}] {p.message}" for p in problems))


@dataclass(frozen=True)
class Problem:
    code: str
    message: str
    error: bool = True


@dataclass
class ServingView:
    """What the installed vLLM builds from the checkpoint (read by :mod:`vllm_compat.runtime.speculative`)."""

    vllm_version: str
    num_speculative_tokens: int
    architectures: list[str]
    draft_vocab_size: int | None
    norm_before_residual: bool
    aux_layer_ids: list[int] | None  # None: vLLM ignores the checkpoint's and uses the target default
    default_aux_layer_ids: list[int]
    fc_input_size: int
    supported_architectures: bool = True
    config_error: str | None = None  # vLLM's own config parsing raised this


@dataclass
class Report:
    checkpoint: str
    problems: list[Problem] = field(default_factory=list)
    serving: ServingView | None = None

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.error]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if not p.error]

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass
class Checkpoint:
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None


def read_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint:
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: no config.json")
    shapes: dict[str, tuple[int, ...]] = {}
    small: dict[str, torch.Tensor] = {}
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                shapes[k] = tuple(h.get_slice(k).get_shape())
                if k in ("d2t", "t2d"):
                    small[k] = h.get_tensor(k)
    return Checkpoint(json.loads((d / "config.json").read_text()), shapes, small.get("d2t"), small.get("t2d"))


def structure_problems(cfg: dict[str, Any]) -> list[Problem]:
    """The keys vLLM's ``SpeculatorsConfig.validate_speculators_config`` requires."""
    out = []
    if cfg.get("speculators_model_type") != "eagle3":
        out.append(Problem("structure", f"speculators_model_type is {cfg.get('speculators_model_type')!r}, expected 'eagle3'"))
    try:
        k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        if not isinstance(k, int) or k < 1:
            out.append(Problem("structure", f"speculators_config.proposal_methods[0].speculative_tokens must be a positive int, got {k!r}"))
    except (KeyError, IndexError, TypeError):
        out.append(Problem("structure", "speculators_config.proposal_methods[0].speculative_tokens is missing"))
    try:
        cfg["speculators_config"]["verifier"]["name_or_path"]
    except (KeyError, TypeError):
        out.append(Problem("structure", "speculators_config.verifier.name_or_path is missing"))
    if not isinstance(cfg.get("transformer_layer_config"), dict):
        out.append(Problem("structure", "transformer_layer_config must be a dict"))
    return out


def _aux_ids(cfg: dict[str, Any], n_layers: int | None, default: list[int] | None) -> list[Problem]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        hint = f" {tuple(default)}" if default else " (2, L//2, L-3)"
        return [Problem("aux_missing", "eagle_aux_hidden_state_layer_ids is missing: vLLM falls back to the "
                        f"target's default layers{hint}, and acceptance collapses if the draft was trained on others")]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return [Problem("aux_invalid", f"eagle_aux_hidden_state_layer_ids must be a list of ints, got {ids!r}")]
    out = []
    if n_layers is not None and n_layers in ids:
        out.append(Problem("aux_final", f"eagle_aux_hidden_state_layer_ids {ids} contains the final layer "
                           f"{n_layers}: that state is the training target, not a draft input"))
    bad = [i for i in ids if i < 1 or (n_layers is not None and i > n_layers)]
    if bad:
        rng = f"1..{n_layers - 1}" if n_layers is not None else ">= 1"
        out.append(Problem("aux_invalid", f"eagle_aux_hidden_state_layer_ids {ids}: {bad} outside {rng} "
                           "(id k is the state entering decoder layer k; 0, the embeddings, crashes vLLM 0.10: it adds a None residual)"))
    if ids != sorted(set(ids)):
        out.append(Problem("aux_invalid", f"eagle_aux_hidden_state_layer_ids {ids} must be strictly increasing: "
                           "vLLM 0.30+ sorts them, so fc would see the layers in another order"))
    return out


def _vocab(ck: Checkpoint, draft_vocab: int | None, target_vocab: int | None) -> list[Problem]:
    out = []
    if not isinstance(draft_vocab, int):
        return [Problem("structure", f"draft_vocab_size must be an int, got {draft_vocab!r}")]
    if target_vocab is not None and draft_vocab > target_vocab:
        out.append(Problem("vocab_size", f"draft_vocab_size {draft_vocab} > target vocab size {target_vocab}"))
    if ck.d2t is None or ck.t2d is None:
        if target_vocab is not None and draft_vocab < target_vocab:
            out.append(Problem("d2t_missing", f"draft_vocab_size {draft_vocab} < target vocab {target_vocab} "
                               "but the checkpoint has no d2t/t2d: vLLM would map draft id i to target id i"))
        return out
    d2t, t2d = ck.d2t, ck.t2d
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (draft_vocab,):
        out.append(Problem("d2t_shape", f"d2t is {str(d2t.dtype).removeprefix('torch.')} {list(d2t.shape)}, "
                           f"expected int64 [{draft_vocab}] (draft_vocab_size)"))
    if t2d.dtype != torch.bool or (target_vocab is not None and tuple(t2d.shape) != (target_vocab,)):
        out.append(Problem("t2d_shape", f"t2d is {str(t2d.dtype).removeprefix('torch.')} {list(t2d.shape)}, "
                           f"expected bool [{target_vocab}] (target vocab size)"))
    if out:
        return out
    if int(t2d.sum()) != draft_vocab:
        out.append(Problem("t2d_sum", f"t2d has {int(t2d.sum())} true entries, expected draft_vocab_size {draft_vocab}"))
        return out
    mapped = torch.arange(draft_vocab) + d2t
    if int(mapped.min()) < 0 or int(mapped.max()) >= t2d.shape[0]:
        out.append(Problem("d2t_t2d_mismatch", f"d2t maps draft ids to target ids outside [0, {t2d.shape[0]})"))
    elif not torch.equal(torch.sort(mapped).values, torch.nonzero(t2d).flatten()):
        out.append(Problem("d2t_t2d_mismatch", "d2t (target = i + d2t[i]) and t2d select different target ids"))
    return out


def _verifier_problems(verifier: dict[str, Any], target: TargetInfo) -> list[Problem]:
    """The draft names the model it was made for (``speculators_config.verifier``); ``vllm serve
    <draft>`` loads that model as the target. Refuse when it is visibly another model than
    ``target``: other architectures, or a local directory holding a different config."""
    out = []
    fix = ("validate against the target the draft was trained for, or re-export the draft "
           f"with verifier={target.path!r} if it was trained on this one")
    archs = list(verifier.get("architectures") or [])
    if archs and target.architectures and archs != target.architectures:
        out.append(Problem("target_arch", f"draft made for a {archs} verifier, the target {target.path} "
                           f"is {target.architectures}: {fix}"))
    name = verifier.get("name_or_path")
    if isinstance(name, str) and name and (Path(name) / "config.json").is_file():
        same_dir = Path(name).resolve() == Path(target.path).resolve()
        if not same_dir:
            try:
                theirs = json.loads((Path(name) / "config.json").read_text())
            except (OSError, ValueError):
                theirs = None
            if theirs != target.config:
                out.append(Problem("verifier_mismatch", f"speculators_config.verifier.name_or_path is "
                                   f"{name}, a different model from the target {target.path}: "
                                   f"`vllm serve` would pair the draft with {name}; {fix}"))
    return out


def check(ck: Checkpoint, target: TargetInfo | None = None, serving: ServingView | None = None) -> list[Problem]:
    cfg = ck.config
    problems = structure_problems(cfg)
    if any(p.code == "structure" for p in problems):
        return problems
    layer = cfg["transformer_layer_config"]
    hidden = layer.get("hidden_size")
    target_hidden = cfg.get("target_hidden_size") or hidden
    draft_vocab = cfg.get("draft_vocab_size")
    n_layers = target.num_hidden_layers if target else None
    default = target.default_aux_layer_ids() if target else None

    if target is not None:
        if target.hidden_size != target_hidden:
            problems.append(Problem("target_hidden", f"draft made for hidden size {target_hidden}, "
                                    f"the target {target.path} has {target.hidden_size}"))
        if layer.get("vocab_size") != target.vocab_size:
            problems.append(Problem("target_vocab", f"draft made for a vocabulary of {layer.get('vocab_size')}, "
                                    f"the target {target.path} has {target.vocab_size}"))
        problems += _verifier_problems(cfg["speculators_config"]["verifier"], target)
    if "norm_before_residual" not in cfg:
        problems.append(Problem("norm_before_residual", "norm_before_residual is absent: vLLM assumes True "
                                "(speculators' own default is False)", error=False))
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(flag):
            problems.append(Problem("unsupported_flag", f"{flag}=true: this validator only knows drafts without it"))

    problems += _aux_ids(cfg, n_layers, default)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    fc = ck.shapes.get("fc.weight")
    if fc is not None and isinstance(target_hidden, int):
        if fc[0] != hidden:
            problems.append(Problem("fc_shape", f"fc.weight is {list(fc)}, its output must be hidden_size {hidden}"))
        if ids and fc[1] != len(ids) * target_hidden:
            problems.append(Problem("aux_count", f"fc.weight takes {fc[1]} inputs = {fc[1] / target_hidden:g} x hidden "
                                    f"{target_hidden}, but eagle_aux_hidden_state_layer_ids lists {len(ids)} layers"))
    lm = ck.shapes.get("lm_head.weight")
    if lm is not None and lm != (draft_vocab, hidden):
        problems.append(Problem("lm_head_shape", f"lm_head.weight is {list(lm)}, expected [draft_vocab_size, hidden] "
                                f"= [{draft_vocab}, {hidden}]"))
    problems += _vocab(ck, draft_vocab, layer.get("vocab_size") if target is None else target.vocab_size)

    names = {n.replace("midlayer.", "layers.0.") for n in ck.shapes}  # vLLM remaps legacy names
    missing = [n for n in REQUIRED_WEIGHTS if n not in names]
    if missing:
        problems.append(Problem("missing_weight", f"weights missing: {missing}"))
    unknown = sorted(names - set(REQUIRED_WEIGHTS) - set(OPTIONAL_WEIGHTS))
    if unknown:
        problems.append(Problem("unexpected_weight", f"weights vLLM's EAGLE-3 loader has no parameter for: {unknown}"))

    if serving is not None:
        problems += check_serving(cfg, ck, serving)
    return problems


def check_serving(cfg: dict[str, Any], ck: Checkpoint, s: ServingView) -> list[Problem]:
    """Compare the checkpoint with what the installed vLLM built from it."""
    v = f"vLLM {s.vllm_version}"
    if s.config_error:
        return [Problem("vllm_config", f"{v} rejects the config: {s.config_error}")]
    out = []
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids and s.aux_layer_ids is None and list(ids) != list(s.default_aux_layer_ids):
        default = s.default_aux_layer_ids or "(2, L//2, L-3)"
        out.append(Problem("aux_ignored", f"{v} ignores eagle_aux_hidden_state_layer_ids and feeds the target's "
                           f"default layers {default}; this draft was trained on {ids}"))
    elif s.aux_layer_ids is not None and ids and list(s.aux_layer_ids) != list(ids):
        out.append(Problem("aux_ignored", f"{v} uses aux layers {s.aux_layer_ids}, the checkpoint lists {ids}"))
    fc = ck.shapes.get("fc.weight")
    if fc is not None and fc[1] != s.fc_input_size:
        out.append(Problem("aux_count_vllm", f"{v} builds fc with {s.fc_input_size} inputs but fc.weight takes {fc[1]} "
                           "(it sizes fc for a different number of aux layers)"))
    if s.draft_vocab_size != cfg.get("draft_vocab_size"):
        out.append(Problem("vllm_config", f"{v} reads draft_vocab_size={s.draft_vocab_size}, "
                           f"config.json says {cfg.get('draft_vocab_size')}"))
    if bool(s.norm_before_residual) != bool(cfg.get("norm_before_residual", True)):
        out.append(Problem("vllm_config", f"{v} uses norm_before_residual={s.norm_before_residual}"))
    if not s.supported_architectures:
        out.append(Problem("vllm_config", f"{v} has no model class for architectures {s.architectures}"))
    return out


def validate(
    checkpoint_dir: str | os.PathLike[str],
    target_dir: str | os.PathLike[str] | None = None,
    *,
    with_vllm: bool | None = None,
    raise_on_error: bool = True,
) -> Report:
    """Check a checkpoint; ``target_dir`` defaults to ``verifier.name_or_path`` when that is a local
    directory. ``with_vllm``: also replay the installed vLLM's loading (default: when installed)."""
    ck = read_checkpoint(checkpoint_dir)
    report = Report(str(checkpoint_dir))
    if target_dir is None:
        try:
            guess = ck.config["speculators_config"]["verifier"]["name_or_path"]
        except (KeyError, TypeError):
            guess = None
        if guess and (Path(guess) / "config.json").is_file():
            target_dir = guess
    target = read_target(target_dir) if target_dir is not None else None
    if with_vllm is None:
        import importlib.util

        with_vllm = importlib.util.find_spec("vllm") is not None
    if with_vllm and not structure_problems(ck.config):
        from ..runtime.speculative import serving_view

        report.serving = ServingView(**serving_view(str(checkpoint_dir),
                                                    str(target_dir) if target_dir else None))
    report.problems = check(ck, target, report.serving)
    if raise_on_error and report.errors:
        raise CheckpointValidationError(report.errors)
    return report
