"""Resolve the symbols of :mod:`vllm_compat.surface` in the installed vLLM (imports vLLM).

One resolver for every vLLM symbol the adapters and ``runtime/`` use: :func:`sym` finds a
symbol at its known location for this release, at another known location, or, when vLLM
moved it somewhere new, by searching the packages its entry lists (loaded modules first, then
the source files). A symbol found anywhere but where this release should have it is used and
reported as moved (``vllm-compat doctor --drift``); one found nowhere raises
:class:`~vllm_compat.errors.MissingSymbolError` naming the capability, where it looked, and the
*successor candidates*: callables where it lived (the class and its bases, the module and its
package) that take the same call. A candidate is never used on a guess: only a name the user
declares (:mod:`vllm_compat.aliases`) is, after the same signature check, and it is reported
as drift "resolved by alias". :func:`method` does the same for a method of an object vllm_compat
is handed (a worker, a model runner, an executor).
:func:`check_call` checks a call's arguments against the callee's signature before the call,
so a new required parameter or a removed one is a :class:`SignatureDriftError`, not vLLM's
``TypeError``. :func:`survey` and :func:`probe_values` are what ``doctor`` and the stored
snapshots read.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
import threading
from dataclasses import MISSING, dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

import vllm
from packaging.version import Version

from . import aliases, surface
from .errors import (MissingSymbolError, RejectedAliasError, ReturnTypeDriftError,
                     SignatureDriftError)
from .surface import BY_KEY, PROBES, Location, Symbol


@dataclass(frozen=True)
class Found:
    obj: Any
    where: str  # "module:attr"
    module: str  # the module it was found in
    how: str  # "declared" | "alternate" | "beside" | "searched" | "member" | "alias"
    moved: bool  # not where this release should have it
    # what holds it (module, class or instance) and its name there: sym() reads it from there
    # on every call, so a later assignment (a patched vLLM function) is seen as vLLM sees it
    container: Any = None
    name: str = ""
    alias: str = ""  # "old=new" when found through a declared alias

    def current(self) -> Any:
        if self.container is None:
            return self.obj
        try:
            return getattr(self.container, self.name)
        except AttributeError:
            return self.obj


_NOT_FOUND = object()
_cache: dict[str, Found | None] = {}
_lock = threading.RLock()  # a member resolves its parent under the same lock


def reset() -> None:
    """Forget what was resolved (after :func:`vllm_compat.alias` declares a name)."""
    with _lock:
        _cache.clear()
        _call_facts.clear()


def vllm_version() -> str:
    return vllm.__version__


@lru_cache(maxsize=None)
def _base() -> Version:
    return Version(Version(vllm.__version__).base_version)


def _in_range(since: str | None, until: str | None, v: Version | None = None) -> bool:
    v = _base() if v is None else v
    if since is not None and v < Version(since):
        return False
    # `until` is the last tested release: later patch releases of its series count too
    return until is None or v < Version(_next_minor(until))


def _next_minor(release: str) -> str:
    major, minor, *_ = Version(release).release + (0, 0)
    return f"{major}.{minor + 1}.0"


def used_here(s: Symbol) -> bool:
    """Whether this release's adapter uses ``s`` (inside its since/until range)."""
    return _in_range(s.since, s.until)


def _expected(s: Symbol) -> Location | None:
    for loc in s.locations:
        if not loc.alternate and _in_range(loc.since, loc.until):
            return loc
    return None


_import_errors: dict[str, str] = {}


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a module that fails to import is "not here"
        _import_errors[module] = f"{type(exc).__name__}: {exc}"
        return None


def _has_module(name: str) -> bool:
    # find_spec, not import: the V2 runner and connector modules need a GPU stack to import
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _get(mod: Any, attr: str, *, declared: bool = False) -> Any:
    """``mod.<attr path>`` or _NOT_FOUND; other errors (a lazy module ``__getattr__`` whose
    import fails) propagate to the caller, which records them."""
    obj = mod
    for i, part in enumerate(attr.split(".")):
        nxt = getattr(obj, part, _NOT_FOUND)
        if nxt is _NOT_FOUND and declared and i == 0:
            # a module-level name only annotated until something assigns it (NONE_HASH)
            if part in getattr(obj, "__annotations__", {}):
                return None
        if nxt is _NOT_FOUND:
            return _NOT_FOUND
        obj = nxt
    return obj


