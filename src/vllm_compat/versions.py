"""Version parsing and era routing. Pure Python: never imports vLLM.

vLLM is routed on the *base* version (``0.11.1rc6.dev16+g933cdea44.cu129`` -> 0.11.1)
and then checked against feature probes, because nightlies and forks sit between
releases: when probes and version disagree, the probes win.
"""

from __future__ import annotations

import os
import warnings
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
# Newest release the matrix has run; a later base version still gets the newest adapter, with a warning.
NEWEST_TESTED = Version("0.33.0")
NEWEST_TESTED_SERIES = Version("0.34.0")  # anything below this is 0.33.x or older

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
            f"supported range is {OLDEST_SUPPORTED} to {NEWEST_TESTED}.x (newer runs with a warning); "
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
    A forced ``VLLM_COMPAT_ADAPTER`` lifts the strict check (not the lower bound)."""
    env = os.environ if env is None else env
    v = version if isinstance(version, Version) else parse_vllm_version(version)
    era_for_version(v)
    if (base_version(v) >= NEWEST_TESTED_SERIES and _env_flag("VLLM_COMPAT_STRICT", env)
            and not env.get("VLLM_COMPAT_ADAPTER", "").strip()):
        raise UnsupportedVllmVersionError(_strict_message(v))
    return v


def _strict_message(v: Version) -> str:
    return (
        f"vLLM {v} is newer than the newest release vllm_compat was tested on ({NEWEST_TESTED}) "
        f"and VLLM_COMPAT_STRICT=1 refuses untested releases: install vLLM <= {NEWEST_TESTED}, "
        f"or unset VLLM_COMPAT_STRICT to run it with the newest adapter '{ERAS[-1].name}'"
    )


def era_for_probes(probes: Mapping[str, bool]) -> Era | None:
    """The era whose defining probe values all match, or None when probes are incomplete."""
    keys = ERAS[0].signature.keys()
    if not all(k in probes for k in keys):
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


def _env_flag(name: str, env: Mapping[str, str]) -> bool:
    return env.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def route(
    version: Version | str,
    probes: Mapping[str, bool] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> Routing:
    """Pick the adapter for an installed vLLM.

    Order: ``VLLM_COMPAT_ADAPTER`` forces one; else the version picks a candidate
    (too old raises); probes override the candidate when they disagree; a base
    version past the newest tested series warns once (``VLLM_COMPAT_STRICT=1``: raises).
    """
    env = os.environ if env is None else env
    forced = env.get("VLLM_COMPAT_ADAPTER", "").strip()
    if forced:
        if forced not in ERAS_BY_NAME:
            raise UnknownAdapterError(
                f"VLLM_COMPAT_ADAPTER={forced!r} names no adapter; choose one of {sorted(ERAS_BY_NAME)}, "
                "or unset it to route by the installed version"
            )
        return Routing(ERAS_BY_NAME[forced], f"forced by VLLM_COMPAT_ADAPTER={forced}")

    v = version if isinstance(version, Version) else parse_vllm_version(version)
    by_version = era_for_version(v)
    newer = base_version(v) >= NEWEST_TESTED_SERIES
    if newer:
        msg = (
            f"vLLM {v} is newer than the newest release vllm_compat was tested on "
            f"({NEWEST_TESTED}); using the newest adapter '{ERAS[-1].name}'"
        )
        if _env_flag("VLLM_COMPAT_STRICT", env):
            raise UnsupportedVllmVersionError(_strict_message(v))
        if str(v) not in _warned_newer:
            _warned_newer.add(str(v))
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    by_probes = era_for_probes(probes) if probes else None
    if by_probes is not None and by_probes is not by_version:
        return Routing(
            by_probes,
            f"version {v} suggests '{by_version.name}' but feature probes match '{by_probes.name}'",
            newer,
        )
    how = "version and probes agree" if by_probes is not None else "by version"
    return Routing(by_version, f"{how}: {base_version(v)}", newer)
