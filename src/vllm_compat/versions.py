"""Version parsing and era routing. Pure Python: never imports vLLM.

vLLM is routed on the *base* version (``0.11.1rc6.dev16+g933cdea44.cu129`` -> 0.11.1)
and then checked against feature probes, because nightlies and forks sit between
releases. Probes are tri-state (yes / no / cannot tell, ``None``). Rules:

- within the tested range, probes that disagree with the version win, and the routing
  reason names them, unless the era they point to could not run on the build (a probe
  denies one of its requirements): then the version's era is kept and the disagreeing
  probe is reported as drift of its capability;
- a probe that cannot tell never moves a build to an older era (it matches any era, and
  of the eras the other probes allow, the one nearest the version's is taken, the newer
  on a tie);
- a build newer than the newest tested release keeps the newest era whatever its probes
  say (the reason names the disagreeing probes, ``doctor --drift`` reports them).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from dataclasses import dataclass, field
from typing import Mapping

from packaging.version import InvalidVersion, Version

from .errors import InvalidVllmVersionError, UnknownAdapterError, UnsupportedVllmVersionError


@dataclass(frozen=True)
class Era:
    """One adapter: the vLLM releases it covers and the probe values that define it."""

    name: str
    first: Version  # first base version covered (inclusive)
    module: str  # module under vllm_compat.adapters that implements it
    # Probe values every release of the era shows; used to verify or override the version.
    signature: Mapping[str, bool] = field(default_factory=dict)
    summary: str = ""
    # Probe values without which the module cannot run at all (checked also when forced).
    requires: Mapping[str, bool] = field(default_factory=dict)


ERAS: tuple[Era, ...] = (
    Era(
        "v0_10", Version("0.10.2"), "v0_10",
        {"two_phase_step": False, "request_takes_eos": True, "fixed_none_hash_seed": False},
        "single-phase execute_model; hashing in vllm.utils; Scheduler without block_size",
        {"two_phase_step": False, "hashing_module": False},
    ),
    Era(
        "v0_11", Version("0.11.0"), "v0_11",
        {"two_phase_step": True, "request_takes_eos": True, "fixed_none_hash_seed": False},
        "execute_model + sample_tokens; Request(eos_token_id=...) required",
        {"two_phase_step": True, "hashing_module": True},
    ),
    Era(
        "v0_17", Version("0.17.0"), "_common",
        {"two_phase_step": True, "request_takes_eos": False, "fixed_none_hash_seed": False},
        "Request without eos_token_id; NONE_HASH random per process unless PYTHONHASHSEED",
        {"two_phase_step": True, "hashing_module": True},
    ),
    Era(
        "v0_29", Version("0.29.0"), "_common",
        {"two_phase_step": True, "request_takes_eos": False, "fixed_none_hash_seed": True},
        "model runner V2 by default; NONE_HASH fixed for sha256",
        {"two_phase_step": True, "hashing_module": True},
    ),
)
ERAS_BY_NAME = {e.name: e for e in ERAS}
OLDEST_SUPPORTED = ERAS[0].first
# The tested releases are the ones with a stored snapshot (shipped in the package; the matrix,
# matrix/releases.toml, writes one per release): a release without API change is added by its
# snapshot and its line in that table, nothing here.
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"


def tested_releases() -> tuple[Version, ...]:
    """Every tested release, oldest first (one snapshot each)."""
    return tuple(sorted(Version(p.stem) for p in SNAPSHOTS.glob("*.json")))


# Newest release the matrix has run; a later base version still gets the newest adapter, with a warning.
NEWEST_TESTED = tested_releases()[-1] if tested_releases() else OLDEST_SUPPORTED
# anything below this is a release of the newest tested series or older
NEWEST_TESTED_SERIES = Version(f"{NEWEST_TESTED.major}.{NEWEST_TESTED.minor + 1}.0")

_warned_newer: set[str] = set()


def parse_vllm_version(text: str) -> Version:
    """Parse a vLLM version string (release, rc, dev, post, local) with PEP 440 rules."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidVllmVersionError(
            f"not a vLLM version string: {text!r} (expected a PEP 440 version such as '0.11.1' "
            "or '0.11.1rc6.dev16+g933cdea44')")
    try:
        return Version(text.strip())
    except InvalidVersion as exc:
        raise InvalidVllmVersionError(
            f"not a PEP 440 version: {text!r} (expected a vLLM version such as '0.11.1' "
            "or '0.11.1rc6.dev16+g933cdea44')") from exc


def base_version(version: Version | str) -> Version:
    """``0.11.1rc6.dev16+g933cdea44.cu129`` -> ``0.11.1``."""
    v = version if isinstance(version, Version) else parse_vllm_version(version)
    return Version(v.base_version)


