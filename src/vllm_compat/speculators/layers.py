"""Layer-id numberings: speculators 0.3/0.4 (the drop-in's default) versus vLLM / EAGLE-3.

vLLM's EAGLE-3 aux capture (and vllm_compat.extract, SafeAILab EAGLE, SGLang, HF
``output_hidden_states[k]``) number hidden states by the decoder layer they *enter*:

    k = 0       the embeddings (state entering layer 0)
    k (0<k<L)   the residual stream entering decoder layer k (= output of layer k-1)
    k = L       the final pre-norm state (output of the last layer, before the model norm)

speculators 0.3.0-0.4.0.1's ``HiddenStatesWorkerExtension`` stored ``hidden + residual``
*after* layer i, i.e. speculators id i == vLLM id i + 1, speculators ids in [0, L-1]. Its
default ``[2, L//2, L-3, L-1]`` is vLLM's ``[3, L//2+1, L-2, L]``: the last slot (the
verifier's final state) is the same, the three EAGLE-3 aux states are one layer deeper than
the ``(2, L//2, L-3)`` that vLLM feeds an EAGLE-3 draft at serving time. Its capture loop
also tested ``layer index in frozenset(layer_ids)``, so it returned one state per distinct
id, in ascending layer order, whatever order the ids came in.

``VllmHiddenStatesGenerator`` reads ids the speculators way unless told otherwise
(``layer_convention="vllm"``). The ``legacy`` names below are the speculators numbering.

Pure arithmetic, no torch, no vLLM. The numbering itself (the EAGLE-3 default formula, the
one-layer offset between the two conventions) lives in :mod:`vllm_compat.extract.layers`;
this module adds speculators' spellings, defaults and messages on top of it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

from ..extract.layers import SPECULATORS_OFFSET, eagle3_default_aux

SPECULATORS = "speculators"  # id i = output of decoder layer i (speculators 0.3/0.4)
VLLM = "vllm"  # id k = state entering decoder layer k (vLLM / EAGLE-3)
CONVENTIONS = (SPECULATORS, VLLM)

SPECULATORS_NUMBERING_WARNING = (
    "layer_ids follow speculators 0.3/0.4's numbering (id i = output of decoder layer i), so "
    "these hidden states are one layer deeper than what vLLM feeds an EAGLE-3 draft for the "
    "same ids at serving time; pass layer_convention='vllm' (CLI: --layer-convention vllm) "
    "for vLLM's numbering, or layer_convention='speculators' to keep this one without this "
    "warning."
)


class LayerConventionWarning(UserWarning):
    """The speculators 0.3/0.4 layer numbering was used without being asked for."""


_warned = False  # the warning is shown once per process


def choose_convention(layer_convention: str | None = None,
                      legacy_layer_indices: bool | None = None) -> tuple[str, bool]:
    """``(convention, explicit)`` from the two spellings of the same choice.

    ``layer_convention`` is ``"speculators"`` or ``"vllm"``; ``legacy_layer_indices=True``
    means ``"speculators"`` and ``False`` means ``"vllm"`` (the keyword of earlier
    vllm_compat releases). Neither given: ``"speculators"``, not explicit. Both given and
    naming different numberings: ``ValueError``.
    """
    if layer_convention is not None and layer_convention not in CONVENTIONS:
        raise ValueError(f"layer_convention must be 'speculators' or 'vllm', "
                         f"got {layer_convention!r}")
    if legacy_layer_indices is not None and not isinstance(legacy_layer_indices, bool):
        raise ValueError(f"legacy_layer_indices must be True, False or None, "
                         f"got {legacy_layer_indices!r}")
    from_legacy_flag = (None if legacy_layer_indices is None
                        else SPECULATORS if legacy_layer_indices else VLLM)
    if None not in (layer_convention, from_legacy_flag) and layer_convention != from_legacy_flag:
        raise ValueError(
            f"layer_convention={layer_convention!r} contradicts "
            f"legacy_layer_indices={legacy_layer_indices!r} (which means {from_legacy_flag!r}); "
            "pass only layer_convention")
    chosen = layer_convention or from_legacy_flag
    return (chosen or SPECULATORS), chosen is not None


def warn_speculators_numbering_once(stacklevel: int = 2) -> bool:
    """Emit :data:`SPECULATORS_NUMBERING_WARNING` the first time in this process.

    Returns whether it was emitted now.
    """
    global _warned
    if _warned:
        return False
    _warned = True
    warnings.warn(SPECULATORS_NUMBERING_WARNING, LayerConventionWarning,
                  stacklevel=stacklevel + 1)
    return True


def _ints(ids: Iterable[int], what: str) -> list[int]:
    out = []
    for i in ids:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise ValueError(f"{what}: {i!r} is not an integer layer id")
        out.append(int(i))
    return out


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default in vLLM's numbering: aux ``(2, L//2, L-3)`` plus final ``L``.

    This is the list speculators >= 0.5 asks vLLM's ``extract_hidden_states`` for.
    """
    _check_num_layers(num_layers)
    return [*eagle3_default_aux(num_layers), num_layers]


def legacy_default_layer_ids(num_layers: int) -> list[int]:
    """speculators 0.3/0.4's default ``[2, L//2, L-3, L-1]`` (speculators numbering)."""
    _check_num_layers(num_layers)
    return [*eagle3_default_aux(num_layers), num_layers - 1]


def from_legacy(layer_ids: Sequence[int], num_layers: int | None = None) -> list[int]:
    """speculators 0.3/0.4 ids (output of layer i) -> vLLM ids (state entering layer i+1)."""
    ids = _ints(layer_ids, "layer_ids")
    if num_layers is not None:
        validate_legacy(ids, num_layers)
    return [i + SPECULATORS_OFFSET for i in ids]


def to_legacy(layer_ids: Sequence[int], num_layers: int | None = None) -> list[int]:
    """vLLM ids -> speculators 0.3/0.4 ids. Id 0 (the embeddings) has no speculators id."""
    ids = _ints(layer_ids, "layer_ids")
    if num_layers is not None:
        validate(ids, num_layers)
    if any(i == 0 for i in ids):
        raise ValueError("layer id 0 (the embeddings) cannot be expressed in the "
                         "speculators 0.3/0.4 numbering (its ids start after layer 0)")
    return [i - SPECULATORS_OFFSET for i in ids]


def validate(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """vLLM ids must lie in [0, L]."""
    ids = _ints(layer_ids, "layer_ids")
    _check_num_layers(num_layers)
    if not ids:
        raise ValueError("layer_ids is empty: ask for at least one hidden state")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"layer ids {bad} out of bounds [0, {num_layers}] (state entering decoder layer k; "
            f"{num_layers} = final pre-norm state; vLLM numbering, layer_convention='vllm'). "
            "For speculators 0.3/0.4 ids, pass layer_convention='speculators'"
        )
    return ids


def validate_legacy(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """speculators ids must lie in [0, L-1] (what speculators 0.3/0.4 accepted, same message)."""
    ids = _ints(layer_ids, "layer_ids")
    _check_num_layers(num_layers)
    if not ids:
        raise ValueError("layer_ids is empty: ask for at least one hidden state")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"Layer index {bad[0]} out of bounds [0, {num_layers - 1}] "
            "(speculators 0.3/0.4 numbering: output of decoder layer i; for vLLM's numbering "
            "pass layer_convention='vllm')"
        )
    return ids


def _check_num_layers(num_layers: int) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