def _at(loc: Location, declared: bool) -> Any:
    if not loc.attr:
        return loc.module if _has_module(loc.module) else _NOT_FOUND
    mod = _import(loc.module)
    if mod is None:
        return _NOT_FOUND
    try:
        return _get(mod, loc.attr, declared=declared)
    except Exception as exc:  # noqa: BLE001 - e.g. vllm.LLM, whose lazy import fails
        _import_errors[loc.module] = f"{loc.attr}: {type(exc).__name__}: {exc}"
        return _NOT_FOUND


def _safe_get(mod: Any, attr: str, declared: bool) -> Any:
    try:
        return _get(mod, attr, declared=declared)
    except Exception:  # noqa: BLE001 - a module that cannot give it does not have it
        return _NOT_FOUND


def _container(module: str, attr: str) -> tuple[Any, str]:
    """The object that holds ``module:attr`` and the name in it."""
    head, _, name = attr.rpartition(".")
    mod = sys.modules.get(module)
    return (_safe_get(mod, head, False) if head else mod), name


def _package_dirs(package: str) -> list[str]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


def _search(name: str, packages: tuple[str, ...], declared: bool) -> tuple[Any, str] | None:
    """Find ``name`` defined at module level under ``packages``: already-imported modules
    first, then the source files (a file that defines it is imported and checked)."""
    top = name.split(".")[0]
    for modname, mod in sorted(sys.modules.items()):
        if mod is None or not any(modname == p or modname.startswith(p + ".") for p in packages):
            continue
        obj = _safe_get(mod, name, declared)
        if obj is not _NOT_FOUND and _defined_in(obj, modname):
            return obj, modname
    pattern = re.compile(rf"^(?:def|class)\s+{re.escape(top)}\b|^{re.escape(top)}\s*[:=]", re.M)
    for package in packages:
        for root in _package_dirs(package):
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
                for fn in sorted(filenames):
                    if not fn.endswith(".py"):
                        continue
                    path = os.path.join(dirpath, fn)
                    try:
                        with open(path, encoding="utf-8") as f:
                            if not pattern.search(f.read()):
                                continue
                    except OSError:
                        continue
                    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    modname = package + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))
                    mod = _import(modname)
                    obj = _safe_get(mod, name, declared) if mod is not None else _NOT_FOUND
                    if obj is not _NOT_FOUND:
                        return obj, modname
    return None


def _defined_in(obj: Any, modname: str) -> bool:
    # a function or class re-exported elsewhere is found where it is defined
    defined = getattr(obj, "__module__", None)
    return not isinstance(defined, str) or defined == modname or not (
        inspect.isfunction(obj) or inspect.isclass(obj))


def lookup(key: str) -> Found | None:
    """Where ``key`` is in the installed vLLM, or None (cached per process)."""
    try:
        return _cache[key]
    except KeyError:
        pass
    with _lock:
        if key not in _cache:
            _cache[key] = _lookup(BY_KEY[key])
        return _cache[key]


def _lookup(s: Symbol) -> Found | None:
    declared = s.kind == "value"
    if s.parent is not None:
        parent = lookup(s.parent)
        if parent is None:
            return None
        obj = _safe_get(parent.obj, s.member, False)
        if obj is _NOT_FOUND:
            return _member_alias(s, parent)
        return Found(obj, f"{parent.where}.{s.member}", parent.module, "member", False,
                     parent.obj, s.member)
    expected = _expected(s)
    candidates = [expected] if expected is not None else []
    if s.beside is not None:  # the module where its companion lives comes first
        companion = lookup(s.beside)
        if companion is not None:
            attr = s.locations[0].attr if s.locations else s.key
            candidates.insert(0, Location(companion.module, attr))
    candidates += [loc for loc in s.locations if loc not in candidates]
    for loc in candidates:
        obj = _at(loc, declared)
        if obj is not _NOT_FOUND:
            moved = expected is not None and (loc.module, loc.attr) != (expected.module, expected.attr)
            known = next((k for k in s.locations if (k.module, k.attr) == (loc.module, loc.attr)), None)
            how = "beside" if known is None else "alternate" if known.alternate else "declared"
            container, name = _container(loc.module, loc.attr) if loc.attr else (None, "")
            return Found(obj, loc.where, loc.module, how, moved, container, name)
    # searched only where this release uses it (an optional symbol of a later release,
    # absent here, costs no walk over vLLM's files)
    if s.search and used_here(s):
        attr = s.locations[0].attr if s.locations else s.key
        hit = _search(attr, s.search, declared)
        if hit is not None:
            obj, modname = hit
            container, name = _container(modname, attr)
            return Found(obj, f"{modname}:{attr}", modname, "searched", True, container, name)
    return _module_alias(s)


