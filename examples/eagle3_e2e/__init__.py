"""The EAGLE-3 pipeline end to end on a target trained here (a Llama on the Python standard
library), ending in vLLM serving the draft. Run from the repository root::

    python -m examples.eagle3_e2e all --work W --out O --model llama

See ``e2e.py`` for the phases and options; it uses only ``vllm_compat``'s public API.
"""
