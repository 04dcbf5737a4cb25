"""Declared aliases (vllm_compat.aliases): how they are written and where they come from."""

from __future__ import annotations

import pytest

from vllm_compat import aliases


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(aliases.ENV, raising=False)
    aliases.clear()
    yield
    aliases.clear()


def test_pairs_from_the_environment():
    assert aliases.parse(" sample_tokens=sample_step_tokens, , init_none_hash = seed_root ") == {
        "sample_tokens": "sample_step_tokens", "init_none_hash": "seed_root"}


@pytest.mark.parametrize("bad", ["sample_tokens", "a=", "=b", "a=a", "a-b=c", "a=b.c", "1a=b"])
def test_a_malformed_pair_is_refused(bad):
    with pytest.raises(ValueError, match=f"{aliases.ENV}: .* is not of the form old_name=new_name"):
        aliases.parse(bad)


def test_declared_ones_override_the_environment_and_say_how_they_came(monkeypatch):
    monkeypatch.setenv(aliases.ENV, "sample_tokens=from_env,execute_model=run_step")
    assert aliases.current() == {"sample_tokens": "from_env", "execute_model": "run_step"}
    assert aliases.how("sample_tokens", "from_env") == f"{aliases.ENV}=sample_tokens=from_env"
    aliases.declare({"sample_tokens": "from_code"})
    assert aliases.current() == {"sample_tokens": "from_code", "execute_model": "run_step"}
    assert aliases.how("sample_tokens", "from_code") == "vllm_compat.alias(sample_tokens='from_code')"
    aliases.declare({"sample_tokens": ""})  # removed: the environment's counts again
    assert aliases.current()["sample_tokens"] == "from_env"
    with pytest.raises(ValueError):
        aliases.declare({"sample_tokens": "not a name"})


def test_alias_is_public_and_needs_no_vllm():
    import sys

    import vllm_compat

    had = "vllm" in sys.modules
    vllm_compat.alias(sample_tokens="sample_step_tokens")
    assert aliases.current() == {"sample_tokens": "sample_step_tokens"}
    assert had or "vllm" not in sys.modules
