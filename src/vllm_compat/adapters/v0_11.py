"""Adapter for vLLM 0.11 - 0.16: two-phase step, ``Request(eos_token_id=...)`` still required.

Changes against 0.10.2 that define this era:
- 0.11 split the model step: ``execute_model`` returns None and keeps its state until
  ``sample_tokens(grammar_output)`` is called (the V1 runner raises "State error" otherwise).
- 0.11 moved the hash helpers to ``vllm.utils.hashing`` and derived
  ``structured_output_request`` inside ``Request``.
Inside the era: 0.16.0 replaced ``get_hash_new_full_blocks`` by ``update_block_hashes``
(probed in ``attach_block_hasher``); 0.12 made prefix caching default on.
What ends the era: 0.17 removed ``Request(eos_token_id=...)``, which is all this module redefines.
"""

from __future__ import annotations

from ._common import *  # noqa: F403  (the common adapter; this era redefines what follows)
from ._common import eos_in_request, request_factory

new_request = request_factory(eos_in_request)  # Request(eos_token_id=...) through 0.16
