"""Prefill-only hidden-state extraction on the real vLLM engine (EAGLE-3 training data).

Layer-index convention (one for every model and release)::

    k, 0 <= k < L : the residual-stream state ENTERING decoder layer k (0 = embeddings output)
    k = L         : the last decoder layer's output BEFORE the final norm
    (L = num_hidden_layers; text_config.num_hidden_layers for multimodal wrappers)

This equals HF ``output_hidden_states[k]`` for k < L; HF's entry L is after the final
norm (see :mod:`vllm_compat.extract.layers` for converters from HF and speculators 0.3/0.4
indices, and the EAGLE-3 default set ``(2, L//2, L-3) + (L,)``).

Usage::

    from vllm_compat.extract import HiddenStatesExtractor
    ex = HiddenStatesExtractor("/ckpt", layer_ids=None)       # EAGLE-3 default + L
    for s in ex.extract(token_id_lists):                       # streamed, input order
        s.index, s.token_ids, s.hidden_states                  # [seq, n_layers, hidden]
    ex.close()

Capture uses vLLM's own aux-hidden-state path (configured before torch.compile / CUDA-graph
capture) where the model supports the requested ids, forward hooks (eager only) otherwise,
or ``backend="native"``: vLLM's ``extract_hidden_states`` method (0.17.1+, not MLA).
This module does not import vLLM; the engine side is :mod:`vllm_compat.runtime.extraction`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from .layers import (
    eagle3_default_layers,
    from_hf_indices,
    from_speculators_indices,
    to_speculators_indices,
    validate_layer_ids,
)

if _TYPE_CHECKING:
    from .extractor import ExtractedSample, HiddenStatesExtractor, extract_hidden_states

_LAZY = ("ExtractedSample", "HiddenStatesExtractor", "extract_hidden_states")


def __getattr__(name: str) -> _Any:
    # the extractor (torch) is imported on first use, so that the layer numbering in
    # .layers stays importable without torch (vllm_compat.speculators promises that)
    if name in _LAZY:
        from . import extractor

        return getattr(extractor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ExtractedSample", "HiddenStatesExtractor", "eagle3_default_layers", "extract_hidden_states",
    "from_hf_indices", "from_speculators_indices", "to_speculators_indices", "validate_layer_ids",
]
