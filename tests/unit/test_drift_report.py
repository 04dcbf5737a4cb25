"""The drift report (vllm_compat.drift) on the stored snapshots, without vLLM.

The "installed build" of each test is the stored snapshot of a tested release with one change
applied, shaped as the resolver's survey reports it; the conformance tests
(tests/conformance/test_drift.py) make the same changes in a real vLLM and check that the
resolver reports them this way.
"""

from __future__ import annotations

import copy

import pytest

from vllm_compat import drift, surface, versions

RELEASES = drift.tested_snapshots()


def _snap(release: str = "0.33.0") -> dict:
    snap = drift.load_snapshot(release)
    assert snap is not None, f"no stored snapshot for {release}"
    return snap


def _report(live: dict, release: str = "0.33.0", version: str = "0.34.0.dev43+g5d6e7f8",
            era: str = "v0_29") -> drift.DriftReport:
    return drift.compare(version, era, live["probes"], live["surface"], _snap(release), release)


# ----------------------------------------------------------------------------- stored snapshots


def test_every_release_of_the_matrix_has_a_snapshot():
    import tomllib
    from pathlib import Path

    matrix = tomllib.loads((Path(__file__).resolve().parents[2] / "matrix" / "releases.toml").read_text())
    assert set(matrix["ci"]) <= set(RELEASES)
    missing = sorted(set(matrix["releases"]) - set(RELEASES))
    assert missing == [], f"regenerate: nox -s snapshot (missing {missing})"


@pytest.mark.parametrize("release", RELEASES)
def test_a_snapshot_covers_the_whole_surface(release):
    # a symbol added to vllm_compat.surface needs new snapshots (nox -s snapshot)
    snap = _snap(release)
    assert snap["vllm"] == release
    assert sorted(snap["surface"]) == sorted(s.key for s in surface.SYMBOLS)
    assert sorted(snap["probes"]) == sorted(p.name for p in surface.PROBES)


@pytest.mark.parametrize("release", RELEASES)
def test_the_declared_surface_holds_on_every_tested_release(release):
    # what the resolver found in the real wheels: every used symbol where the surface says,
    # every signature as the calling code needs it, every probe able to tell
    snap = _snap(release)
    bad = {k: row for k, row in snap["surface"].items()
           if row["status"] in ("missing", "moved") or row.get("new_required")
           or row.get("removed") or row.get("contract")}
    assert bad == {}
    assert all(v is not None for v in snap["probes"].values())
    assert versions.era_for_probes(snap["probes"]) is versions.era_for_version(release)


@pytest.mark.parametrize("release", RELEASES)
def test_a_tested_release_shows_no_drift_against_itself(release):
    snap = _snap(release)
    era = versions.era_for_version(release).name
    report = drift.compare(release, era, snap["probes"], snap["surface"], snap, release)
    assert report.items == [] and report.summary() == f"drift check against {release}: no drift"
    assert report.as_dict()["affects_capability"] is False


# ----------------------------------------------------------------------------- nearest release


def test_nearest_tested_release():
    rels = ["0.10.2", "0.11.2", "0.16.0", "0.17.1", "0.26.0", "0.33.0"]
    assert drift.nearest_tested("0.34.0.dev43+g5d6e7f8", "v0_29", rels) == "0.33.0"
    assert drift.nearest_tested("0.26.1rc2", "v0_17", rels) == "0.26.0"
    # 0.11.0 routes to v0_11: compared with a release of its era (0.11.2), not with 0.10.2
    assert drift.nearest_tested("0.11.0", "v0_11", rels) == "0.11.2"
    # a forced adapter with no stored release of its era: the nearest release at or below
    assert drift.nearest_tested("0.34.0", "v0_29", ["0.10.2", "0.26.0"]) == "0.26.0"
    assert drift.nearest_tested("0.34.0", "v0_29", []) is None


# ----------------------------------------------------------------------------- one change each


def test_moved_symbol_is_reported_and_affects_nothing():
    live = copy.deepcopy(_snap())
    for key in ("init_none_hash", "NONE_HASH", "DEFAULT_NONE_HASH_SEED"):
        live["surface"][key].update(status="moved", at=f"vllm.utils.hashing:{key}", how="alternate")
    report = _report(live)
    assert [(i.kind, i.symbol, i.affects) for i in report.items] == [
        ("moved", "init_none_hash", False), ("moved", "NONE_HASH", False),
        ("moved", "DEFAULT_NONE_HASH_SEED", False)]
    assert report.items[0].expected == "vllm.v1.core.kv_cache_utils:init_none_hash"
    assert report.items[0].found == "vllm.utils.hashing:init_none_hash (alternate; used there)"
    assert report.summary() == "drift check against 0.33.0: 3 changes, none affects a capability"
    assert report.affecting == [] and report.capabilities == []


