"""Find the installed vLLM, route it to an adapter, and report what it can do.

Detection never refuses the whole library because one capability drifted: the version picks
the era (``packaging``; probes check it, see :mod:`vllm_compat.versions`), and a capability
whose probes or drift check show a change is listed in :attr:`VllmInfo.drifted`. What does
not depend on it keeps working; using it raises a :class:`~vllm_compat.errors.VllmDriftError`
naming it, before the operation touches vLLM state. Detection refuses only what no adapter
can run: a vLLM that cannot be imported, one older than supported, an untested build under
``VLLM_COMPAT_STRICT``, or an adapter forced by ``VLLM_COMPAT_ADAPTER`` that cannot load.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from packaging.version import Version

from . import aliases, versions
from . import drift as _drift
from .errors import InvalidVllmVersionError, UnsupportedVllmVersionError, VllmNotInstalledError

_lock = threading.Lock()
_cached: tuple[VllmInfo, ModuleType] | None = None
_drift_cache: _drift.DriftReport | None = None


@dataclass(frozen=True)
class VllmInfo:
    """What :func:`detect` found. ``probes`` are read from the installed code, not guessed."""

    version: str
    base_version: str
    is_prerelease: bool
    local: str | None
    era: str
    era_summary: str
    routing: str
    newer_than_tested: bool
    runner: str
    # True / False, or None where the probe cannot tell (see vllm_compat.surface.PROBES)
    probes: dict[str, bool | None] = field(default_factory=dict)
    # era-defining probes that disagree with the version's era (named in ``routing``)
    disagreeing_probes: tuple[str, ...] = ()
    # the drift check's summary: run at detection for a build newer than the newest tested
    # release (None otherwise; ``check_drift()`` / ``vllm-compat doctor --drift`` run it anywhere)
    drift: str | None = None
    # capability -> what drifted: an era requirement the probes deny, or (where the drift
    # check ran) an item that affects the capability. The rest of the library works.
    drifted: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def installed_vllm_version() -> str:
    """The installed distribution's version, read from metadata (does not import vLLM)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise VllmNotInstalledError(
            "vLLM is not installed in this environment: `pip install vllm` "
            f"(vllm_compat supports {versions.OLDEST_SUPPORTED} to "
            f"{versions.NEWEST_TESTED.major}.{versions.NEWEST_TESTED.minor}.x)"
        ) from None


def _default_runner(base: Version, probes: dict[str, bool | None]) -> str:
    """Which model runner vLLM picks for a dense decoder by default (a live worker can say more)."""
    forced = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if not probes.get("model_runner_v2_available"):
        return "v1"
    if forced is not None:
        return "v2 (VLLM_USE_V2_MODEL_RUNNER)" if forced.strip() not in {"", "0"} else "v1 (forced)"
    # 0.29 made V2 the default for every model; 0.22-0.28 chose V2 per architecture;
    # before 0.22 it was opt-in through the environment variable.
    if base >= Version("0.29.0"):
        return "v2"
    if base >= Version("0.22.0"):
        return "v1 or v2 (chosen per architecture)"
    return "v1"


# Checks that VLLM_COMPAT_STRICT=drift runs on an untested build beyond the drift report, each
# returning the line of drift that affects a capability, or None. Registered by the package
# (the engine-hash check lives above this module: it needs the adapter).
_untested_build_checks: list[Callable[[VllmInfo], str | None]] = []
_untested_verdicts: dict[str, list[str]] = {}  # version -> lines found (set before running)
_untested_lock = threading.RLock()  # re-entered: the checks themselves use the adapter


def add_untested_build_check(check: Callable[[VllmInfo], str | None]) -> None:
    """Run ``check`` too before ``VLLM_COMPAT_STRICT=drift`` accepts an untested build."""
    if check not in _untested_build_checks:
        _untested_build_checks.append(check)


def _checked(refresh: bool) -> tuple[VllmInfo, ModuleType]:
    found = _detect(refresh)
    info = found[0]
    if not (info.newer_than_tested and versions.strict_mode() == "drift"
            and _untested_build_checks and not os.environ.get("VLLM_COMPAT_ADAPTER", "").strip()):
        return found
    with _untested_lock:
        if refresh:
            _untested_verdicts.pop(info.version, None)
        if info.version not in _untested_verdicts:
            lines = _untested_verdicts[info.version] = []  # a nested call sees "nothing yet"
            for check in _untested_build_checks:
                line = check(info)
                if line:
                    lines.append(line)
        lines = _untested_verdicts[info.version]
    if lines:
        raise UnsupportedVllmVersionError(versions.strict_drift_message(
            info.version, versions.ERAS_BY_NAME[info.era], lines))
    return found


def detect(*, refresh: bool = False) -> VllmInfo:
    """Detect the installed vLLM: version, adapter (era), default runner, capability probes."""
    return _checked(refresh)[0]


def adapter(*, refresh: bool = False) -> ModuleType:
    """The adapter module for the installed vLLM (imports vLLM on first use)."""
    return _checked(refresh)[1]


