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
# from the versions table (the stored snapshots), never written out
NEWEST, NEXT = versions.NEWEST_TESTED, versions.NEWEST_TESTED_SERIES
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
    "strict-drift-moved": ("moved", "--as-version", f"{NEXT}.dev43+g5d6e7f8", "--strict", "drift"),
    "strict-drift-required": ("required_param", "--as-version", f"{NEXT}.dev44+g9a8b7c6",
                              "--strict", "drift"),
    "strict-all-none": ("none", "--as-version", f"{NEXT}.dev42+g1a2b3c4", "--strict", "1"),
    "strict-drift-salted": ("salted_engine_hash", "--as-version", f"{NEXT}.dev45+g0f1e2d3",
                            "--strict", "drift"),
}
SUITE_KINDS = ("moved", "required_param", "request_moved")
SUITE_FILES = ("tests/conformance/test_block_hashes.py", "tests/conformance/test_missing_hasher.py")
# the fresh-process tests of test_block_hashes start three more vLLM processes each: left out
SUITE_SELECT = "not (same_process or seeding_rules or fresh_process or raw_hashing)"


# children at once: each imports vLLM; more only queue for the CPU (and CI has two cores)
PARALLEL = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory, info):
    """Every kind in its own fresh process, and the suite under a few kinds, a few at a time."""
    if info.newer_than_tested or drift.load_snapshot(info.version) is None:
        # the stored snapshot of the installed release is the baseline of every expectation
        pytest.skip(f"drift is simulated on tested releases; vLLM {info.version} has no "
                    "stored snapshot (nox -s nightly reports its drift itself)")
    jobs: dict[str, tuple[list[str], dict[str, str]]] = {
        kind: (["-m", "tests.conformance.drift_inject", kind], _env()) for kind in KINDS}
    if info.era == versions.ERAS[-1].name:
        # the same builds reporting a newer version, under the strict modes: a newer build
        # keeps the newest adapter, so only on its era do its probes agree with it
        for name, args in STRICT_RUNS.items():
            jobs[name] = (["-m", "tests.conformance.drift_inject", *args], _env())
    junits = {}
    for kind in SUITE_KINDS:
        junits[kind] = tmp_path_factory.mktemp(f"suite-{kind}") / "junit.xml"
        jobs[f"suite-{kind}"] = (
            ["-m", "pytest", *SUITE_FILES, "-q", "-p", "no:cacheprovider",
             "-p", "tests.conformance.drift_inject", f"--junitxml={junits[kind]}", "-k", SUITE_SELECT],
            _env(VLLM_COMPAT_TEST_DRIFT=kind))
    logs = tmp_path_factory.mktemp("drift-logs")
    out, running, queue = {}, {}, list(jobs)
    while queue or running:
        while queue and len(running) < PARALLEL:
            name = queue.pop(0)
            argv, env = jobs[name]
            # output to files, never pipes: a child blocked on a full pipe could hold a lock
            # (vLLM's cache) that another child waits for
            log = (logs / f"{name}.out").open("w"), (logs / f"{name}.err").open("w")
            running[name] = (subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                              stdout=log[0], stderr=log[1], text=True), log)
        name = next(iter(running))
        p, log = running.pop(name)
        p.wait(timeout=1200)
        for f in log:
            f.close()
        stdout = (logs / f"{name}.out").read_text()
        stderr = (logs / f"{name}.err").read_text()
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
    kind, capability, message = _error(r)
    assert (kind, capability) == ("MissingSymbolError", "hashing")
    head = (f"hashing: vLLM {info.version} drifted from what vllm_compat expects: init_none_hash: "
            f"expected {KCU}:init_none_hash; found not at {KCU}:init_none_hash, "
            "vllm.utils.hashing:init_none_hash, nor anywhere under vllm.utils, vllm.v1.core")
    # where it lived, functions that take the same call are named (never used unless declared)
    candidates = re.findall(r"candidates with a compatible signature: (.*?)\. Workaround", message)
    if candidates:
        first = candidates[0].split("(")[0].rpartition(":")[2]
        assert message == (head + f"; candidates with a compatible signature: {candidates[0]}. "
                           f"Workaround: if {first} is the successor of init_none_hash, declare "
                           f"it: VLLM_COMPAT_ALIASES='init_none_hash={first}' or vllm_compat."
                           f"alias(init_none_hash={first!r}) (checked, then used and reported as "
                           "drift resolved by alias)" + TAIL)
    else:
        assert message == head + ". No workaround is known" + TAIL
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
    assert r["detect"] == {"version": f"{NEXT}.dev43+g5d6e7f8", "era": "v0_29",
                           "routing": f"version and probes agree: {NEXT}",
                           "newer_than_tested": True, "drift": summary}
    assert r["warnings"] == [
        (f"vLLM {NEXT}.dev43+g5d6e7f8 is newer than the newest release vllm_compat was tested on "
         f"({newest}); using adapter 'v0_29' (the newest); {summary} (`vllm-compat doctor --drift`)")]