def test_new_required_parameter_names_the_workaround():
    live = copy.deepcopy(_snap())
    row = live["surface"]["Request"]
    row["params"]["priority_class"] = True
    row["new_required"] = ["priority_class"]
    report = _report(live, version="0.34.0.dev44+g9a8b7c6")
    (item,) = report.items  # the new parameter is not reported twice (params_added)
    assert item == drift.DriftItem(
        kind="new_required_param", symbol="Request", capability="requests",
        expected=("no required parameter beyond those vllm_compat passes (request_id, "
                  "prompt_token_ids, sampling_params, pooling_params, block_hasher, eos_token_id "
                  "where accepted, structured_output_request where accepted)"),
        found="new required parameter(s) 'priority_class'", affects=True,
        workaround=("pass it through make_request(..., priority_class=...): make_request forwards "
                    "extra keywords to Request unchanged"))
    assert report.capabilities == ["requests"]
    assert report.summary() == "drift check against 0.33.0: 1 change, 1 affects requests"
    assert report.format() == "\n".join([
        "drift check against 0.33.0: 1 change, 1 affects requests",
        "  [requests] Request: new required param (affects the capability)",
        f"      expected: {item.expected}",
        "      found:    new required parameter(s) 'priority_class'",
        f"      workaround: {item.workaround}",
    ])
    assert report.affecting_lines() == [
        f"requests: Request: expected {item.expected}; found new required parameter(s) "
        f"'priority_class' (workaround: {item.workaround})"]


def test_missing_symbol_affects_its_capability():
    live = copy.deepcopy(_snap())
    live["surface"]["init_none_hash"] = {
        "expected_at": "vllm.v1.core.kv_cache_utils:init_none_hash", "status": "missing", "at": None,
        "missing": "not at vllm.v1.core.kv_cache_utils:init_none_hash, vllm.utils.hashing:init_none_hash, "
                   "nor anywhere under vllm.utils, vllm.v1.core"}
    report = _report(live)
    (item,) = report.items
    assert (item.kind, item.symbol, item.capability, item.affects) == (
        "missing", "init_none_hash", "hashing", True)
    assert item.found.startswith("not at vllm.v1.core.kv_cache_utils:init_none_hash")
    assert report.as_dict()["capabilities"] == ["hashing"]


def test_removed_parameter_affects_its_capability():
    live = copy.deepcopy(_snap())
    row = live["surface"]["Scheduler"]
    del row["params"]["include_finished_set"]
    row["removed"] = ["include_finished_set"]
    (item,) = _report(live).items
    assert (item.kind, item.symbol, item.capability, item.affects) == (
        "removed_param", "Scheduler", "scheduler", True)
    assert item.found == "parameter(s) 'include_finished_set' removed"


def test_changed_return_type_affects_its_capability():
    live = copy.deepcopy(_snap())
    live["surface"]["get_hash_fn_by_name"]["contract"] = "its function returned str"
    (item,) = _report(live).items
    assert (item.kind, item.capability, item.affects, item.found) == (
        "returns_changed", "hashing", True, "its function returned str")
    assert item.expected == "get_hash_fn_by_name(name) returns a function that returns bytes"


def test_probe_states():
    live = copy.deepcopy(_snap())
    live["probes"]["missing_hasher_tolerated"] = None        # cannot tell
    live["probes"]["fixed_none_hash_seed"] = False           # era-defining, disagrees with v0_29
    live["probes"]["schedule_takes_throttle_prefills"] = False  # changed, handled by a probe
    got = [(i.kind, i.symbol, i.affects, i.expected, i.found) for i in _report(live).items]
    assert got == [
        ("probe_disagrees", "probe fixed_none_hash_seed", True,
         "yes, as adapter 'v0_29' assumes", "no"),
        ("probe_changed", "probe schedule_takes_throttle_prefills", False, "yes (as in 0.33.0)", "no"),
        ("probe_unknown", "probe missing_hasher_tolerated", True, "a yes/no answer (0.33+)",
         "cannot tell: SingleTypeKVCacheManager.cache_blocks is missing or unreadable"),
    ]


