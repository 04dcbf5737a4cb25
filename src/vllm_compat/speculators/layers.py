"""Layer-id conventions: speculators 0.3/0.4 ("legacy") versus vLLM / EAGLE-3.

vllm_compat (and vLLM's EAGLE-3 aux capture, SafeAILab EAGLE, SGLang, HF
``output_hidden_states[k]``) number hidden states by the decoder layer they *enter*:

    k = 0       the embeddings (state entering layer 0)
    k (0<k<L)   the residual stream entering decoder layer k (= output of layer k-1)
    k = L       the final pre-norm state (output of the last layer, before the model norm)

speculators 0.3.0-0.4.0.1's ``HiddenStatesWorkerExtension`` stored ``hidden + residual``
*after* layer i, i.e. legacy id i == canonical id i + 1, legacy ids in [0, L-1]. Its default
``[2, L//2, L-3, L-1]`` is canonical ``[3, L//2+1, L-2, L]``: the last slot (the verifier's
final state) is the same, the three EAGLE-3 aux states are one layer deeper than the
``(2, L//2, L-3)`` that vLLM feeds an EAGLE-3 draft at serving time.

Pure arithmetic, no torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def _ints(ids: Iterable[int], what: str) -> list[int]:
    out = []
    for i in ids:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise ValueError(f"{what}: {i!r} is not an integer layer id")
        out.append(int(i))
    return out


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 default in the canonical convention: aux ``(2, L//2, L-3)`` plus final ``L``.

    This is the list speculators >= 0.5 asks vLLM's ``extract_hidden_states`` for.
    """
    _check_num_layers(num_layers)
    return [2, num_layers // 2, num_layers - 3, num_layers]


def legacy_default_layer_ids(num_layers: int) -> list[int]:
    """speculators 0.3/0.4's default ``[2, L//2, L-3, L-1]`` (legacy convention)."""
    _check_num_layers(num_layers)
    return [2, num_layers // 2, num_layers - 3, num_layers - 1]


def from_legacy(layer_ids: Sequence[int], num_layers: int | None = None) -> list[int]:
    """speculators 0.3/0.4 ids (output of layer i) -> canonical ids (state entering layer i+1)."""
    ids = _ints(layer_ids, "legacy layer_ids")
    if num_layers is not None:
        validate_legacy(ids, num_layers)
    return [i + 1 for i in ids]


def to_legacy(layer_ids: Sequence[int], num_layers: int | None = None) -> list[int]:
    """Canonical ids -> speculators 0.3/0.4 ids. Id 0 (the embeddings) has no legacy id."""
    ids = _ints(layer_ids, "layer_ids")
    if num_layers is not None:
        validate(ids, num_layers)
    if any(i == 0 for i in ids):
        raise ValueError("layer id 0 (the embeddings) cannot be expressed in the legacy "
                         "speculators 0.3/0.4 convention (its ids start after layer 0)")
    return [i - 1 for i in ids]


def validate(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Canonical ids must lie in [0, L]."""
    ids = _ints(layer_ids, "layer_ids")
    _check_num_layers(num_layers)
    if not ids:
        raise ValueError("layer_ids is empty: ask for at least one hidden state")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"layer ids {bad} out of bounds [0, {num_layers}] (state entering decoder layer k; "
            f"{num_layers} = final pre-norm state). For speculators 0.3/0.4 ids, pass "
            "legacy_layer_indices=True"
        )
    return ids


def validate_legacy(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Legacy ids must lie in [0, L-1] (what speculators 0.3/0.4 accepted)."""
    ids = _ints(layer_ids, "legacy layer_ids")
    _check_num_layers(num_layers)
    if not ids:
        raise ValueError("layer_ids is empty: ask for at least one hidden state")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"Layer index {bad[0]} out of bounds [0, {num_layers - 1}] "
            "(legacy speculators 0.3/0.4 convention: output of decoder layer i)"
        )
    return ids


def _check_num_layers(num_layers: int) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
