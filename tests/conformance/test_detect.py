"""detect() and `vllm-compat doctor` on the installed release."""

from __future__ import annotations

import json
import subprocess

import pytest
import sys

import vllm_compat
from vllm_compat import versions


def test_version_and_probes_agree_on_every_release(info):
    # The era boundaries in versions.ERAS were read from the wheels; this checks them
    # against the installed code: the probes must pick the same era as the version.
    assert versions.era_for_probes(info.probes) is versions.era_for_version(info.version)
    assert info.era == versions.era_for_version(info.version).name
    assert "agree" in info.routing


def test_doctor_json_names_the_era(info):
    out = subprocess.run([sys.executable, "-m", "vllm_compat.cli", "doctor", "--json"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out[out.index("{"):])
    assert report["ok"] and report["era"] == info.era and report["version"] == info.version
    assert report["probes"]["two_phase_step"] == info.probes["two_phase_step"]


def test_forced_adapter_is_reported(info, monkeypatch):
    import vllm_compat

    # The newest era shares its imports with v0_11/v0_17, so forcing it loads anywhere
    # from 0.11; forcing v0_10 on a later release must fail clearly, not half-work.
    other = versions.ERAS[-1].name if info.era != versions.ERAS[-1].name else versions.ERAS[-2].name
    try:
        monkeypatch.setenv("VLLM_COMPAT_ADAPTER", other)
        if info.era == "v0_10":
            with pytest.raises(vllm_compat.UnsupportedVllmVersionError, match="cannot run on vLLM"):
                vllm_compat.detect(refresh=True)
        else:
            forced = vllm_compat.detect(refresh=True)
            assert forced.era == other and "forced" in forced.routing
            monkeypatch.setenv("VLLM_COMPAT_ADAPTER", "v0_10")
            with pytest.raises(vllm_compat.UnsupportedVllmVersionError, match="'v0_10'.*cannot run on vLLM"):
                vllm_compat.detect(refresh=True)
    finally:
        monkeypatch.delenv("VLLM_COMPAT_ADAPTER")
        assert vllm_compat.detect(refresh=True).era == info.era


def test_the_routed_adapter_provides_the_whole_adapter_api():
    """The type checker verifies every era module against AdapterAPI for one release; here
    the module this release is routed to is checked against the real installed vLLM."""
    from vllm_compat.adapters import ADAPTER_FUNCTIONS, AdapterAPI

    ad = vllm_compat.adapter()
    assert isinstance(ad, AdapterAPI)
    assert len(ADAPTER_FUNCTIONS) == 25
    assert [n for n in ADAPTER_FUNCTIONS if not callable(getattr(ad, n, None))] == []