def test_changes_since_the_nearest_release_that_break_nothing():
    live = copy.deepcopy(_snap())
    live["surface"]["Request"]["params"]["new_hint"] = False
    del live["surface"]["Request"]["params"]["kv_hints"]
    live["surface"]["get_request_block_hasher"]["returns"] = "list"
    live["surface"]["resolve_kv_cache_block_sizes"].update(status="absent", at=None)
    got = [(i.kind, i.symbol, i.affects, i.found) for i in _report(live).items]
    assert got == [
        ("return_annotation_changed", "get_request_block_hasher", False, "-> list"),
        ("params_added", "Request", False, "new parameter(s) new_hint (optional)"),
        ("params_removed", "Request", False, "removed parameter(s) kv_hints"),
        ("gone", "resolve_kv_cache_block_sizes", False, "not found"),
    ]


def test_report_json_shape():
    live = copy.deepcopy(_snap())
    live["surface"]["Request"]["new_required"] = ["priority_class"]
    out = _report(live).as_dict()
    assert sorted(out) == ["adapter", "affects_capability", "capabilities", "items",
                           "nearest_tested", "summary", "vllm"]
    assert out["vllm"] == "0.34.0.dev43+g5d6e7f8" and out["adapter"] == "v0_29"
    assert sorted(out["items"][0]) == ["affects", "capability", "expected", "found", "kind",
                                       "symbol", "workaround"]


def test_every_capability_and_kind_is_described():
    assert {s.capability for s in surface.SYMBOLS} <= set(surface.CAPABILITIES)
    assert {p.capability for p in surface.PROBES} <= set(surface.CAPABILITIES)
    assert set(drift.KINDS) >= {"missing", "moved", "new_required_param", "removed_param",
                                "returns_changed", "probe_unknown", "probe_disagrees"}


# ----------------------------------------------------------------------------- successors, aliases, types


def test_a_missing_member_names_its_candidates_and_the_alias_that_would_use_one():
    live = copy.deepcopy(_snap())
    live["surface"]["Executor.sample_tokens"] = {
        "expected_at": None, "status": "missing", "at": None,
        "missing": "vllm.v1.executor.abstract:Executor has no attribute 'sample_tokens'",
        "candidates": ["vllm.v1.executor.abstract:Executor.sample_step_tokens(grammar_output, "
                       "non_block=False)"]}
    live["probes"]["two_phase_step"] = False
    report = _report(live)
    item = next(i for i in report.items if i.symbol == "Executor.sample_tokens")
    assert (item.kind, item.capability, item.affects) == ("missing", "model-step", True)
    assert item.expected == "Executor to have 'sample_tokens'"
    assert item.found.endswith("; candidates with a compatible signature: vllm.v1.executor."
                               "abstract:Executor.sample_step_tokens(grammar_output, non_block=False)")
    assert item.workaround == (
        "if sample_step_tokens is the successor of sample_tokens, declare it: "
        "VLLM_COMPAT_ALIASES='sample_tokens=sample_step_tokens' or "
        "vllm_compat.alias(sample_tokens='sample_step_tokens') (checked, then used and reported "
        "as drift resolved by alias)")
    assert report.capabilities == ["model-step"]


def test_an_aliased_symbol_is_reported_as_resolved_by_alias():
    live = copy.deepcopy(_snap())
    live["surface"]["Executor.sample_tokens"].update(
        status="aliased", at="vllm.v1.executor.abstract:Executor.sample_step_tokens", how="alias",
        alias="VLLM_COMPAT_ALIASES=sample_tokens=sample_step_tokens")
    report = _report(live)
    assert [(i.kind, i.symbol, i.affects) for i in report.items] == [
        ("aliased", "Executor.sample_tokens", False)]
    assert report.items[0].found == (
        "vllm.v1.executor.abstract:Executor.sample_step_tokens (resolved by alias "
        "VLLM_COMPAT_ALIASES=sample_tokens=sample_step_tokens; same signature checked; used there)")