def test_strict_drift_refuses_an_untested_build_whose_drift_breaks_a_capability(runs, newest_era):
    r = runs["strict-drift-required"]
    passes = ("request_id, prompt_token_ids, sampling_params, pooling_params, block_hasher, "
              "eos_token_id where accepted, structured_output_request where accepted")
    assert r["error"] == {"type": "UnsupportedVllmVersionError", "message": (
        f"vLLM {NEXT}.dev44+g9a8b7c6 is newer than the newest release vllm_compat was tested on "
        f"({NEWEST}) and VLLM_COMPAT_STRICT=drift found drift that affects a capability (with "
        "adapter 'v0_29'): requests: Request: expected no required parameter beyond those "
        f"vllm_compat passes ({passes}); found new required parameter(s) 'priority_class' "
        "(workaround: pass it through make_request(..., priority_class=...): make_request "
        f"forwards extra keywords to Request unchanged). Install vLLM <= {NEWEST}, or unset "
        "VLLM_COMPAT_STRICT to run it anyway (`vllm-compat doctor --drift` shows the full report)")}
    assert r["warnings"] == []


def test_strict_drift_refuses_an_untested_build_whose_engine_hashes_otherwise(runs, newest_era):
    # nothing in the declared surface changed: only the engine's block hashes tell
    r = runs["strict-drift-salted"]
    assert r.get("error", {}).get("type") == "UnsupportedVllmVersionError", r
    msg = r["error"]["message"]
    assert "VLLM_COMPAT_STRICT=drift found drift that affects a capability" in msg
    assert "hashing: EngineCore request hasher (sha256)" in msg and "differs: engine" in msg
    assert "block_hasher_for" in msg


