"""Version parsing and era routing over many real-world and malformed version strings."""

import re
import warnings
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_compat import versions
from vllm_compat.errors import (
    InvalidVllmVersionError, UnknownAdapterError, UnsupportedVllmVersionError,
)

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# From the versions table (the stored snapshots), never written out: adding a release moves them.
NEWEST, NEXT = versions.NEWEST_TESTED, versions.NEWEST_TESTED_SERIES
RELEASES_TOML = Path(__file__).resolve().parents[2] / "matrix" / "releases.toml"

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
    (f"{NEWEST}", "v0_29"), ("0.33.1.dev42+gdeadbee.cu130", "v0_29"), (f" {NEWEST} ", "v0_29"),
]
TOO_OLD = ["0.10.1", "0.10.2rc1", "0.9.2", "0.8.5.post1", "0.6.0", "0.10.1.1+cu126", "0.1"]
GARBAGE = ["", "   ", "latest", "main", "0.x.1", "nightly-2026-11-01", "0.11.1+", "0..1", None, 11]
NEWER = [f"{NEXT}", f"{NEXT}rc1", f"{NEXT}.dev5+gabc", f"{NEXT.major}.{NEXT.minor + 6}.2", "99.0.0"]


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
    series = re.escape(f"0.10.2 to {NEWEST.major}.{NEWEST.minor}.x (newer runs with a warning)")
    with pytest.raises(UnsupportedVllmVersionError, match=series):
        versions.route(text, env={})


@pytest.mark.parametrize("text", GARBAGE)
def test_garbage_is_a_clear_error(text):
    with pytest.raises(InvalidVllmVersionError):
        versions.route(text, env={})


def test_a_later_patch_of_the_newest_tested_series_runs_without_a_warning():
    # what README.md promises: a 0.34.x patch is the tested series, 0.35 is not
    patch = f"{NEWEST.major}.{NEWEST.minor}.{NEWEST.micro + 1}"
    versions._warned_newer.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = versions.route(patch, env={})
    assert r.era.name == versions.ERAS[-1].name and not r.newer_than_tested
    versions.check_supported(patch, env={"VLLM_COMPAT_STRICT": "1"})  # strict accepts it too


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
    assert versions.route(f"{NEWEST}", env={"VLLM_COMPAT_STRICT": "1"}).era.name == "v0_29"


def test_forced_adapter_wins_even_over_version():
    r = versions.route(f"{NEWEST}", env={"VLLM_COMPAT_ADAPTER": "v0_11"})
    assert r.era.name == "v0_11" and "forced" in r.reason


def test_forced_unknown_adapter():
    with pytest.raises(UnknownAdapterError, match="v0_10"):
        versions.route("0.26.0", env={"VLLM_COMPAT_ADAPTER": "v9"})


@pytest.mark.parametrize("era", versions.ERAS, ids=lambda e: e.name)
def test_probes_override_version(era):
    # A nightly whose code already has the next era's features is routed by its code, and
    # the reason names the probes that disagree with the version.
    r = versions.route("0.16.1.dev3+gabc", era.signature, env={})
    assert r.era is era
    v0_11 = versions.ERAS_BY_NAME["v0_11"].signature
    disagree = tuple(k for k in versions.ERA_PROBES if era.signature[k] != v0_11[k])
    assert r.disagreeing == disagree
    if disagree:
        names = ", ".join(f"{k}={'yes' if era.signature[k] else 'no'}" for k in disagree)
        verb = "matches" if len(disagree) == 1 else "match"
        assert r.reason == (f"version 0.16.1.dev3+gabc suggests 'v0_11' but probe {names} "
                            f"{verb} '{era.name}'")
    else:
        assert r.reason == "version and probes agree: 0.16.1"


def test_missing_probe_keys_cannot_tell():
    # a probe left out of the mapping is one that cannot tell: the version decides
    r = versions.route("0.26.0", {"request_takes_eos": False}, env={})
    assert r.era.name == "v0_17" and r.unknown == ("two_phase_step", "fixed_none_hash_seed")
    assert r.reason == "by version (probe two_phase_step, fixed_none_hash_seed: cannot tell): 0.26.0"


ERA_VERSIONS = {"v0_10": "0.10.2", "v0_11": "0.16.0", "v0_17": "0.26.0", "v0_29": f"{NEWEST}"}


@pytest.mark.parametrize("era", versions.ERAS, ids=lambda e: e.name)
@pytest.mark.parametrize("probe", versions.ERA_PROBES)
def test_a_probe_that_cannot_tell_never_moves_a_build(era, probe):
    probes = dict(era.signature, **{probe: None})
    r = versions.route(ERA_VERSIONS[era.name], probes, env={})
    assert r.era is era and r.unknown == (probe,) and r.disagreeing == ()
    assert f"probe {probe}: cannot tell" in r.reason


def test_the_moved_seed_case_stays_on_the_newest_era():
    # init_none_hash (and its seed) moved where no probe could look: fixed_none_hash_seed
    # cannot tell, and a 0.34 nightly keeps v0_29 instead of falling to v0_17.
    versions._warned_newer.clear()
    with pytest.warns(RuntimeWarning, match="using adapter 'v0_29' \\(the newest\\)"):
        r = versions.route(f"{NEXT}.dev43+g5d6e7f8", {"two_phase_step": True, "request_takes_eos": False,
                                                    "fixed_none_hash_seed": None}, env={})
    assert r.era.name == "v0_29" and r.newer_than_tested and r.unknown == ("fixed_none_hash_seed",)