def alias(**names: str) -> None:
    """Declare that a vLLM name vllm_compat looks for has a successor, e.g.
    ``alias(sample_tokens="sample_step_tokens")`` (the same as ``VLLM_COMPAT_ALIASES``).

    The resolver uses the new name only where the old one is missing, after checking that it
    takes the call vllm_compat makes; ``doctor --drift`` reports it as resolved by alias.
    ``alias(sample_tokens="")`` removes one. Detection and the resolver start afresh."""
    global _cached, _drift_cache
    aliases.declare(names)
    with _lock:
        _cached = _drift_cache = None
    resolver = sys.modules.get(f"{__package__}.resolve")
    if resolver is not None:
        resolver.reset()


def check_drift(*, refresh: bool = False) -> _drift.DriftReport:
    """The drift report of the installed vLLM: the declared surface, and the stored snapshot
    of the nearest tested release, against what the installed code has (imports vLLM)."""
    global _drift_cache
    info = detect(refresh=refresh)
    with _lock:
        if _drift_cache is None or refresh or _drift_cache.vllm != info.version:
            _drift_cache = _run_drift(info.version, info.era, info.probes)
        return _drift_cache


def _run_drift(version: str, era: str, probes: dict[str, bool | None]) -> _drift.DriftReport:
    from . import resolve

    return _drift.check(version, era, probes, resolve.survey())


def _requirement_drift(era: versions.Era, missing: dict[str, bool],
                       probes: dict[str, bool | None]) -> dict[str, str]:
    """The capabilities whose era requirements the probes deny (the adapter runs anyway)."""
    from .surface import PROBES_BY_NAME

    out: dict[str, str] = {}
    for name, want in missing.items():
        p = PROBES_BY_NAME[name]
        out.setdefault(p.capability, (
            f"probe {name} ({p.meaning}): adapter '{era.name}' needs "
            f"{'yes' if want else 'no'}, the installed vLLM answers "
            f"{'cannot tell' if probes.get(name) is None else 'yes' if probes[name] else 'no'}"))
    return out


def _detect(refresh: bool) -> tuple[VllmInfo, ModuleType]:
    global _cached, _drift_cache
    with _lock:
        if _cached is not None and not refresh:
            return _cached
        text = installed_vllm_version()
        try:
            v = versions.parse_vllm_version(text)
        except InvalidVllmVersionError as exc:
            raise InvalidVllmVersionError(
                f"the installed vLLM's metadata reports version {text!r}, which is not a PEP 440 "
                "version: reinstall vLLM from a release wheel, or build it from a git checkout "
                "with its tags so that setuptools-scm can name the version") from exc
        # too old, or newer than tested under VLLM_COMPAT_STRICT=1: fail before importing vLLM
        versions.check_supported(v)
        from .adapters import load

        try:
            common = load("_common")
        except ImportError as exc:
            raise VllmNotInstalledError(f"vLLM {text} is installed but cannot be imported: {exc}") from exc
        probes = common.probes()
        routing = versions.route(v, probes, warn=False)
        missing = {k: want for k, want in routing.era.requires.items() if probes.get(k) != want}
        if missing and routing.forced:  # the user's choice of era, which cannot run here
            raise UnsupportedVllmVersionError(
                f"adapter '{routing.era.name}' ({routing.reason}) cannot run on vLLM {text}: it "
                f"needs the probes {missing}, the installed vLLM has "
                f"{ {k: probes.get(k) for k in missing} }")
        drifted = _requirement_drift(routing.era, missing, probes)
        try:
            module = load(routing.era.module)
        except ImportError as exc:  # only reachable when VLLM_COMPAT_ADAPTER forces a wrong era
            raise UnsupportedVllmVersionError(
                f"adapter '{routing.era.name}' ({routing.reason}) cannot run on vLLM {text}: {exc}"
            ) from exc
        summary = None
        if routing.newer_than_tested or drifted:
            # an untested build: say what drifted in the warning; VLLM_COMPAT_STRICT=drift
            # accepts it only when nothing affects a capability
            report = _drift_cache = _run_drift(text, routing.era.name, probes)
            summary = report.summary()
            for item in report.affecting:
                drifted.setdefault(item.capability, f"{item.symbol}: expected {item.expected}; "
                                                    f"found {item.found}")
            if (routing.newer_than_tested and versions.strict_mode() == "drift"
                    and report.affecting and not routing.forced):
                raise UnsupportedVllmVersionError(
                    versions.strict_drift_message(text, routing.era, report.affecting_lines()))
            if routing.newer_than_tested:
                versions.warn_newer_once(
                    text, routing, summary + " (`vllm-compat doctor --drift`)", stacklevel=5)
        base = versions.base_version(v)
        info = VllmInfo(
            version=text, base_version=str(base), is_prerelease=v.is_prerelease or v.is_devrelease,
            local=v.local, era=routing.era.name, era_summary=routing.era.summary,
            routing=routing.reason, newer_than_tested=routing.newer_than_tested,
            runner=_default_runner(base, probes), probes=probes,
            disagreeing_probes=routing.disagreeing, drift=summary, drifted=drifted,
        )
        _cached = (info, module)
        return _cached
