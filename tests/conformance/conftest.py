"""Conformance tests: run against the real vLLM installed in this environment, on CPU.

Nothing of vLLM is mocked. The one thing faked is what has no CPU implementation: the
model's sampled tokens, fed back to the real scheduler as a real ``ModelRunnerOutput``
(the same seam vLLM's own scheduler tests use).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

# Before vLLM is imported: no hub, no usage stats, a private cache for model inspection.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="vLLM is not installed: run `nox -s conformance`")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.conformance)
            if not HAVE_VLLM:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def info():
    import vllm_compat

    return vllm_compat.detect()


@pytest.fixture(scope="session")
def vllm_version(info):
    from packaging.version import Version

    return Version(info.base_version)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from vllm_compat.testing.models import write_tiny_llama_config

    return write_tiny_llama_config(tmp_path_factory.mktemp("tiny-llama"))