def test_an_unknown_probe_widens_the_choice_to_the_nearest_era_only():
    # eos=yes rules out v0_17/v0_29; two_phase_step cannot tell, so v0_10 would rest on a
    # guess: the nearest era the known probes allow is taken, v0_11.
    r = versions.route("0.26.0", {"two_phase_step": None, "request_takes_eos": True,
                                  "fixed_none_hash_seed": False}, env={})
    assert r.era.name == "v0_11" and r.disagreeing == ("request_takes_eos",)
    assert r.reason == "version 0.26.0 suggests 'v0_17' but probe request_takes_eos=yes matches 'v0_11'"


def test_probes_that_match_no_era_keep_the_version():
    r = versions.route("0.26.0", {"two_phase_step": False, "request_takes_eos": False,
                                  "fixed_none_hash_seed": True}, env={})
    assert r.era.name == "v0_17"
    assert r.reason == ("version 0.26.0 suggests 'v0_17'; probe two_phase_step=no, "
                        "fixed_none_hash_seed=yes match no era, so the version's is kept")


def test_probes_never_pick_an_era_whose_adapter_cannot_run():
    # 0.16 with sample_tokens renamed: the era probes match v0_10, but v0_10 needs the hash
    # helpers in vllm.utils and this build keeps them in vllm.utils.hashing; picking v0_10
    # would refuse everything, keeping v0_11 refuses only the model step
    probes = {"two_phase_step": False, "request_takes_eos": True, "fixed_none_hash_seed": False,
              "hashing_module": True}
    r = versions.route("0.16.0", probes, env={})
    assert r.era.name == "v0_11" and r.disagreeing == ("two_phase_step",)
    assert r.reason == ("version 0.16.0 suggests 'v0_11'; probe two_phase_step=no matches "
                        "'v0_10', whose adapter cannot run here (it needs hashing_module=no), "
                        "so the version's is kept")
    # a build that really is single-phase, hash helpers in vllm.utils, still goes to v0_10
    assert versions.route("0.16.0", dict(probes, hashing_module=False), env={}).era.name == "v0_10"


@pytest.mark.parametrize("era", versions.ERAS, ids=lambda e: e.name)
def test_a_newer_build_is_never_routed_below_the_newest_era_by_probes(era):
    versions._warned_newer.clear()
    with pytest.warns(RuntimeWarning, match="using adapter 'v0_29'"):
        r = versions.route(f"{NEXT}.dev42+g1a2b3c4", era.signature, env={})
    assert r.era.name == "v0_29" and r.newer_than_tested
    newest = versions.ERAS[-1].signature
    disagree = tuple(k for k in versions.ERA_PROBES if era.signature[k] != newest[k])
    assert r.disagreeing == disagree
    if disagree:
        names = ", ".join(f"{k}={'yes' if era.signature[k] else 'no'}" for k in disagree)
        assert r.reason.startswith(
            f"version {NEXT}.dev42+g1a2b3c4 is newer than tested: kept the newest adapter "
            f"'v0_29' although probe {names} ")
        assert r.reason.endswith(f"'{era.name}'")


def test_a_forced_adapter_keeps_the_newer_than_tested_flag_and_is_named():
    versions._warned_newer.clear()
    with pytest.warns(RuntimeWarning) as rec:
        r = versions.route(f"{NEXT}rc1", env={"VLLM_COMPAT_ADAPTER": "v0_17"})
    assert r.era.name == "v0_17" and r.forced and r.newer_than_tested
    assert str(rec[0].message) == (
        f"vLLM {NEXT}rc1 is newer than the newest release vllm_compat was tested on ({NEWEST}); "
        "using adapter 'v0_17' (forced by VLLM_COMPAT_ADAPTER)")


@pytest.mark.parametrize("value,mode", [("1", "all"), ("true", "all"), ("ON", "all"),
                                        ("drift", "drift"), (" Drift ", "drift"), ("", ""),
                                        ("0", ""), ("no", "")])
def test_strict_modes(value, mode):
    assert versions.strict_mode({"VLLM_COMPAT_STRICT": value}) == mode


def test_strict_drift_does_not_refuse_in_routing():
    # the drift check decides (detect), after the probes and the surface were read
    versions._warned_newer.clear()
    with pytest.warns(RuntimeWarning):
        r = versions.route(f"{NEXT}", env={"VLLM_COMPAT_STRICT": "drift"})
    assert r.era.name == "v0_29"


def test_era_signatures_are_distinct_and_ordered():
    sigs = [tuple(sorted(e.signature.items())) for e in versions.ERAS]
    assert len(set(sigs)) == len(sigs)
    firsts = [e.first for e in versions.ERAS]
    assert firsts == sorted(firsts)


def test_at_least_thirty_version_strings():
    assert len(ROUTED) + len(TOO_OLD) + len(GARBAGE) + len(NEWER) >= 30


def test_the_tested_releases_are_the_matrix_releases():
    """The versions table (one snapshot per release, shipped in the package) and the matrix
    (matrix/releases.toml) list the same releases: adding one is its snapshot and its line."""
    listed = tomllib.loads(RELEASES_TOML.read_text())["releases"]
    assert [str(v) for v in versions.tested_releases()] == listed
    assert NEWEST == Version(listed[-1]) and NEXT > NEWEST and NEXT.micro == 0
