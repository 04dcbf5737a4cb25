"""Version parsing and era routing over many real-world and malformed version strings."""

import warnings

import pytest
from packaging.version import Version

from vllm_compat import versions
from vllm_compat.errors import (
    InvalidVllmVersionError, UnknownAdapterError, UnsupportedVllmVersionError,
)

# (version string, expected era) - releases, rc, dev/nightly, post, local builds.
ROUTED = [
    ("0.10.2", "v0_10"), ("0.10.2.post1", "v0_10"), ("0.10.2+cu128", "v0_10"),
    ("0.10.3rc1", "v0_10"), ("0.10.9.dev3+gabcdef0", "v0_10"),
    ("0.11.0", "v0_11"), ("0.11.0rc1", "v0_11"), ("0.11.1rc6.dev16+g933cdea44.cu129", "v0_11"),
    ("0.11.2", "v0_11"), ("0.12.0", "v0_11"), ("0.13.0", "v0_11"), ("0.14.1", "v0_11"),
    ("0.15.1", "v0_11"), ("0.16.0", "v0_11"), ("0.16.0+cpu", "v0_11"), ("0.16.1.post2", "v0_11"),
    ("0.17.0", "v0_17"), ("0.17.0rc0", "v0_17"), ("0.17.1", "v0_17"), ("0.18.1", "v0_17"),
    ("0.20.2", "v0_17"), ("0.22.1", "v0_17"), ("0.24.0", "v0_17"), ("0.26.0", "v0_17"),
    ("0.26.0.dev0+g1234567.d20261101", "v0_17"), ("0.28.0", "v0_17"), ("v0.28.0", "v0_17"),
    ("0.29.0", "v0_29"), ("0.29.0rc2", "v0_29"), ("0.30.0", "v0_29"), ("0.32.0", "v0_29"),
    ("0.33.0", "v0_29"), ("0.33.1.dev42+gdeadbee.cu130", "v0_29"), (" 0.33.0 ", "v0_29"),
]
TOO_OLD = ["0.10.1", "0.10.2rc1", "0.9.2", "0.8.5.post1", "0.6.0", "0.10.1.1+cu126", "0.1"]
GARBAGE = ["", "   ", "latest", "main", "0.x.1", "nightly-2026-11-01", "0.11.1+", "0..1", None, 11]
NEWER = ["0.34.0", "0.34.0rc1", "0.35.0.dev5+gabc", "1.0.0", "0.40.2"]


@pytest.mark.parametrize("text,era", ROUTED)
def test_routes_by_base_version(text, era):
    assert versions.route(text, env={}).era.name == era


def test_base_version_strips_pre_dev_local():
    v = versions.parse_vllm_version("0.11.1rc6.dev16+g933cdea44.cu129")
    assert versions.base_version(v) == Version("0.11.1")
    assert v.is_prerelease and v.local == "g933cdea44.cu129"


def test_rc_of_oldest_release_is_older():
    # PEP 440: 0.10.2rc1 < 0.10.2, but its base version is 0.10.2 - routed, not refused.
    assert versions.route("0.10.2rc1", env={}).era.name == "v0_10"


@pytest.mark.parametrize("text", [t for t in TOO_OLD if t != "0.10.2rc1"])
def test_too_old_names_supported_range(text):
    with pytest.raises(UnsupportedVllmVersionError, match=r"0\.10\.2 to 0\.33\.0"):
        versions.route(text, env={})


@pytest.mark.parametrize("text", GARBAGE)
def test_garbage_is_a_clear_error(text):
    with pytest.raises(InvalidVllmVersionError):
        versions.route(text, env={})


@pytest.mark.parametrize("text", NEWER)
def test_newer_uses_newest_adapter_and_warns_once(text):
    versions._warned_newer.clear()
    with pytest.warns(RuntimeWarning, match="newer than the newest release"):
        r = versions.route(text, env={})
    assert r.era.name == versions.ERAS[-1].name and r.newer_than_tested
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.route(text, env={})  # second time: no warning


@pytest.mark.parametrize("text", NEWER)
def test_strict_refuses_newer(text):
    with pytest.raises(UnsupportedVllmVersionError, match="VLLM_COMPAT_STRICT"):
        versions.route(text, env={"VLLM_COMPAT_STRICT": "1"})


def test_strict_does_not_refuse_tested():
    assert versions.route("0.33.0", env={"VLLM_COMPAT_STRICT": "1"}).era.name == "v0_29"


def test_forced_adapter_wins_even_over_version():
    r = versions.route("0.33.0", env={"VLLM_COMPAT_ADAPTER": "v0_11"})
    assert r.era.name == "v0_11" and "forced" in r.reason


def test_forced_unknown_adapter():
    with pytest.raises(UnknownAdapterError, match="v0_10"):
        versions.route("0.26.0", env={"VLLM_COMPAT_ADAPTER": "v9"})


@pytest.mark.parametrize("era", versions.ERAS, ids=lambda e: e.name)
def test_probes_override_version(era):
    # A nightly whose code already has the next era's features is routed by its code.
    r = versions.route("0.16.1.dev3+gabc", era.signature, env={})
    assert r.era is era
    if era.name != "v0_11":
        assert "probes match" in r.reason


def test_incomplete_probes_do_not_override():
    assert versions.route("0.26.0", {"two_phase_step": False}, env={}).era.name == "v0_17"


def test_era_signatures_are_distinct_and_ordered():
    sigs = [tuple(sorted(e.signature.items())) for e in versions.ERAS]
    assert len(set(sigs)) == len(sigs)
    firsts = [e.first for e in versions.ERAS]
    assert firsts == sorted(firsts)


def test_at_least_thirty_version_strings():
    assert len(ROUTED) + len(TOO_OLD) + len(GARBAGE) + len(NEWER) >= 30