# --------------------------------------------------------------------------- aliases and successors


@lru_cache(maxsize=None)
def tested_params(key: str) -> dict[str, bool] | None:
    """``key``'s parameters on the nearest tested release (its stored snapshot), if known."""
    from . import drift, versions

    try:
        era = versions.era_for_version(vllm.__version__).name
    except Exception:  # noqa: BLE001 - an unparsable or unsupported version: no reference
        return None
    nearest = drift.nearest_tested(vllm.__version__, era)
    snap = drift.load_snapshot(nearest) if nearest is not None else None
    ps = ((snap or {}).get("surface", {}).get(key) or {}).get("params")
    return ps if isinstance(ps, dict) else None


def _reference(s: Symbol) -> dict[str, bool] | None:
    return tested_params(s.key) if s.kind in ("callable", "class") else None


def incompatibility(s: Symbol, obj: Any) -> str | None:
    """Why ``obj`` cannot stand for ``s`` (None: it can): it must be of the same kind, take
    the call vllm_compat makes (the surface's call shape) and have the parameters that ``s``
    required on the nearest tested release."""
    if s.kind == "class" and not inspect.isclass(obj):
        return f"{_qualname(obj)} is not a class"
    if s.kind == "callable" and (inspect.isclass(obj) or not callable(obj)):
        return f"{_qualname(obj)} is not a function or method"
    if s.kind in ("value", "module"):
        return None
    ps = params(obj)
    if ps is None:
        return f"the signature of {_qualname(obj)} cannot be read"
    new_required, removed = signature_drift(s, obj, ps)
    if new_required:
        return f"it requires {', '.join(repr(n) for n in new_required)}, which vllm_compat does not pass"
    if removed:
        return f"it does not take {', '.join(repr(n) for n in removed)}"
    ref = _reference(s)
    forwards = any(n.startswith("**") for n in ps)  # (*args, **kwargs) takes any name
    if ref is not None and not forwards:
        wanted = [n for n, req in ref.items() if req and not n.startswith("*") and n not in ps]
        if wanted:
            return (f"it lacks the parameter(s) {', '.join(repr(n) for n in wanted)} that "
                    f"{s.key} had on the nearest tested release")
    return None