def test_strict_1_refuses_every_untested_build_naming_the_adapter(runs, newest_era):
    r = runs["strict-all-none"]
    assert r["error"] == {"type": "UnsupportedVllmVersionError", "message": (
        f"vLLM {NEXT}.dev42+g1a2b3c4 is newer than the newest release vllm_compat was tested on "
        f"({NEWEST}) and VLLM_COMPAT_STRICT=1 refuses untested releases: install vLLM <= {NEWEST}, "
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


# ----------------------------------------------------------------------------- classes of drift
# For each: the error (a VllmDriftError naming the capability, before any side effect), the
# report, and what keeps working: hashes equal to vLLM's own, a request through the scheduler.


def _keeps_hashing_and_scheduling(r: dict) -> None:
    assert r["hashes"] == r["vllm_hashes"] and len(r["hashes"]) == 2, r
    assert r["scheduler"]["finished"] and r["scheduler"]["tokens"] == [7, 7], r["scheduler"]


def _item(doc: dict, kind: str, symbol: str) -> dict:
    found = [i for i in doc["drift"]["items"] if (i["kind"], i["symbol"]) == (kind, symbol)]
    assert len(found) == 1, (kind, symbol, _items(doc))
    return found[0]


def test_a_renamed_two_phase_step_refuses_only_the_model_step(runs, info):
    if not info.probes["two_phase_step"]:
        pytest.skip("0.10.2 has a single-phase step: there is no sample_tokens to rename")
    r = runs["renamed_step"]
    _keeps_hashing_and_scheduling(r)  # detection, hashing, requests and the scheduler work
    assert r["detect_drifted"] == {"model-step": (
        "probe two_phase_step (execute_model + sample_tokens (0.11+)): adapter "
        f"'{info.era}' needs yes, the installed vLLM answers no")}
    e = r["error"]
    assert (e["type"], e["capability"], e["vllm_version"], e["symbol"]) == (
        "MissingSymbolError", "model-step", info.version, "UniProcExecutor.sample_tokens")
    assert re.search(r"has no attribute 'sample_tokens'; candidates with a compatible signature: "
                     r"vllm\.v1\.executor\.\w+:\w*Executor\.sample_step_tokens\(grammar_output",
                     e["found"]), e["found"]
    assert e["workaround"] == (
        "if sample_step_tokens is the successor of sample_tokens, declare it: "
        "VLLM_COMPAT_ALIASES='sample_tokens=sample_step_tokens' or "
        "vllm_compat.alias(sample_tokens='sample_step_tokens') (checked, then used and "
        "reported as drift resolved by alias)")
    # refused before execute_model: the worker was never left in the middle of a step
    assert r["calls_before_alias"] == []
    assert r["pipeline_error"]["symbol"] == "UniProcExecutor.sample_tokens"
    before = r["doctor_before_alias"]
    assert before["exit"] == 1 and before["drift"]["capabilities"] == ["model-step"]
    assert _item(before, "missing", "Executor.sample_tokens")["affects"] is True
    assert "sample_step_tokens" in _item(before, "missing", "Executor.sample_tokens")["found"]
    assert _item(before, "probe_disagrees", "probe two_phase_step")["affects"] is True
    # the way out: the declared alias is checked, used, and reported
    assert r["calls_with_alias"] == ["execute_model", "sample_step_tokens"]
    assert r["finished_with_alias"] == ["m"]
    assert r["doctor_exit"] == 0 and r["doctor"]["drift"]["affects_capability"] is False
    aliased = _item(r["doctor"], "aliased", "Executor.sample_tokens")
    assert aliased["found"].endswith(
        ":Executor.sample_step_tokens (resolved by alias vllm_compat.alias(sample_tokens="
        "'sample_step_tokens'); same signature checked; used there)"), aliased


def test_a_moved_request_module_is_found_and_used(runs, info):
    r = runs["request_moved"]
    assert "error" not in r, r["error"]
    _keeps_hashing_and_scheduling(r)
    doc = r["doctor"]
    assert r["doctor_exit"] == 0 and doc["drift"]["affects_capability"] is False
    for name in ("Request", "RequestStatus"):
        item = _item(doc, "moved", name)
        assert (item["expected"], item["found"], item["affects"]) == (
            f"vllm.v1.request:{name}",
            f"vllm.v1.engine.request_state:{name} (searched; used there)", False)


def test_a_new_required_keyword_of_hash_block_tokens_is_reported_and_absorbed(runs):
    r = runs["hash_keyword"]
    assert "error" not in r, r["error"]
    _keeps_hashing_and_scheduling(r)  # vLLM's request hasher passes it; we never call it
    item = _item(r["doctor"], "params_added", "hash_block_tokens")
    assert (item["found"], item["affects"]) == ("new parameter(s) scheme (required)", False)
    assert r["doctor_exit"] == 0


def test_a_changed_field_type_is_reported_and_absorbed(runs, info):
    snap = drift.load_snapshot(info.base_version)
    if "ndarray" in snap["surface"]["ModelRunnerOutput"]["fields"]["sampled_token_ids"]:
        pytest.skip("this release already types sampled_token_ids as list[np.ndarray]")
    r = runs["field_type"]
    assert "error" not in r, r["error"]
    _keeps_hashing_and_scheduling(r)  # make_model_runner_output built arrays, as on 0.11.x
    item = _item(r["doctor"], "type_changed", "ModelRunnerOutput")
    assert item["found"] == "sampled_token_ids: list[numpy.ndarray]" and item["affects"] is False
    assert r["doctor_exit"] == 0


def test_a_keyword_made_required_is_reported_and_absorbed(runs, info):
    if not info.probes["scheduler_takes_hash_block_size"]:
        pytest.skip("Scheduler has no hash_block_size before 0.20")
    r = runs["now_required"]
    assert "error" not in r, r["error"]
    _keeps_hashing_and_scheduling(r)  # make_scheduler passes it where the signature has it
    item = _item(r["doctor"], "param_now_required", "Scheduler")
    assert (item["found"], item["affects"]) == ("hash_block_size required", False)
    assert r["doctor_exit"] == 0


def test_a_module_split_is_found_by_search_and_used(runs, info):
    r = runs["module_split"]
    assert "error" not in r, r["error"]
    _keeps_hashing_and_scheduling(r)  # the root is read where it went: hashes equal vLLM's
    doc = r["doctor"]
    assert r["doctor_exit"] == 0 and doc["drift"]["affects_capability"] is False
    for name in ("init_none_hash", "get_request_block_hasher", "hash_block_tokens",
                 "generate_block_hash_extra_keys"):
        item = _item(doc, "moved", name)
        assert item["found"] == f"vllm.v1.core.block_hashing:{name} (searched; used there)", item
    assert _item(doc, "moved", "NONE_HASH")["found"] == (
        "vllm.v1.core.block_hashing:NONE_HASH (beside; used there)")


def test_on_a_moved_request_module_the_suite_passes_or_marks_its_oracle(runs):
    res = runs["suite-request_moved"]
    bad = {n: m for n, (o, m) in res.items() if o in ("failure", "error")}
    assert bad == {}, bad
    xfailed = {n: m for n, (o, m) in res.items() if o == "xfailed"}
    # the tests that build a raw Request through the reference: vLLM's old path is gone
    assert set(xfailed) >= RAW_REQUEST_TESTS
    assert all(m.startswith(ORACLE_OUTDATED) for m in xfailed.values()), xfailed