def test_a_symbol_vllm_compat_does_not_call_never_affects_a_capability():
    assert surface.BY_KEY["hash_block_tokens"].direct is False
    live = copy.deepcopy(_snap())
    live["surface"]["hash_block_tokens"]["params"]["scheme"] = True
    row = live["surface"]["generate_block_hash_extra_keys"]
    row.update(status="missing", at=None, missing="not found")
    report = _report(live)
    assert [(i.kind, i.symbol, i.affects) for i in report.items] == [
        ("params_added", "hash_block_tokens", False),
        ("missing", "generate_block_hash_extra_keys", False)]
    assert report.items[0].found == "new parameter(s) scheme (required)"
    assert report.affecting == []


def test_a_changed_field_type_and_a_parameter_made_required_are_reported():
    live = copy.deepcopy(_snap())
    live["surface"]["ModelRunnerOutput"]["fields"]["sampled_token_ids"] = "list[numpy.ndarray]"
    live["surface"]["Scheduler"]["params"]["hash_block_size"] = True
    report = _report(live)
    assert [(i.kind, i.symbol, i.expected, i.found, i.affects) for i in report.items] == [
        ("param_now_required", "Scheduler", "hash_block_size optional (as in 0.33.0)",
         "hash_block_size required", False),
        ("type_changed", "ModelRunnerOutput", "sampled_token_ids: list[list[int]] (as in 0.33.0)",
         "sampled_token_ids: list[numpy.ndarray]", False)]


def test_a_probe_the_nearest_release_could_not_tell_either_is_no_drift():
    live, snap = copy.deepcopy(_snap()), copy.deepcopy(_snap())
    live["probes"]["text_only_without_tokenizer"] = None
    snap["probes"]["text_only_without_tokenizer"] = None
    report = drift.compare("0.34.0.dev1", "v0_29", live["probes"], live["surface"], snap, "0.33.0")
    assert report.items == []
    report = _report(live)  # against the real snapshot, which could tell
    assert [(i.kind, i.affects) for i in report.items] == [("probe_unknown", True)]


# ----------------------------------------------------------------------------- engine hashes

def _check(algo: str, differs: str | None = None, error: str | None = None) -> dict:
    return {"hash_algo": algo, "block_size": 16, "lookahead_tokens": 0, "differs": differs,
            "error": error, "probes": {}}


def test_engine_hashes_that_differ_from_ours_affect_hashing():
    items = drift.hash_items([_check("sha256", differs="engine"), _check("sha256_cbor")],
                             None, None, None)
    assert [(i.kind, i.symbol, i.affects, i.found) for i in items] == [
        ("hash_scheme_changed", "EngineCore request hasher (sha256)", True, "differs: engine")]
    assert "block_hasher_for" in items[0].workaround


def test_a_hash_check_that_cannot_run_is_reported_not_affecting():
    engine = {**_check("sha256", error="no hasher block"), "error_side": "engine"}
    ours = {**_check("sha256_cbor", error="init_none_hash missing"), "error_side": "vllm_compat"}
    items = drift.hash_items([engine, ours], None, None, None)
    # our own hashing drift is named by the surface items: not twice
    assert [(i.kind, i.symbol, i.affects) for i in items] == [
        ("hash_check_unknown", "EngineCore request hasher (sha256)", False)]


def test_the_engines_fingerprint_against_the_nearest_release():
    then = drift.load_snapshot("0.33.0")["hash_fingerprint"]
    same = copy.deepcopy(then)
    assert drift.hash_items([], same, {"hash_fingerprint": then}, "0.33.0") == []
    changed = copy.deepcopy(then)
    changed["algos"]["sha256"]["chat, cache_salt"][0] = "00" * 32
    items = drift.hash_items([], changed, {"hash_fingerprint": then}, "0.33.0")
    assert [(i.kind, i.symbol, i.affects) for i in items] == [
        ("hash_fingerprint_changed", "block hashes (sha256)", False)]
    assert "'chat, cache_salt'" in items[0].found and "0.33.0" in items[0].expected
    # a release whose snapshot has no fingerprint: not recorded, nothing reported
    assert drift.hash_items([], changed, {"surface": {}}, "0.11.2") == []


@pytest.mark.parametrize("release", drift.tested_snapshots())
def test_fingerprints_are_recorded_for_every_tested_release(release):
    fp = drift.load_snapshot(release)["hash_fingerprint"]
    assert fp["block_size"] == 16 and {"sha256", "sha256_cbor"} <= set(fp["algos"])
    assert all(len(h) == 5 for probes in fp["algos"].values() for h in probes.values())
