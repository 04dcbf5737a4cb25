"""Fixtures for tests of code built on vllm_compat (ours and yours): checkpoints and data
built locally, nothing downloaded.

- :mod:`.models`: random-weight checkpoints of named shapes (:func:`build_model`), and a
  config-only tiny Llama for driving the scheduler (:func:`write_tiny_llama_config`).
- :mod:`.synthetic`: a minimal target and a hidden-state dataset that a working EAGLE-3
  trainer learns from in seconds on the CPU.
- :mod:`.replicas`: kill an extraction replica mid-unit (:class:`ReplicaKiller`), for tests
  of the resume path.
- :mod:`.kimi_k25`: a faithful, scaled-down Kimi-K2.5 checkpoint (wrapper config, INT4
  experts, tokenizer, image processor).

Needs torch (and transformers for :func:`build_model`).
"""

from __future__ import annotations

from .models import SHAPES, build_model, copy_tokenizer, model_config, write_tiny_llama_config
from .replicas import ReplicaKiller
from .synthetic import write_dataset, write_target

__all__ = ["SHAPES", "ReplicaKiller", "build_model", "copy_tokenizer", "model_config",
           "write_dataset", "write_target", "write_tiny_llama_config"]