def _qualname(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _shown_signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    ps = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    return str(sig.replace(parameters=ps, return_annotation=inspect.Signature.empty))


def _member_pool(s: Symbol, holder: Any) -> list[tuple[str, str, Any]]:
    """``(shown where, name, object)`` of every public callable of ``holder``'s class and
    its bases, but the surface's other members of the same parent."""
    cls = holder if inspect.isclass(holder) else type(holder)
    declared = {x.member for x in surface.SYMBOLS if x.parent is not None and x.member != s.member}
    out, seen = [], set()
    for k in cls.__mro__:
        if k is object:
            continue
        for name in vars(k):
            if name in seen or name.startswith("__") or name == s.member or name in declared:
                continue
            seen.add(name)
            obj = _safe_get(holder, name, False)
            if obj is not _NOT_FOUND and callable(obj):
                out.append((f"{k.__module__}:{k.__qualname__}.{name}", name, obj))
    return out


def _module_pool(s: Symbol) -> list[tuple[str, str, Any]]:
    """Callables defined in the module ``s`` lived in and in the other modules of its package."""
    loc = _expected(s) or (s.locations[0] if s.locations else None)
    if loc is None or not loc.attr:
        return []
    package = loc.module.rpartition(".")[0]
    names = [loc.module] + sorted(
        f"{package}.{m.name}" for m in pkgutil.iter_modules(_package_dirs(package))
        if f"{package}.{m.name}" != loc.module)
    declared = {x.locations[0].attr for x in surface.SYMBOLS if x.locations} - {loc.attr}
    out, seen = [], set()
    for modname in names:
        mod = _import(modname)
        for name, obj in sorted(vars(mod).items()) if mod is not None else ():
            if (name.startswith("_") or name == loc.attr or name in declared
                    or not callable(obj) or getattr(obj, "__module__", None) != modname
                    or id(obj) in seen):
                continue
            seen.add(id(obj))
            out.append((f"{modname}:{name}", name, obj))
    return out


def successors(s: Symbol, holder: Any = None) -> list[str]:
    """Where ``s`` may have gone, best first (at most three): callables where it lived that
    take the same call (see :func:`incompatibility`), ranked by how alike the names are. Named
    in the error and the report; never used unless declared as an alias."""
    if s.kind not in ("callable", "class"):
        return []
    pool = _member_pool(s, holder) if holder is not None else _module_pool(s)
    ref = _reference(s)
    ranked = []
    for where, name, obj in pool:
        if incompatibility(s, obj) is not None:
            continue
        likeness = difflib.SequenceMatcher(None, s.member, name).ratio()
        same = ref is not None and set(params(obj) or ()) == set(ref)
        if not same and likeness < 0.6:
            continue  # a call shape alone fits too many methods: the name must be alike
        ranked.append((not same, -likeness, where, obj))
    ranked.sort(key=lambda r: r[:3])
    return [f"{where}{_shown_signature(obj)}" for _, _, where, obj in ranked[:3]]


def _alias_of(s: Symbol) -> str | None:
    return aliases.current().get(s.member)


def _checked_alias(s: Symbol, obj: Any, where: str, new: str) -> Any:
    why = "it is not there" if obj is _NOT_FOUND else incompatibility(s, obj)
    if why is not None:
        raise RejectedAliasError(
            capability=s.capability, vllm_version=vllm.__version__, symbol=s.key,
            expected=f"the declared alias {aliases.how(s.member, new)} to name a stand-in for "
                     f"{s.member} at {where}",
            found=f"{where}: {why}",
            workaround=f"declare another name, or remove the alias for {s.member}")
    return obj


def _member_alias(s: Symbol, parent: Found) -> Found | None:
    new = _alias_of(s)
    if new is None:
        return None
    where = f"{parent.where}.{new}"
    obj = _checked_alias(s, _safe_get(parent.obj, new, False), where, new)
    return Found(obj, where, parent.module, "alias", True, parent.obj, new,
                 alias=f"{s.member}={new}")


def _module_alias(s: Symbol) -> Found | None:
    new = _alias_of(s)
    if new is None or not s.locations:
        return None
    places = [loc for loc in s.locations if loc.attr]
    for loc in places:
        mod = _import(loc.module)
        obj = _safe_get(mod, new, s.kind == "value") if mod is not None else _NOT_FOUND
        if obj is not _NOT_FOUND:
            obj = _checked_alias(s, obj, f"{loc.module}:{new}", new)
            container, name = _container(loc.module, new)
            return Found(obj, f"{loc.module}:{new}", loc.module, "alias", True, container, name,
                         alias=f"{s.member}={new}")
    hit = _search(new, s.search, s.kind == "value") if s.search else None
    if hit is not None:
        obj = _checked_alias(s, hit[0], f"{hit[1]}:{new}", new)
        container, name = _container(hit[1], new)
        return Found(obj, f"{hit[1]}:{new}", hit[1], "alias", True, container, name,
                     alias=f"{s.member}={new}")
    where = " or ".join(f"{loc.module}:{new}" for loc in places)
    _checked_alias(s, _NOT_FOUND, where + (f" (nor under {', '.join(s.search)})" if s.search else ""), new)
    return None


def alias_hint(member: str, candidates: Sequence[str]) -> str:
    """The way out that names the best candidate (as an alias the user can declare)."""
    from .drift import alias_hint as hint

    return hint(member, candidates[0]) if candidates else ""


def method(target: Any, key: str) -> Any:
    """``target``'s method named as the surface member ``key`` (``"Executor.sample_tokens"``
    on any worker, model runner or executor), through a declared alias; else
    :class:`MissingSymbolError` naming the successor candidates. Call it for every method
    of a multi-call operation before the first call, so that nothing is left half done."""
    s = BY_KEY[key]
    fn = getattr(target, s.member, None)
    if fn is not None:
        return fn
    new = _alias_of(s)
    where = f"{type(target).__module__}:{type(target).__qualname__}"
    if new is not None:
        return _checked_alias(s, getattr(target, new, _NOT_FOUND), f"{where}.{new}", new)
    candidates = successors(s, target)
    found = f"{where} has no attribute '{s.member}'"
    if candidates:
        found += "; candidates with a compatible signature: " + ", ".join(candidates)
    return _raise_missing(s, f"{type(target).__qualname__}.{s.member}",
                          f"{where} to have '{s.member}' ({s.used_by})", found,
                          alias_hint(s.member, candidates))


def _raise_missing(s: Symbol, symbol: str, expected: str, found: str, workaround: str) -> Any:
    raise MissingSymbolError(capability=s.capability, vllm_version=vllm.__version__,
                             symbol=symbol, expected=expected, found=found, workaround=workaround)


def _expected_text(s: Symbol) -> str:
    loc = _expected(s) or (s.locations[-1] if s.locations else None)
    if s.parent is not None:
        return f"{s.parent} to have '{s.member}'"
    return loc.where if loc is not None else s.key


def _missing_text(s: Symbol) -> str:
    parent = lookup(s.parent) if s.parent is not None else None
    if parent is not None:
        return f"{parent.where} has no attribute '{s.member}'"
    if s.parent is not None:
        return f"{s.parent} itself is missing"
    places = [loc.where for loc in s.locations]
    text = "not at " + ", ".join(places)
    errors = [f"{loc.module} failed ({_import_errors[loc.module]})"
              for loc in s.locations if loc.module in _import_errors]
    if errors:
        text += "; " + "; ".join(errors)
    if s.search:
        text += f", nor anywhere under {', '.join(s.search)}"
    return text


def candidates_of(s: Symbol) -> list[str]:
    """The successor candidates of a missing ``s`` (see :func:`successors`)."""
    if s.parent is not None:
        parent = lookup(s.parent)
        return successors(s, parent.obj) if parent is not None else []
    return successors(s)


def _with_candidates(text: str, candidates: Sequence[str]) -> str:
    if not candidates:
        return text
    return text + "; candidates with a compatible signature: " + ", ".join(candidates)


def missing_error(key: str) -> MissingSymbolError:
    s = BY_KEY[key]
    candidates = candidates_of(s)
    workaround = "" if "{param}" in s.workaround else s.workaround
    return MissingSymbolError(capability=s.capability, vllm_version=vllm.__version__,
                              symbol=s.key, expected=_expected_text(s),
                              found=_with_candidates(_missing_text(s), candidates),
                              workaround=alias_hint(s.member, candidates) or workaround)


def sym(key: str) -> Any:
    """The object for ``key``; :class:`MissingSymbolError` when it is nowhere."""
    found = _cache[key] if key in _cache else lookup(key)
    if found is None:
        raise missing_error(key)
    return found.current()


def get(key: str, default: Any = None) -> Any:
    """The object for an optional ``key``, or ``default`` where this release has none."""
    found = lookup(key)
    return default if found is None else found.current()


def module_of(key: str) -> Any:
    """The module ``key`` was found in (where its module-level state lives)."""
    found = lookup(key)
    if found is None:
        raise missing_error(key)
    return sys.modules[found.module]


# --------------------------------------------------------------------------- signatures

_FORWARDING = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _init_signature_params(cls: type) -> list[inspect.Parameter] | None:
    """The parameters of the first ``__init__`` in the MRO that names any (a subclass that
    only forwards ``*args, **kwargs``, like AsyncScheduler, says nothing by itself)."""
    for k in cls.__mro__:
        init = vars(k).get("__init__")
        if init is None or k is object:
            continue
        try:
            ps = list(inspect.signature(init).parameters.values())[1:]
        except (TypeError, ValueError):
            return None
        if any(p.kind not in _FORWARDING for p in ps):
            return ps
    return []


def params(obj: Any) -> dict[str, bool] | None:
    """``{name: required}`` of a callable or class (``*args`` / ``**kwargs`` as ``*name`` /
    ``**name``), in signature order; None when it cannot be read."""
    fields = getattr(obj, "__dataclass_fields__", None) if inspect.isclass(obj) else None
    if fields:
        # vLLM's (pydantic) dataclasses: the signature can read (*args, **kwargs); the fields
        # also list InitVars (SchedulerConfig 0.12+)
        return {n: f.default is MISSING and f.default_factory is MISSING
                for n, f in fields.items() if f.init}
    struct = getattr(obj, "__struct_fields__", None) if inspect.isclass(obj) else None
    if struct is not None:  # msgspec.Struct (SamplingParams): trailing fields have defaults
        n_default = len(getattr(obj, "__struct_defaults__", ()))
        return {n: i < len(struct) - n_default for i, n in enumerate(struct)}
    try:
        if inspect.isclass(obj):
            ps = _init_signature_params(obj)
            if ps is None:
                return None
        else:
            ps = list(inspect.signature(obj).parameters.values())
            if ps and ps[0].name in ("self", "cls") and not inspect.ismethod(obj):
                ps = ps[1:]
    except (TypeError, ValueError):
        return None
    out: dict[str, bool] = {}
    for p in ps:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            out["*" + p.name] = False
        elif p.kind is inspect.Parameter.VAR_KEYWORD:
            out["**" + p.name] = False
        else:
            out[p.name] = p.default is inspect.Parameter.empty
    return out


def _positional_names(ps: Mapping[str, bool], obj: Any) -> list[str]:
    if getattr(obj, "__dataclass_fields__", None) or getattr(obj, "__struct_fields__", None):
        return [n for n in ps if not n.startswith("*")]
    try:
        target = obj if not inspect.isclass(obj) else None
        if target is not None:
            sig = inspect.signature(target)
            kinds = {n: p.kind for n, p in sig.parameters.items()}
            return [n for n in ps if kinds.get(n) in (inspect.Parameter.POSITIONAL_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        pass
    return [n for n in ps if not n.startswith("*")]


def signature_drift(s: Symbol, obj: Any, ps: Mapping[str, bool] | None = None,
                    given: set[str] | None = None, nargs: int | None = None
                    ) -> tuple[list[str], list[str]]:
    """``(new_required, removed)`` for a call shaped as ``s`` declares (or, with ``given``
    and ``nargs``, as a real call is): parameters the callee requires that the call does not
    give, and keywords the call gives that the callee no longer accepts."""
    ps = params(obj) if ps is None else ps
    if ps is None:
        return [], []
    nargs = s.positional if nargs is None else nargs
    if given is None:
        given = set(s.passes) | {p for p in s.passes_if_accepted if p in ps}
    var_kw = any(n.startswith("**") for n in ps)
    var_pos = any(n.startswith("*") and not n.startswith("**") for n in ps)
    positional = _positional_names(ps, obj)
    covered = set(positional[:nargs])
    new_required = [n for n, req in ps.items()
                    if req and not n.startswith("*") and n not in covered and n not in given]
    removed = sorted(p for p in given if p not in ps and not var_kw)
    if nargs > len(positional) and not var_pos:
        removed.append(f"positional argument {len(positional) + 1}")
    return new_required, removed


_call_facts: dict[tuple[str, int], tuple[frozenset[str], frozenset[str] | None, tuple[str, ...]]] = {}


def check_call(key: str, fn: Any, nargs: int, kw: Mapping[str, Any]) -> None:
    """Raise :class:`SignatureDriftError` when ``fn(*nargs args, **kw)`` cannot bind: a
    required parameter the call does not give, or a keyword ``fn`` no longer takes."""
    facts = _call_facts.get((key, id(fn)))
    if facts is None:
        ps = params(fn)
        if ps is None:
            return
        positional = tuple(_positional_names(ps, fn))
        required = frozenset(n for n, r in ps.items() if r and not n.startswith("*"))
        accepted = None if any(n.startswith("**") for n in ps) else frozenset(
            n for n in ps if not n.startswith("*"))
        facts = _call_facts[(key, id(fn))] = (required, accepted, positional)
    required, accepted, positional = facts
    if required and not required <= kw.keys():
        missing = sorted(required - kw.keys() - set(positional[:nargs]))
        if missing:
            raise signature_error(key, new_required=missing)
    if accepted is not None and not kw.keys() <= accepted:
        raise signature_error(key, removed=sorted(kw.keys() - accepted))


def signature_error(key: str, *, new_required: Sequence[str] = (), removed: Sequence[str] = ()
                    ) -> SignatureDriftError:
    s = BY_KEY[key]
    found = lookup(key)
    where = found.where if found is not None else key
    given = list(s.passes) + [f"{p} (where accepted)" for p in s.passes_if_accepted]
    if new_required:
        expected = (f"{where} to need no parameter beyond those vllm_compat passes"
                    + (f" ({', '.join(given)})" if given else ""))
        found_text = f"new required parameter(s) {', '.join(repr(p) for p in new_required)}"
        workaround = s.workaround.replace("{param}", new_required[0]) if s.workaround else ""
    else:
        expected = f"{where} to accept {', '.join(repr(p) for p in removed)}"
        found_text = f"parameter(s) {', '.join(repr(p) for p in removed)} removed"
        workaround = ""
    return SignatureDriftError(capability=s.capability, vllm_version=vllm.__version__,
                               symbol=key, expected=expected, found=found_text,
                               workaround=workaround)


# --------------------------------------------------------------------------- return contracts

# A fixed input shaped like what hash_block_tokens hashes: (parent hash, token ids, extra keys).
_HASH_PROBE_INPUT = (None, (1, 2, 3), None)


def check_hash_fn(name: str, fn: Any) -> Any:
    """``get_hash_fn_by_name(name)`` must give a function that returns bytes (every release)."""
    out = fn(_HASH_PROBE_INPUT)
    if not isinstance(out, bytes):
        raise ReturnTypeDriftError(
            capability="hashing", vllm_version=vllm.__version__,
            symbol="get_hash_fn_by_name",
            expected=f"get_hash_fn_by_name({name!r}) to return a function that returns bytes",
            found=f"its function returned {type(out).__name__}")
    return fn


def _contract(s: Symbol, obj: Any) -> str | None:
    """None when the contract holds, else what was found."""
    if s.returns == "hash_fn":
        try:
            check_hash_fn("sha256", obj("sha256"))
        except ReturnTypeDriftError as exc:
            return exc.found
        except Exception as exc:  # noqa: BLE001 - a contract that raises is broken too
            return f"{type(exc).__name__}: {exc}"
    return None


# --------------------------------------------------------------------------- probes


def probe_values() -> dict[str, bool | None]:
    """Every probe of :data:`vllm_compat.surface.PROBES`: True, False, or None (cannot tell)."""
    return {p.name: _probe(p) for p in PROBES}


def probe(name: str) -> bool | None:
    """One probe of :data:`vllm_compat.surface.PROBES` (what ``runtime/`` asks instead of
    comparing version numbers: a nightly that back-ports or reverts a change takes the
    right path)."""
    return _probe(surface.PROBES_BY_NAME[name])


def _probe(p: surface.Probe) -> bool | None:
    answers = [_probe_one(p, key) for key in (p.symbol, *p.alternates)]
    if True in answers:
        return True
    return False if False in answers else None


def _probe_one(p: surface.Probe, key: str) -> bool | None:
    try:
        found = lookup(key)
    except RejectedAliasError:
        return None
    if p.test == "exists":
        if found is not None:
            return True
        # "no" only where the place it would live is there to look in
        return False if p.anchor is None or _lookup_or_none(p.anchor) is not None else None
    if found is None:
        return None
    kind, _, arg = p.test.partition(":")
    if kind == "param":
        ps = params(found.obj)
        return None if ps is None else arg in ps
    if kind == "source":
        try:
            return arg in inspect.getsource(found.obj)
        except (OSError, TypeError):
            return None
    raise ValueError(f"unknown probe test {p.test!r}")


# --------------------------------------------------------------------------- survey


def _annotation(obj: Any) -> str | None:
    if inspect.isclass(obj) or not callable(obj):
        return None
    try:
        ann = inspect.signature(obj).return_annotation
    except (TypeError, ValueError):
        return None
    if ann is inspect.Signature.empty:
        return None
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def _lookup_or_none(key: str) -> Found | None:
    try:
        return lookup(key)
    except RejectedAliasError:
        return None


_SELF_ANNOTATION = r"self\.{name}\s*:\s*([^=\n]+?)\s*="


def _type_text(ann: Any) -> str:
    text = ann if isinstance(ann, str) else inspect.formatannotation(ann)
    return re.sub(r"\btyping\.", "", text).replace("'", "")


def field_types(cls: Any, names: Sequence[str]) -> dict[str, str | None]:
    """The declared type of each named field of ``cls`` (a dataclass, msgspec struct or plain
    class whose source annotates ``self.<name>: T``): the type as text, "?" where the field is
    set without a type, None where ``cls`` has no such field."""
    ann: dict[str, Any] = {}
    for k in reversed(getattr(cls, "__mro__", ())):
        ann.update(vars(k).get("__annotations__", {}))
    ann.update({n: f.type for n, f in (getattr(cls, "__dataclass_fields__", None) or {}).items()})
    try:  # the class's own source (its __init__ annotates ``self.<name>: T``)
        init_source = inspect.getsource(cls)
    except (OSError, TypeError):
        init_source = ""
    out: dict[str, str | None] = {}
    for name in names:
        if name in ann:
            out[name] = _type_text(ann[name])
            continue
        m = re.search(_SELF_ANNOTATION.format(name=re.escape(name)), init_source)
        if m is not None:
            out[name] = _type_text(m.group(1))
        elif re.search(rf"self\.{re.escape(name)}\s*=", init_source) or hasattr(cls, name):
            out[name] = "?"
        else:
            out[name] = None
    return out


def survey() -> dict[str, dict[str, Any]]:
    """Every symbol of the surface as the installed vLLM has it (what snapshots store)."""
    out: dict[str, dict[str, Any]] = {}
    for s in surface.SYMBOLS:
        rejected = None
        try:
            found = lookup(s.key)
        except RejectedAliasError as exc:
            found, rejected = None, f"{exc.expected}; found {exc.found}"
        used = used_here(s)
        exp = _expected(s)
        row: dict[str, Any] = {"expected_at": exp.where if exp is not None else None}
        if found is None:
            row.update(status="missing" if used and not s.optional else "absent", at=None)
            if row["status"] == "missing":
                row["missing"] = rejected or _missing_text(s)
                candidates = candidates_of(s)
                if candidates:
                    row["candidates"] = candidates
            out[s.key] = row
            continue
        status = "aliased" if found.how == "alias" else "moved" if found.moved else "present"
        row.update(status=status, at=found.where, how=found.how)
        if found.alias:
            row["alias"] = aliases.how(*found.alias.split("="))
        if s.fields and inspect.isclass(found.obj):
            row["fields"] = field_types(found.obj, s.fields)
        if s.kind in ("callable", "class") or (s.parent and callable(found.obj)):
            ps = params(found.obj)
            row["params"] = ps
            # constructed or called by vllm_compat: a class it never builds (Executor) or a
            # member it never calls declares nothing and is not checked
            if used and ps is not None and (s.positional or s.passes or s.passes_if_accepted
                                            or s.called):
                new_required, removed = signature_drift(s, found.obj, ps)
                if new_required:
                    row["new_required"] = new_required
                if removed:
                    row["removed"] = removed
            ann = _annotation(found.obj)
            if ann is not None:
                row["returns"] = ann
        if used and s.returns:
            broken = _contract(s, found.obj)
            if broken is not None:
                row["contract"] = broken
        out[s.key] = row
    return out