def era_for_version(version: Version | str) -> Era:
    """The era whose range holds the base version; raises below the supported range."""
    base = base_version(version)
    if base < OLDEST_SUPPORTED:
        raise UnsupportedVllmVersionError(
            f"vLLM {_shown(version)} is older than vllm_compat supports: "
            f"supported range is {OLDEST_SUPPORTED} to {NEWEST_TESTED.major}.{NEWEST_TESTED.minor}.x "
            "(newer runs with a warning); "
            f"upgrade vLLM: pip install -U 'vllm>={OLDEST_SUPPORTED}'"
        )
    chosen = ERAS[0]
    for era in ERAS:
        if base >= era.first:
            chosen = era
    return chosen


def _shown(version: Version | str) -> str:
    return version.strip() if isinstance(version, str) else str(version)


def check_supported(version: Version | str, *, env: Mapping[str, str] | None = None) -> Version:
    """Refuse, before anything imports vLLM, a version no adapter may run: older than the
    supported range, or (with ``VLLM_COMPAT_STRICT=1``) newer than the newest tested series.
    A forced ``VLLM_COMPAT_ADAPTER`` lifts the strict check (not the lower bound);
    ``VLLM_COMPAT_STRICT=drift`` is decided later, by the drift check (see detect)."""
    env = os.environ if env is None else env
    v = version if isinstance(version, Version) else parse_vllm_version(version)
    era_for_version(v)
    if (base_version(v) >= NEWEST_TESTED_SERIES and strict_mode(env) == "all"
            and not env.get("VLLM_COMPAT_ADAPTER", "").strip()):
        # a newer build is never routed below the newest era (see route), so this is the
        # adapter it would get
        raise UnsupportedVllmVersionError(_strict_message(v, ERAS[-1]))
    return v


def _strict_message(v: Version, era: Era) -> str:
    return (
        f"vLLM {v} is newer than the newest release vllm_compat was tested on ({NEWEST_TESTED}) "
        f"and VLLM_COMPAT_STRICT=1 refuses untested releases: install vLLM <= {NEWEST_TESTED}, "
        "set VLLM_COMPAT_STRICT=drift to accept it when the drift check finds nothing that "
        f"affects a capability, or unset VLLM_COMPAT_STRICT to run it with adapter '{era.name}'"
    )


def strict_drift_message(v: Version | str, era: Era, affecting: list[str]) -> str:
    """``VLLM_COMPAT_STRICT=drift`` refusing an untested build whose drift affects capabilities."""
    return (
        f"vLLM {v} is newer than the newest release vllm_compat was tested on ({NEWEST_TESTED}) "
        f"and VLLM_COMPAT_STRICT=drift found drift that affects a capability "
        f"(with adapter '{era.name}'): " + "; ".join(affecting)
        + f". Install vLLM <= {NEWEST_TESTED}, or unset VLLM_COMPAT_STRICT to run it anyway "
        "(`vllm-compat doctor --drift` shows the full report)"
    )


def strict_mode(env: Mapping[str, str] | None = None) -> str:
    """``VLLM_COMPAT_STRICT``: "all" (1/true/yes/on: refuse every untested build), "drift"
    (refuse an untested build whose drift check finds something that affects a capability),
    or "" (off)."""
    env = os.environ if env is None else env
    value = env.get("VLLM_COMPAT_STRICT", "").strip().lower()
    if value == "drift":
        return "drift"
    return "all" if value in {"1", "true", "yes", "on"} else ""


ERA_PROBES: tuple[str, ...] = tuple(ERAS[0].signature)


def era_for_probes(probes: Mapping[str, bool | None]) -> Era | None:
    """The era whose defining probe values all match, or None when a defining probe is
    missing or cannot tell."""
    if not all(probes.get(k) is not None for k in ERA_PROBES):
        return None
    for era in ERAS:
        if all(bool(probes[k]) == v for k, v in era.signature.items()):
            return era
    return None


@dataclass(frozen=True)
class Routing:
    era: Era
    reason: str
    newer_than_tested: bool = False
    forced: bool = False
    # era-defining probes whose values disagree with the version's era, and unreadable ones
    disagreeing: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def _yes_no(value: bool | None) -> str:
    return "cannot tell" if value is None else "yes" if value else "no"


