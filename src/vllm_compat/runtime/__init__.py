"""Release-agnostic drivers of a live vLLM engine (these modules import vLLM).

- :mod:`.llm`: an ``LLM`` for serving, self-distillation and evaluation: open, generate,
  metrics, shut down.
- :mod:`.extraction`: the extraction engine behind :class:`vllm_compat.extract.HiddenStatesExtractor`,
  with :mod:`.capture_plan` (which capture mode) and :mod:`.capture_worker` (inside the worker).
- :mod:`.speculative`: what the installed vLLM makes of an EAGLE-3 draft checkpoint.

Unlike :mod:`vllm_compat.adapters`, nothing here differs per era module: each version
branch is a feature probe with a comment naming the vLLM change behind it.
"""
