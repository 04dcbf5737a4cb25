"""Layer-index convention and converters (pure Python: no vLLM, no torch).

Our convention (the one vLLM's EAGLE-3 capture uses from 0.18.1, and SafeAILab EAGLE):

* ``k`` (``0 <= k < L``) is the residual-stream state *entering* decoder layer ``k``;
  ``k = 0`` is the embeddings output.
* ``k = L`` (``L = num_hidden_layers``) is the last decoder layer's output *before* the
  final norm (vLLM: ``hidden_states + residual`` before ``model.norm``).

Other conventions:

* HF transformers ``output_hidden_states``: ``hidden_states[i]`` is the input of layer
  ``i`` for ``i < L`` (so HF ``i`` == our ``i``), but ``hidden_states[L]`` is AFTER the
  final norm: ``transformers.utils.output_capturing.capture_outputs`` (5.x; older
  releases appended ``all_hidden_states`` after ``self.norm`` in ``LlamaModel.forward``)
  replaces the last entry with ``last_hidden_state`` unless the config sets
  ``tie_last_hidden_states=False``. HF index ``L`` therefore has no equivalent here
  unless ``tied_last=False``.
* speculators 0.3/0.4 (``VllmHiddenStatesGenerator``): id ``k`` is the *output* of layer
  ``k`` (their patched loop stores ``hidden_states + residual`` after the layer), i.e.
  our ``k + 1``; their default ``[2, L//2, L-3, L-1]`` is our ``[3, L//2+1, L-2, L]``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ..errors import InvalidLayerIdError

# config.json readers, kept importable from here
from ..target import hidden_size_from_config, num_layers_from_config, read_model_config

__all__ = [
    "SPECULATORS_OFFSET", "eagle3_default_aux", "eagle3_default_layers", "from_hf_indices", "from_speculators_indices",
    "num_layers_from_config", "hidden_size_from_config", "read_model_config",
    "to_speculators_indices", "validate_layer_ids",
]


# speculators 0.3/0.4 id i (output of decoder layer i) is this convention's i + 1
SPECULATORS_OFFSET = 1


def eagle3_default_aux(num_layers: int) -> tuple[int, int, int]:
    """The EAGLE-3 aux formula ``(2, L//2, L-3)`` as vLLM has it, duplicates kept (tiny
    models): the one place the formula is written; :func:`eagle3_default_layers` and
    :mod:`vllm_compat.speculators.layers` build on it."""
    L = _as_int(num_layers, "num_layers")
    return (2, L // 2, L - 3)


def _as_int(value: Any, what: str, exc: type[ValueError] = InvalidLayerIdError) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise exc(f"{what} must be an integer, got {value!r}")
    return int(value.__index__())


def _valid_range(L: int) -> str:
    return f"valid ids are 0..{L} (0 = embeddings output, {L} = final pre-norm state)"


def validate_layer_ids(layer_ids: Iterable[Any], num_layers: int) -> tuple[int, ...]:
    """``layer_ids`` as a tuple of ints, each in ``[0, num_layers]`` and unique.

    Raises :class:`~vllm_compat.errors.InvalidLayerIdError` (a ``ValueError``) naming the
    offending value (negative, above ``num_layers``, duplicated, not an integer) or an empty
    selection, with the valid range. Order is kept.
    """
    L = _as_int(num_layers, "num_layers")
    if L < 1:
        raise InvalidLayerIdError(f"num_layers must be >= 1, got {L}")
    if isinstance(layer_ids, (str, bytes)) or not hasattr(layer_ids, "__iter__"):
        raise InvalidLayerIdError(f"layer ids must be a sequence of ints, got {layer_ids!r}")
    out: list[int] = []
    for raw in layer_ids:
        k = _as_int(raw, "layer id")
        if k < 0:
            raise InvalidLayerIdError(
                f"layer id {k} is negative: {_valid_range(L)}; for HF-style indices counted "
                "from the end use from_hf_indices()")
        if k > L:
            raise InvalidLayerIdError(
                f"layer id {k} is above num_hidden_layers={L}: the target has {L} decoder "
                f"layers, so {_valid_range(L)}")
        if k in out:
            raise InvalidLayerIdError(
                f"layer id {k} is requested more than once (positions {out.index(k)} and "
                f"{len(out)}): list each layer once")
        out.append(k)
    if not out:
        raise InvalidLayerIdError(
            f"no layer ids requested: pass at least one id ({_valid_range(L)}), or None for the "
            "EAGLE-3 default")
    return tuple(out)


def eagle3_default_layers(num_layers: int, *, include_final: bool = True) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default ``(2, L//2, L-3)`` plus ``L`` (the final pre-norm state).

    For tiny models where these collide (L < 8) the duplicates are dropped, keeping order.
    """
    L = _as_int(num_layers, "num_layers")
    if L < 3:
        raise InvalidLayerIdError(f"the EAGLE-3 default set needs num_layers >= 3, got {L}: "
                                  f"pass layer ids explicitly ({_valid_range(L)})")
    ids = [*eagle3_default_aux(L)] + ([L] if include_final else [])
    out: list[int] = []
    for k in ids:
        if k not in out:
            out.append(k)
    return tuple(out)