def _by_probes(v: Version, by_version: Era, probes: Mapping[str, bool | None] | None,
               newer: bool) -> Routing:
    base = base_version(v)
    if not probes:
        return Routing(by_version, f"by version: {base}", newer)
    known = {k: bool(probes[k]) for k in ERA_PROBES if probes.get(k) is not None}
    unknown = tuple(k for k in ERA_PROBES if probes.get(k) is None)
    disagree = tuple(k for k, val in known.items() if by_version.signature[k] != val)
    if not disagree:
        how = ("version and probes agree" if not unknown else
               f"by version (probe {', '.join(unknown)}: cannot tell)")
        return Routing(by_version, f"{how}: {base}", newer, unknown=unknown)
    names = ", ".join(f"{k}={_yes_no(known[k])}" for k in disagree)
    verb = "matches" if len(disagree) == 1 else "match"
    by_signature = [e for e in ERAS if all(e.signature[k] == val for k, val in known.items())]
    # an era whose adapter cannot run here (a requirement denied by a probe that can tell) is
    # no candidate: a 0.16 build whose sample_tokens was renamed matches v0_10's signature,
    # but v0_10 hashes through vllm.utils, which 0.11+ no longer has
    denied = {e.name: {k: want for k, want in e.requires.items()
                       if probes.get(k) is not None and bool(probes[k]) != want}
              for e in by_signature}
    consistent = [e for e in by_signature if not denied[e.name]]
    if newer:
        # a build past the tested range keeps the newest era: its probes cannot be checked
        # against a release we ran, and an older era would lose what the newest one does
        match = f"{verb} '{consistent[-1].name}'" if consistent else f"{verb} no era"
        return Routing(by_version, f"version {v} is newer than tested: kept the newest adapter "
                       f"'{by_version.name}' although probe {names} {match}", newer,
                       disagreeing=disagree, unknown=unknown)
    if not consistent:
        match = "no era"
        if by_signature:
            e = by_signature[-1]
            needs = ", ".join(f"{k}={_yes_no(want)}" for k, want in denied[e.name].items())
            match = f"'{e.name}', whose adapter cannot run here (it needs {needs})"
        return Routing(by_version, f"version {v} suggests '{by_version.name}'; probe {names} "
                       f"{verb} {match}, so the version's is kept", newer,
                       disagreeing=disagree, unknown=unknown)
    # nearest the version's era, the newer on a tie: an unknown probe widens the choice but
    # never pulls the build further down than the probes that can tell
    at = ERAS.index(by_version)
    pick = min(consistent, key=lambda e: (abs(ERAS.index(e) - at), -ERAS.index(e)))
    return Routing(pick, f"version {v} suggests '{by_version.name}' but probe {names} "
                   f"{verb} '{pick.name}'", newer, disagreeing=disagree, unknown=unknown)


def newer_warning(v: Version | str, routing: Routing, drift_summary: str = "") -> str:
    """The once-per-version warning for a build past the tested range, naming the adapter
    actually chosen."""
    how = "forced by VLLM_COMPAT_ADAPTER" if routing.forced else "the newest"
    msg = (f"vLLM {v} is newer than the newest release vllm_compat was tested on "
           f"({NEWEST_TESTED}); using adapter '{routing.era.name}' ({how})")
    if routing.disagreeing:
        msg += f"; probes that disagree with it: {', '.join(routing.disagreeing)}"
    return msg + (f"; {drift_summary}" if drift_summary else "")


def warn_newer_once(v: Version | str, routing: Routing, drift_summary: str = "",
                    stacklevel: int = 3) -> None:
    if str(v) not in _warned_newer:
        _warned_newer.add(str(v))
        warnings.warn(newer_warning(v, routing, drift_summary), RuntimeWarning,
                      stacklevel=stacklevel)


def route(
    version: Version | str,
    probes: Mapping[str, bool | None] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    warn: bool = True,
) -> Routing:
    """Pick the adapter for an installed vLLM.

    Order: ``VLLM_COMPAT_ADAPTER`` forces one; else the version picks a candidate
    (too old raises) and the probes check it (rules in the module docstring). A base
    version past the newest tested series is flagged ``newer_than_tested`` (forced or not)
    and warns once naming the adapter chosen (``warn=False``: the caller warns);
    ``VLLM_COMPAT_STRICT=1`` raises for it unless an adapter is forced.
    """
    env = os.environ if env is None else env
    forced = env.get("VLLM_COMPAT_ADAPTER", "").strip()
    if forced and forced not in ERAS_BY_NAME:
        raise UnknownAdapterError(
            f"VLLM_COMPAT_ADAPTER={forced!r} names no adapter; choose one of {sorted(ERAS_BY_NAME)}, "
            "or unset it to route by the installed version"
        )
    v = version if isinstance(version, Version) else parse_vllm_version(version)
    by_version = era_for_version(v)
    newer = base_version(v) >= NEWEST_TESTED_SERIES
    if forced:
        routing = Routing(ERAS_BY_NAME[forced], f"forced by VLLM_COMPAT_ADAPTER={forced}", newer,
                          forced=True)
    else:
        routing = _by_probes(v, by_version, probes, newer)
        if newer and strict_mode(env) == "all":
            raise UnsupportedVllmVersionError(_strict_message(v, routing.era))
    if newer and warn:
        warn_newer_once(v, routing)
    return routing
