"""The drift report: the installed vLLM against the declared surface and the stored snapshot
of the nearest tested release (pure Python: never imports vLLM).

Inputs are what the resolver read from the installed vLLM (``resolve.survey()`` and
``probe_values()``); :func:`compare` turns them into :class:`DriftItem` s, each naming the
capability it affects and whether it breaks it (``affects``). ``vllm-compat doctor --drift``
prints the report and exits non-zero when an item affects a capability; the snapshots of the
tested releases live in ``vllm_compat/snapshots/<release>.json`` (``nox -s conformance``
rewrites them, see ``matrix/snapshot.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from packaging.version import Version

from . import aliases, surface, versions

SNAPSHOTS = versions.SNAPSHOTS  # shipped with the package

# The kinds of drift, and what each means for a capability.
KINDS: dict[str, str] = {
    "missing": "a symbol vllm_compat uses is at none of its known places and a search did not find it",
    "moved": "a symbol is somewhere else than this release should have it; vllm_compat uses it there",
    "aliased": "a symbol is missing under its name; a declared alias names its successor, which "
               "took the same call and is used (drift resolved by alias)",
    "new_required_param": "a callable requires a parameter vllm_compat does not pass",
    "removed_param": "a callable no longer takes a parameter vllm_compat passes",
    "returns_changed": "a callable returns another type than vllm_compat relies on",
    "probe_unknown": "a feature probe cannot tell (what it reads is missing or unreadable)",
    "probe_disagrees": "an era-defining probe disagrees with the adapter in use",
    "probe_changed": "a feature probe reads otherwise than on the nearest tested release",
    "gone": "a symbol the nearest tested release had is gone (vllm_compat copes without it)",
    "appeared": "a symbol the nearest tested release lacked is here",
    "params_added": "a callable has parameters the nearest tested release lacked",
    "params_removed": "a callable lost parameters vllm_compat does not pass",
    "param_now_required": "a parameter that was optional on the nearest tested release is required",
    "type_changed": "a field of a class vllm_compat builds or reads back changed its declared type",
    "return_annotation_changed": "a callable's return annotation differs from the nearest tested release",
    "hash_scheme_changed": "the engine's request hasher gives other block hashes than "
                           "vllm_compat's for the same request (no prefix-cache hit between them)",
    "hash_check_unknown": "the engine's request hasher could not be rebuilt to compare with",
    "hash_fingerprint_changed": "the engine's block hashes of the fixed probe requests differ from "
                                "the nearest tested release's (persisted or shared caches miss)",
}


@dataclass(frozen=True)
class DriftItem:
    kind: str
    symbol: str
    capability: str
    expected: str
    found: str
    affects: bool
    workaround: str = ""

    def line(self) -> str:
        head = f"[{self.capability}] {self.symbol}: {self.kind.replace('_', ' ')}"
        head += " (affects the capability)" if self.affects else " (no capability affected)"
        out = [head, f"    expected: {self.expected}", f"    found:    {self.found}"]
        if self.workaround:
            out.append(f"    workaround: {self.workaround}")
        return "\n".join(out)


@dataclass
class DriftReport:
    vllm: str
    adapter: str
    nearest_tested: str | None
    items: list[DriftItem] = field(default_factory=list)

    @property
    def affecting(self) -> list[DriftItem]:
        return [i for i in self.items if i.affects]

    @property
    def capabilities(self) -> list[str]:
        return sorted({i.capability for i in self.affecting})

    def summary(self) -> str:
        against = (f"against {self.nearest_tested}" if self.nearest_tested
                   else "(no stored snapshot to compare with)")
        if not self.items:
            return f"drift check {against}: no drift"
        n, bad = len(self.items), len(self.affecting)
        if not bad:
            return (f"drift check {against}: {n} change{'s' if n != 1 else ''}, none affects a "
                    "capability")
        return (f"drift check {against}: {n} change{'s' if n != 1 else ''}, {bad} affect"
                f"{'s' if bad == 1 else ''} {', '.join(self.capabilities)}")

    def affecting_lines(self) -> list[str]:
        return [f"{i.capability}: {i.symbol}: expected {i.expected}; found {i.found}"
                + (f" (workaround: {i.workaround})" if i.workaround else "")
                for i in self.affecting]

    def as_dict(self) -> dict[str, Any]:
        return {"vllm": self.vllm, "adapter": self.adapter, "nearest_tested": self.nearest_tested,
                "affects_capability": bool(self.affecting), "capabilities": self.capabilities,
                "summary": self.summary(), "items": [asdict(i) for i in self.items]}

    def format(self) -> str:
        lines = [self.summary()]
        for item in sorted(self.items, key=lambda i: (not i.affects, i.capability, i.symbol)):
            lines.append("  " + item.line().replace("\n", "\n  "))
        return "\n".join(lines)


# --------------------------------------------------------------------------- snapshots


def tested_snapshots() -> list[str]:
    """The releases with a stored snapshot, oldest first."""
    if not SNAPSHOTS.is_dir():
        return []
    return sorted((p.stem for p in SNAPSHOTS.glob("*.json")), key=Version)


def load_snapshot(release: str) -> dict[str, Any] | None:
    try:
        return json.loads((SNAPSHOTS / f"{release}.json").read_text())
    except FileNotFoundError:
        return None


def nearest_tested(version: str, era: str, releases: list[str] | None = None) -> str | None:
    """The tested release to compare with: of the adapter's era when one is stored, the
    newest at or below the installed base version, else the oldest above it."""
    releases = tested_snapshots() if releases is None else releases
    if not releases:
        return None
    base = versions.base_version(version)
    same = [r for r in releases if versions.era_for_version(r).name == era] or releases
    below = [r for r in same if Version(r) <= base]
    return max(below, key=Version) if below else min(same, key=Version)


# --------------------------------------------------------------------------- compare


def _yn(value: bool | None) -> str:
    return "cannot tell" if value is None else "yes" if value else "no"


def _capability(key: str) -> str:
    s = surface.BY_KEY.get(key)
    return s.capability if s is not None else "?"


def _declared_items(key: str, row: Mapping[str, Any]) -> list[DriftItem]:
    """What the installed build breaks of the declared surface (no snapshot needed)."""
    s = surface.BY_KEY[key]
    cap = s.capability
    expected_at = row.get("expected_at") or key
    if s.parent is not None and expected_at == key:
        expected_at = f"{s.parent} to have '{s.member}'"
    items: list[DriftItem] = []
    status = row.get("status")
    # a symbol vllm_compat does not call (direct=False) is reported, never affects
    direct = s.direct
    if status == "missing":
        candidates = list(row.get("candidates") or ())
        found = row.get("missing") or "not found"
        workaround = s.workaround if "{param}" not in s.workaround else ""
        if candidates:
            found += "; candidates with a compatible signature: " + ", ".join(candidates)
            workaround = alias_hint(s.member, candidates[0]) if direct else ""
        items.append(DriftItem("missing", key, cap, expected_at, found, direct, workaround))
    elif status == "moved":
        items.append(DriftItem("moved", key, cap, expected_at,
                               f"{row.get('at')} ({row.get('how', 'searched')}; used there)", False))
    elif status == "aliased":
        items.append(DriftItem("aliased", key, cap, expected_at,
                               f"{row.get('at')} (resolved by alias {row.get('alias')}; same "
                               "signature checked; used there)", False))
    new_required = list(row.get("new_required") or ())
    if new_required and direct:
        given = list(s.passes) + [f"{p} where accepted" for p in s.passes_if_accepted]
        items.append(DriftItem(
            "new_required_param", key, cap,
            "no required parameter beyond those vllm_compat passes"
            + (f" ({', '.join(given)})" if given else ""),
            "new required parameter(s) " + ", ".join(repr(p) for p in new_required), True,
            s.workaround.replace("{param}", new_required[0]) if s.workaround else ""))
    removed = list(row.get("removed") or ())
    if removed and direct:
        items.append(DriftItem("removed_param", key, cap,
                               "accepts " + ", ".join(repr(p) for p in removed),
                               "parameter(s) " + ", ".join(repr(p) for p in removed) + " removed",
                               True))
    if row.get("contract") and direct:
        expected = {"hash_fn": "get_hash_fn_by_name(name) returns a function that returns bytes"}
        items.append(DriftItem("returns_changed", key, cap, expected.get(s.returns or "", "?"),
                               str(row["contract"]), True))
    return items


def _snapshot_items(key: str, now: Mapping[str, Any], then: Mapping[str, Any] | None,
                    declared: list[DriftItem], release: str) -> list[DriftItem]:
    """What changed since the nearest tested release that the declared check did not say."""
    if then is None:
        return []
    cap = _capability(key)
    kinds = {i.kind for i in declared}
    items: list[DriftItem] = []
    was = then.get("status") in ("present", "moved", "aliased")
    is_ = now.get("status") in ("present", "moved", "aliased")
    if was and not is_ and "missing" not in kinds:
        items.append(DriftItem("gone", key, cap, f"{then.get('at')} (as in {release})",
                               "not found", False))
    elif is_ and not was:
        items.append(DriftItem("appeared", key, cap, f"absent (as in {release})",
                               str(now.get("at")), False))
    elif was and is_ and then.get("at") != now.get("at") and not {"moved", "aliased"} & kinds:
        items.append(DriftItem("moved", key, cap, f"{then.get('at')} (as in {release})",
                               str(now.get("at")), False))
    p_then, p_now = then.get("params"), now.get("params")
    if isinstance(p_then, dict) and isinstance(p_now, dict):
        flagged = set(now.get("new_required") or ()) | set(now.get("removed") or ())
        added = [n for n in p_now if n not in p_then and n not in flagged]
        if added:
            text = ", ".join(f"{n} ({'required' if p_now[n] else 'optional'})" for n in added)
            items.append(DriftItem("params_added", key, cap, f"the parameters of {release}",
                                   f"new parameter(s) {text}", False))
        dropped = [n for n in p_then if n not in p_now and n not in flagged]
        if dropped:
            items.append(DriftItem("params_removed", key, cap, f"the parameters of {release}",
                                   "removed parameter(s) " + ", ".join(dropped), False))
        # passed where accepted, or not passed at all: vllm_compat copes or the declared
        # check above named it (new_required)
        hardened = [n for n in p_now if n in p_then and p_now[n] and not p_then[n]
                    and n not in flagged]
        if hardened:
            items.append(DriftItem("param_now_required", key, cap,
                                   f"{', '.join(hardened)} optional (as in {release})",
                                   f"{', '.join(hardened)} required", False))
    f_then, f_now = then.get("fields"), now.get("fields")
    if isinstance(f_then, dict) and isinstance(f_now, dict):
        for name, was_type in f_then.items():
            if name in f_now and f_now[name] != was_type:
                items.append(DriftItem("type_changed", key, cap,
                                       f"{name}: {was_type or 'no such field'} (as in {release})",
                                       f"{name}: {f_now[name] or 'no such field'}", False))
    if was and is_ and then.get("returns") != now.get("returns"):
        items.append(DriftItem("return_annotation_changed", key, cap,
                               f"-> {then.get('returns')} (as in {release})",
                               f"-> {now.get('returns')}", False))
    return items


def alias_hint(member: str, candidate: str) -> str:
    """The way out of a missing symbol with a successor candidate (``module:Class.name(...)``):
    declare it as an alias, which the resolver checks before it uses it."""
    new = candidate.split("(")[0].rpartition(".")[2].rpartition(":")[2]
    return (f"if {new} is the successor of {member}, declare it: "
            f"{aliases.ENV}='{member}={new}' or vllm_compat.alias({member}={new!r}) "
            "(checked, then used and reported as drift resolved by alias)")


def _probe_items(probes: Mapping[str, bool | None], era: versions.Era,
                 then: Mapping[str, bool | None] | None, release: str | None) -> list[DriftItem]:
    items: list[DriftItem] = []
    for p in surface.PROBES:
        value = probes.get(p.name)
        what = f"probe {p.name}"
        if value is None:
            if then is not None and p.name in then and then[p.name] is None:
                continue  # the nearest tested release could not tell either: nothing changed
            items.append(DriftItem(
                "probe_unknown", what, p.capability,
                f"a yes/no answer ({p.meaning})" if p.meaning else "a yes/no answer",
                f"cannot tell: {p.symbol} is missing or unreadable", True))
            continue
        if p.era_defining and era.signature.get(p.name) is not None \
                and bool(era.signature[p.name]) != value:
            items.append(DriftItem(
                "probe_disagrees", what, p.capability,
                f"{_yn(era.signature[p.name])}, as adapter '{era.name}' assumes",
                _yn(value), True))
            continue
        if then is not None and p.name in then and then[p.name] != value:
            items.append(DriftItem("probe_changed", what, p.capability,
                                   f"{_yn(then[p.name])} (as in {release})", _yn(value), False))
    return items


def compare(version: str, era_name: str, probes: Mapping[str, bool | None],
            survey: Mapping[str, Mapping[str, Any]],
            snapshot: Mapping[str, Any] | None = None,
            nearest: str | None = None) -> DriftReport:
    """The drift report of a build (its probes and surface) against the declared surface and,
    when given, the snapshot of the nearest tested release ``nearest``."""
    era = versions.ERAS_BY_NAME[era_name]
    report = DriftReport(vllm=version, adapter=era_name, nearest_tested=nearest)
    then_surface = (snapshot or {}).get("surface") or {}
    for s in surface.SYMBOLS:
        row = survey.get(s.key)
        if row is None:
            continue
        declared = _declared_items(s.key, row)
        report.items += declared
        if snapshot is not None:
            report.items += _snapshot_items(s.key, row, then_surface.get(s.key), declared,
                                            nearest or "?")
    report.items += _probe_items(probes, era, (snapshot or {}).get("probes") if snapshot else None,
                                 nearest)
    return report


def hash_items(checks: Sequence[Mapping[str, Any]], fingerprint: Mapping[str, Any] | None,
               snapshot: Mapping[str, Any] | None, nearest: str | None) -> list[DriftItem]:
    """Items for the engine-hash check (``hash_check.check`` results as dicts) and for the
    engine's hash fingerprint against the one the nearest tested release recorded."""
    items: list[DriftItem] = []
    workaround = ("use the engine's own hasher: block_hasher_for(engine_core | llm | scheduler) "
                  "or make_request(..., block_hasher=...)")
    for c in checks:
        symbol = f"EngineCore request hasher ({c['hash_algo']})"
        if c.get("error"):
            if c.get("error_side") == "vllm_compat":
                continue  # our hashing drifted: the surface items above name it
            items.append(DriftItem("hash_check_unknown", symbol, "hashing",
                                   "the engine's hasher set-up, replayable without a model",
                                   f"cannot tell: {c['error']}", False))
        elif c.get("differs"):
            items.append(DriftItem(
                "hash_scheme_changed", symbol, "hashing",
                "the engine's block hashes equal vllm_compat's on the probe requests",
                f"differs: {c['differs']}", True, workaround))
    then = (snapshot or {}).get("hash_fingerprint")
    if fingerprint is None:
        return items
    if not isinstance(then, Mapping) or then.get("seed") != fingerprint.get("seed") \
            or then.get("block_size") != fingerprint.get("block_size"):
        return items  # not recorded for the nearest tested release: nothing to compare
    for algo, probes in (fingerprint.get("algos") or {}).items():
        was = (then.get("algos") or {}).get(algo)
        if was is None or was == probes:
            continue
        changed = [name for name in probes if probes[name] != was.get(name)]
        items.append(DriftItem(
            "hash_fingerprint_changed", f"block hashes ({algo})", "hashing",
            f"the engine's hashes of the probe requests as in {nearest}",
            "other hashes for " + ", ".join(repr(n) for n in changed), False))
    return items


def check(version: str, era_name: str, probes: Mapping[str, bool | None],
          survey: Mapping[str, Mapping[str, Any]]) -> DriftReport:
    """:func:`compare` against the stored snapshot of the nearest tested release."""
    nearest = nearest_tested(version, era_name)
    snapshot = load_snapshot(nearest) if nearest is not None else None
    return compare(version, era_name, probes, survey, snapshot, nearest)
