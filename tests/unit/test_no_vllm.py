"""Without vLLM installed, vllm_compat imports and fails clearly on first use."""

import importlib.util

import pytest

import vllm_compat
from vllm_compat.errors import VllmNotInstalledError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this environment"
)


def test_detect_says_vllm_is_missing():
    with pytest.raises(VllmNotInstalledError, match="pip install vllm"):
        vllm_compat.detect(refresh=True)


def test_first_use_says_vllm_is_missing():
    with pytest.raises(VllmNotInstalledError):
        vllm_compat.make_block_hasher(16)


def test_doctor_reports_missing_vllm(capsys):
    from vllm_compat.cli import main

    assert main(["doctor", "--json"]) == 2
    assert '"VllmNotInstalledError"' in capsys.readouterr().out
