"""Each public package's ``__all__`` lists exactly its public names (as httpx checks its own)."""

from __future__ import annotations

import importlib
import types

import pytest

PACKAGES = ["vllm_compat", "vllm_compat.extract", "vllm_compat.eagle3", "vllm_compat.speculators",
            "vllm_compat.testing"]


def public_names(module: types.ModuleType) -> list[str]:
    """Names a user sees on the package: not private, not a submodule, not the
    ``from __future__ import annotations`` feature; with the names a package imports on first
    use (its ``_LAZY``)."""
    return sorted({k for k, v in vars(module).items()
                   if not k.startswith("_") and not isinstance(v, types.ModuleType)
                   and k != "annotations"} | set(getattr(module, "_LAZY", ())))


@pytest.mark.parametrize("name", PACKAGES)
def test_all_lists_every_public_name(name):
    module = importlib.import_module(name)
    assert sorted(module.__all__) == public_names(module)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_name_in_all_resolves(name):
    module = importlib.import_module(name)
    assert [n for n in module.__all__ if not hasattr(module, n)] == []


def test_the_check_sees_a_name_left_out(monkeypatch):
    import vllm_compat.extract as ex

    monkeypatch.setattr(ex, "__all__", [n for n in ex.__all__ if n != "HiddenStatesExtractor"])
    assert sorted(ex.__all__) != public_names(ex)
