"""Hidden states over vLLM's OpenAI API, for speculators 0.5-0.9 and hs-connectors 0.9.

``vllm-compat serve-hidden-states MODEL`` (:mod:`.cli`) replaces speculators'
``launch_vllm.py``: the same flags, the same endpoints and the same files, with the states
computed by :class:`vllm_compat.extract.HiddenStatesExtractor` in this process on any vLLM
release vllm_compat supports (or in transformers, on the CPU). Modules:

* :mod:`.protocol`: what a request asks for, checked as vLLM checks it;
* :mod:`.chat`: conversations rendered with the model's chat template;
* :mod:`.hs_files`: the files and their ``.lock`` protocol, as vLLM's connectors write them;
* :mod:`.engine_thread`: the extractor's thread and admission control;
* :mod:`.service`: the pieces together; :mod:`.app`: the HTTP routes (FastAPI).

Needs ``pip install 'vllm-compat[serve]'`` (FastAPI, uvicorn).
"""

from __future__ import annotations

__all__: list[str] = []
