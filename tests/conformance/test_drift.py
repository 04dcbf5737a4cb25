"""Drift in the real installed vLLM, made in a fresh process (drift_inject.py), then our API and
``vllm-compat doctor --drift``: the exact error and report for each kind of drift.

Per kind: a symbol moved (found where it went, used, reported, nothing breaks), deleted, a
new required parameter, a removed parameter, a changed return type; and no change at all,
which must report no drift. Then the suite itself on a drifted build: the tests' own raw-vLLM
oracle breaking is reported as "oracle needs updating for this build", our API breaking
still fails. Runs on every release of the matrix (one per era in CI).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_compat import drift, versions

from .drift_inject import KINDS
from .oracle import ORACLE_OUTDATED

ROOT = Path(__file__).resolve().parents[2]
KCU = "vllm.v1.core.kv_cache_utils"
TAIL = " (`vllm-compat doctor --drift` lists every change)"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "VLLM_COMPAT_TEST_DRIFT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for k, v in (("HF_HUB_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("VLLM_LOGGING_LEVEL", "ERROR")):
        env.setdefault(k, v)
    env.update(extra)
    return env


STRICT_RUNS = {
    "strict-drift-moved": ("moved", "--as-version", "0.34.0.dev43+g5d6e7f8", "--strict", "drift"),
    "strict-drift-required": ("required_param", "--as-version", "0.34.0.dev44+g9a8b7c6",
                              "--strict", "drift"),
    "strict-all-none": ("none", "--as-version", "0.34.0.dev42+g1a2b3c4", "--strict", "1"),
}
SUITE_KINDS = ("moved", "required_param")
SUITE_FILES = ("tests/conformance/test_block_hashes.py", "tests/conformance/test_missing_hasher.py")
# the fresh-process tests of test_block_hashes start three more vLLM processes each: left out
SUITE_SELECT = "not (same_process or seeding_rules or fresh_process or raw_hashing)"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, info):
    """Every kind in its own fresh process, and the suite under two kinds, started together."""
    if info.newer_than_tested or drift.load_snapshot(info.version) is None:
        # the stored snapshot of the installed release is the baseline of every expectation
        pytest.skip(f"drift is simulated on tested releases; vLLM {info.version} has no "
                    "stored snapshot (nox -s nightly reports its drift itself)")
    def probe(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tests.conformance.drift_inject", *args],
                                cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    procs = {kind: probe(kind) for kind in KINDS}
    if info.era == versions.ERAS[-1].name:
        # the same builds reporting a newer version, under the strict modes: a newer build
        # keeps the newest adapter, so only on its era do its probes agree with it
        for name, args in STRICT_RUNS.items():
            procs[name] = probe(*args)
    junits = {}
    for kind in SUITE_KINDS:
        junits[kind] = tmp_path_factory.mktemp(f"suite-{kind}") / "junit.xml"
        procs[f"suite-{kind}"] = subprocess.Popen(
            [sys.executable, "-m", "pytest", *SUITE_FILES, "-q", "-p", "no:cacheprovider",
             "-p", "tests.conformance.drift_inject", f"--junitxml={junits[kind]}",
             "-k", SUITE_SELECT],
            cwd=ROOT, env=_env(VLLM_COMPAT_TEST_DRIFT=kind),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=1200)
        if name.startswith("suite-"):
            out[name] = _outcomes(junits[name[len("suite-"):]], stdout + stderr)
            continue
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"{name} probe failed (rc={p.returncode}):\n{stderr[-3000:]}"
        out[name] = json.loads(lines[-1][len("RESULT "):])
    return out


def _outcomes(junit: Path, log: str) -> dict[str, tuple[str, str]]:
    """test name -> (outcome, message) from a junit file."""
    assert junit.exists(), f"the drifted suite did not run:\n{log[-3000:]}"
    res = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name").split("[")[0]
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = tag
                msg = (el.get("message") or "") + "\n" + (el.text or "")
                if tag == "skipped" and el.get("type") == "pytest.xfail":
                    outcome = "xfailed"
        if res.get(name, ("passed",))[0] == "passed":  # the worst outcome of parametrized cases
            res[name] = (outcome, msg)
    return res


def _items(report: dict) -> list[tuple[str, str, bool]]:
    return [(i["kind"], i["symbol"], i["affects"]) for i in report["drift"]["items"]]


def _error(r: dict) -> tuple[str, str, str]:
    e = r.get("error")
    assert e is not None, f"no error raised: {r}"
    return e["type"], e["capability"], e["message"]


# ----------------------------------------------------------------------------- one kind each


def test_an_unchanged_build_reports_no_drift(runs, info):
    r = runs["none"]
    assert "error" not in r and r["hashes"] == r["vllm_hashes"] and len(r["hashes"]) == 2
    assert r["doctor_exit"] == 0
    doc = r["doctor"]
    assert doc["drift"]["items"] == [] and doc["drift"]["nearest_tested"] == info.base_version
    assert doc["drift"]["summary"] == f"drift check against {info.base_version}: no drift"
    assert doc["era"] == info.era and doc["routing"] == f"version and probes agree: {info.base_version}"


def test_a_moved_symbol_is_used_where_it_went_and_reported(runs, info):
    r = runs["moved"]
    # vllm_compat found init_none_hash and NONE_HASH where they went: its hashes equal vLLM's
    assert "error" not in r, r["error"]
    assert r["hashes"] == r["vllm_hashes"] and len(r["hashes"]) == 2
    doc = r["doctor"]
    # 0.11+ moved it to a known alternate place; on 0.10.2 (no vllm.utils.hashing) it went
    # to vllm.utils, where only the search finds it
    if info.probes["hashing_module"]:
        target, how, beside = "vllm.utils.hashing", "alternate", "alternate"
    else:
        target, how, beside = "vllm.utils", "searched", "beside"
    expected = [("moved", "init_none_hash", False), ("moved", "NONE_HASH", False)]
    found = {"init_none_hash": f"{target}:init_none_hash ({how}; used there)",
             "NONE_HASH": f"{target}:NONE_HASH ({beside}; used there)"}
    if info.probes["fixed_none_hash_seed"]:  # 0.29+: the seed went with it
        expected.append(("moved", "DEFAULT_NONE_HASH_SEED", False))
        found["DEFAULT_NONE_HASH_SEED"] = f"{target}:DEFAULT_NONE_HASH_SEED (alternate; used there)"
    assert _items(doc) == expected
    for item in doc["drift"]["items"]:
        assert item["expected"] == f"{KCU}:{item['symbol']}" and item["found"] == found[item["symbol"]]
    assert r["doctor_exit"] == 0 and doc["drift"]["affects_capability"] is False
    # the probes still read the moved seed: routing is unchanged
    assert doc["era"] == info.era and doc["probes"] == info.probes


def test_a_deleted_symbol_is_a_library_error_naming_the_capability(runs, info):
    r = runs["deleted"]
    assert _error(r) == ("MissingSymbolError", "hashing", (
        f"hashing: vLLM {info.version} drifted from what vllm_compat expects: init_none_hash: "
        f"expected {KCU}:init_none_hash; found not at {KCU}:init_none_hash, "
        "vllm.utils.hashing:init_none_hash, nor anywhere under vllm.utils, vllm.v1.core. "
        "No workaround is known" + TAIL))
    doc = r["doctor"]
    expected = [("missing", "init_none_hash", True)]
    if not info.probes["fixed_none_hash_seed"]:
        # <= 0.28 has no seed constant: with init_none_hash gone the probe cannot tell, and
        # routing keeps the version's era
        expected.append(("probe_unknown", "probe fixed_none_hash_seed", True))
        assert doc["probes"]["fixed_none_hash_seed"] is None
        assert doc["routing"] == (f"by version (probe fixed_none_hash_seed: cannot tell): "
                                  f"{info.base_version}")
    assert _items(doc) == expected and doc["era"] == info.era
    assert r["doctor_exit"] == 1 and doc["drift"]["capabilities"] == ["hashing"]


def test_a_new_required_parameter_names_the_workaround(runs, info):
    r = runs["required_param"]
    passes = ("request_id, prompt_token_ids, sampling_params, pooling_params, block_hasher, "
              "eos_token_id (where accepted), structured_output_request (where accepted)")
    workaround = ("pass it through make_request(..., priority_class=...): make_request forwards "
                  "extra keywords to Request unchanged")
    assert _error(r) == ("SignatureDriftError", "requests", (
        f"requests: vLLM {info.version} drifted from what vllm_compat expects: Request: expected "
        f"vllm.v1.request:Request to need no parameter beyond those vllm_compat passes ({passes}); "
        f"found new required parameter(s) 'priority_class'. Workaround: {workaround}" + TAIL))
    assert r["error"]["workaround"] == workaround
    # the workaround works: the keyword goes through make_request(**extra) to Request
    assert r["workaround_request"] == {"priority_class": 0, "block_hashes": 2}
    doc = r["doctor"]
    assert _items(doc) == [("new_required_param", "Request", True)]
    assert doc["drift"]["items"][0]["workaround"] == workaround
    assert r["doctor_exit"] == 1 and doc["drift"]["capabilities"] == ["requests"]


def test_a_removed_parameter_is_a_library_error(runs, info):
    r = runs["removed_param"]
    assert _error(r) == ("SignatureDriftError", "scheduler", (
        f"scheduler: vLLM {info.version} drifted from what vllm_compat expects: Scheduler: "
        "expected vllm.v1.core.sched.scheduler:Scheduler to accept 'include_finished_set'; "
        "found parameter(s) 'include_finished_set' removed. No workaround is known" + TAIL))
    doc = r["doctor"]
    expected = [("removed_param", "Scheduler", True)]
    # AsyncScheduler forwards its arguments to Scheduler.__init__: its parameters changed too
    snap = drift.load_snapshot(info.base_version)
    if "include_finished_set" in (snap["surface"]["AsyncScheduler"].get("params") or {}):
        expected.append(("params_removed", "AsyncScheduler", False))
    assert _items(doc) == expected
    assert r["doctor_exit"] == 1 and doc["drift"]["capabilities"] == ["scheduler"]


def test_a_changed_return_type_is_a_library_error(runs, info):
    r = runs["return_type"]
    assert _error(r) == ("ReturnTypeDriftError", "hashing", (
        f"hashing: vLLM {info.version} drifted from what vllm_compat expects: get_hash_fn_by_name: "
        "expected get_hash_fn_by_name('sha256') to return a function that returns bytes; found its "
        "function returned str. No workaround is known" + TAIL))
    doc = r["doctor"]
    assert _items(doc) == [("returns_changed", "get_hash_fn_by_name", True)]
    assert r["doctor_exit"] == 1 and doc["drift"]["capabilities"] == ["hashing"]


# ----------------------------------------------------------------------------- strict modes


@pytest.fixture
def newest_era(info):
    if info.era != versions.ERAS[-1].name:
        pytest.skip("a newer-than-tested build is routed to the newest adapter: checked on its era")


def test_strict_drift_accepts_an_untested_build_whose_drift_breaks_nothing(runs, info, newest_era):
    # a 0.34 build is compared with the newest snapshot: the newest release relabelled differs
    # from it by the 3 moves made here only, an older release of the era also by what vLLM
    # changed since, none of which affects a capability (the adapter covers the whole era)
    newest = max(drift.tested_snapshots(), key=Version)
    r = runs["strict-drift-moved"]
    assert "error" not in r, r["error"]
    found = re.fullmatch(rf"drift check against {re.escape(newest)}: (\d+) changes, "
                         "none affects a capability", r["detect"]["drift"])
    assert found, r["detect"]["drift"]
    changes = int(found.group(1))
    assert changes == 3 if info.base_version == newest else changes > 3
    summary = found.group(0)
    assert r["detect"] == {"version": "0.34.0.dev43+g5d6e7f8", "era": "v0_29",
                           "routing": "version and probes agree: 0.34.0",
                           "newer_than_tested": True, "drift": summary}
    assert r["warnings"] == [
        ("vLLM 0.34.0.dev43+g5d6e7f8 is newer than the newest release vllm_compat was tested on "
         f"({newest}); using adapter 'v0_29' (the newest); {summary} (`vllm-compat doctor --drift`)")]


def test_strict_drift_refuses_an_untested_build_whose_drift_breaks_a_capability(runs, newest_era):
    r = runs["strict-drift-required"]
    passes = ("request_id, prompt_token_ids, sampling_params, pooling_params, block_hasher, "
              "eos_token_id where accepted, structured_output_request where accepted")
    assert r["error"] == {"type": "UnsupportedVllmVersionError", "message": (
        "vLLM 0.34.0.dev44+g9a8b7c6 is newer than the newest release vllm_compat was tested on "
        "(0.33.0) and VLLM_COMPAT_STRICT=drift found drift that affects a capability (with "
        "adapter 'v0_29'): requests: Request: expected no required parameter beyond those "
        f"vllm_compat passes ({passes}); found new required parameter(s) 'priority_class' "
        "(workaround: pass it through make_request(..., priority_class=...): make_request "
        "forwards extra keywords to Request unchanged). Install vLLM <= 0.33.0, or unset "
        "VLLM_COMPAT_STRICT to run it anyway (`vllm-compat doctor --drift` shows the full report)")}
    assert r["warnings"] == []


def test_strict_1_refuses_every_untested_build_naming_the_adapter(runs, newest_era):
    r = runs["strict-all-none"]
    assert r["error"] == {"type": "UnsupportedVllmVersionError", "message": (
        "vLLM 0.34.0.dev42+g1a2b3c4 is newer than the newest release vllm_compat was tested on "
        "(0.33.0) and VLLM_COMPAT_STRICT=1 refuses untested releases: install vLLM <= 0.33.0, "
        "set VLLM_COMPAT_STRICT=drift to accept it when the drift check finds nothing that "
        "affects a capability, or unset VLLM_COMPAT_STRICT to run it with adapter 'v0_29'")}


# ----------------------------------------------------------------------------- the suite itself


def test_on_a_moved_symbol_only_the_oracle_breaks(runs):
    res = runs["suite-moved"]
    outcomes = {n: o for n, (o, _) in res.items()}
    # vllm_compat finds the moved root: every test of its API passes; the one test that
    # reads NONE_HASH from kv_cache_utils itself (its oracle) is told apart
    assert {n for n, o in outcomes.items() if o != "passed"} == {
        "test_reinit_by_someone_else_makes_old_hasher_refuse"}, outcomes
    outcome, msg = res["test_reinit_by_someone_else_makes_old_hasher_refuse"]
    assert outcome == "xfailed" and msg.startswith(f"{ORACLE_OUTDATED}: reading vLLM's NONE_HASH "
                                                   "from kv_cache_utils raised AttributeError"), msg


# the tests that build a Request through make_request (the library meets the new parameter)
# and the ones whose raw Request is the oracle
MAKE_REQUEST_TESTS = {
    "test_hashes_equal_the_engine_core_path", "test_hashes_extend_during_decode_like_the_engine",
    "test_reinit_by_someone_else_makes_old_hasher_refuse",
    "test_switching_algorithm_reinitialises_and_old_hashers_refuse",
    "test_threads_share_one_consistent_hasher", "test_same_scenario_through_vllm_compat_passes",
    "test_default_make_request_attaches_a_hasher",
    "test_explicit_opt_out_reproduces_the_upstream_behaviour"}
RAW_REQUEST_TESTS = {"test_raw_request_without_hasher_fails_as_upstream",
                     "test_attach_block_hasher_repairs_a_raw_request"}


def test_on_a_new_required_parameter_the_library_fails_and_the_oracle_is_told_apart(runs):
    res = runs["suite-required_param"]
    failed = {n: m for n, (o, m) in res.items() if o in ("failure", "error")}
    assert set(failed) == MAKE_REQUEST_TESTS, sorted(failed)
    # a library failure, with our error and its workaround
    assert all("SignatureDriftError: requests:" in m and "priority_class=..." in m
               for m in failed.values()), failed
    xfailed = {n: m for n, (o, m) in res.items() if o == "xfailed"}
    assert set(xfailed) == RAW_REQUEST_TESTS
    assert all(m.startswith(f"{ORACLE_OUTDATED}: a raw vLLM Request") and "priority_class" in m
               for m in xfailed.values()), xfailed
    assert {n for n, (o, _) in res.items() if o == "passed"} == (
        set(res) - MAKE_REQUEST_TESTS - RAW_REQUEST_TESTS)