def from_hf_indices(indices: Iterable[Any], num_layers: int, *,
                    tied_last: bool = True) -> tuple[int, ...]:
    """Our ids for HF ``output_hidden_states`` indices (negative ones count from the end).

    HF ``i < L`` is our ``i``. HF ``L`` (or ``-1``) is the *post-norm* state when
    ``tied_last`` (the transformers default), which this convention cannot express:
    ``ValueError``. With ``tied_last=False`` (``config.tie_last_hidden_states=False``)
    HF ``L`` is the pre-norm last-layer output, our ``L``.
    """
    L = _as_int(num_layers, "num_layers")
    out = []
    for raw in indices:
        i = _as_int(raw, "HF hidden_states index")
        j = i + L + 1 if i < 0 else i
        if not 0 <= j <= L:
            raise InvalidLayerIdError(f"HF hidden_states index {i} is out of range for "
                                      f"{L} layers ({L + 1} entries): valid indices are "
                                      f"{-(L + 1)}..{L}")
        if j == L and tied_last:
            raise InvalidLayerIdError(
                f"HF hidden_states index {i} is the state AFTER the final norm; this "
                f"convention's {L} is the pre-norm state (pass tied_last=False if the "
                "model was run with tie_last_hidden_states=False)")
        out.append(j)
    return validate_layer_ids(out, L)


def from_speculators_indices(indices: Iterable[Any], num_layers: int) -> tuple[int, ...]:
    """Our ids for speculators 0.3/0.4 ``layer_ids`` (output of layer k == our k + 1)."""
    L = _as_int(num_layers, "num_layers")
    out = []
    for raw in indices:
        k = _as_int(raw, "speculators layer id")
        if not 0 <= k < L:
            raise InvalidLayerIdError(f"speculators layer id {k} is out of range 0..{L - 1} "
                                      f"(id k is the output of decoder layer k; the target has "
                                      f"{L} decoder layers)")
        out.append(k + SPECULATORS_OFFSET)
    return validate_layer_ids(out, L)


def to_speculators_indices(layer_ids: Iterable[Any], num_layers: int) -> tuple[int, ...]:
    """Inverse of :func:`from_speculators_indices` (our 0, the embeddings, has none)."""
    ids = validate_layer_ids(layer_ids, num_layers)
    if 0 in ids:
        raise InvalidLayerIdError("layer id 0 (embeddings) has no speculators 0.3/0.4 "
                                  "equivalent: their ids start at the output of layer 0 (our 1)")
    return tuple(k - SPECULATORS_OFFSET for k in ids)


def resolve_layer_ids(layer_ids: Sequence[Any] | None, num_layers: int) -> tuple[int, ...]:
    """``layer_ids`` validated, or the EAGLE-3 default set plus ``L`` when None."""
    if layer_ids is None:
        return eagle3_default_layers(num_layers)
    return validate_layer_ids(layer_ids, num_layers)
