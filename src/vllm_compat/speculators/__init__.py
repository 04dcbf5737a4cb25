"""Drop-in replacements for speculators 0.3/0.4's vLLM-driving data generation.

Change one import in a speculators 0.3.0 / 0.4.x fork::

    # from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    from vllm_compat.speculators import VllmHiddenStatesGenerator

and the generator runs on every vLLM release vllm_compat supports. The same arguments give
the same states as speculators did (its layer numbering and default ids included); its bugs
are fixed (input order, chunked-prefill attribution, tensor truthiness), and vLLM's layer
numbering is one keyword away (``layer_convention="vllm"``; see
``docs/migration-speculators.md``). Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

from .config_generator import DataGenerationConfig
from .layers import (
    LayerConventionWarning,
    choose_convention,
    default_layer_ids,
    from_legacy,
    legacy_default_layer_ids,
    to_legacy,
)
from .vllm_hidden_states_generator import (
    VllmHiddenStatesGenerator,
    prepare_prompts,
    resolve_layer_ids,
    samples_to_results,
)

__all__ = [
    "DataGenerationConfig", "LayerConventionWarning", "VllmHiddenStatesGenerator",
    "choose_convention", "default_layer_ids", "from_legacy", "legacy_default_layer_ids",
    "prepare_prompts", "resolve_layer_ids", "samples_to_results", "to_legacy",
]
