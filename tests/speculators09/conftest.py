"""speculators 0.9.0's own commands against ``vllm-compat serve-hidden-states`` on the CPU.

speculators 0.9.0 lives in its own virtual environment (its torch and transformers pins);
``nox -s speculators09`` builds it and names its Python in ``SPECULATORS_PYTHON``. The
server runs here, in this environment, with the extractor's transformers backend (vLLM's
wheel cannot run a model without a GPU).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPECULATORS_PYTHON = os.environ.get("SPECULATORS_PYTHON")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    if SPECULATORS_PYTHON:
        return
    skip = pytest.mark.skip(reason="SPECULATORS_PYTHON is not set: run `nox -s speculators09`")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
