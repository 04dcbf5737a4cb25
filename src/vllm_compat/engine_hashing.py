"""The engine's own request hasher: taken from a live engine, or rebuilt from the engine's code.

An ``EngineCore`` builds its request hasher once, in ``__init__``
(``get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)`` -> ``init_none_hash`` ->
``get_request_block_hasher``), and every request the engine admits is hashed by it. Where
vllm_compat can reach that engine (an ``EngineCore``, an in-process ``LLM`` / ``LLMEngine``,
or a ``Scheduler`` an ``EngineCore`` owns), :func:`engine_request_hasher` hands out the very
hasher the engine keeps. Where it cannot (a scheduler built by ``make_scheduler``, doctor),
:func:`engine_path_hasher` runs the engine's own hasher set-up statements, cut out of
``EngineCore.__init__``'s source, with a stand-in for the engine and its config: no model,
no executor. A vLLM build that hashes differently on the engine's path (a wrapped hash
function, another root) then hashes differently here too. vLLM is reached through the
resolver only; nothing here imports it.
"""

from __future__ import annotations

import ast
import builtins
import gc
import inspect
import sys
import textwrap
import threading
import weakref
from types import SimpleNamespace
from typing import Any, Callable

from .errors import UnsupportedFeatureError, VllmCompatError

def _resolve():
    from . import resolve  # imports vLLM: only when a function here runs

    return resolve


HASHER_ATTR = "request_block_hasher"  # EngineCore's attribute, 0.10.2 onward


class EnginePathUnknown(VllmCompatError):
    """``EngineCore.__init__`` no longer builds its hasher in a way this module can replay."""


def engine_core_class() -> type:
    return _resolve().sym("EngineCore")


def _is_engine_core(obj: Any) -> bool:
    cls = _resolve().get("EngineCore")
    return cls is not None and isinstance(obj, cls)


def _is_scheduler(obj: Any) -> bool:
    return hasattr(obj, "kv_cache_manager") and hasattr(obj, "vllm_config")


_owner_lock = threading.Lock()
_owners: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _owning_engine_core(scheduler: Any) -> Any:
    """The EngineCore whose ``scheduler`` is ``scheduler``, or None (a standalone scheduler).

    The scheduler keeps no reference to its engine; the engine refers to it. Looked up once
    per scheduler (``gc.get_referrers`` walks the heap)."""
    with _owner_lock:
        if scheduler in _owners:
            owner = _owners[scheduler]
            return owner() if owner is not None else None
        found = None
        # CPython 3.11+ keeps most instance attributes inline: the referrer is the engine
        # itself; older layouts (or a materialised __dict__) refer through that dict
        for ref in gc.get_referrers(scheduler):
            if _is_engine_core(ref) and getattr(ref, "scheduler", None) is scheduler:
                found = ref
            elif isinstance(ref, dict) and ref.get("scheduler") is scheduler:
                found = next((o for o in gc.get_referrers(ref) if _is_engine_core(o)
                              and getattr(o, "__dict__", None) is ref), None)
            if found is not None:
                break
        _owners[scheduler] = weakref.ref(found) if found is not None else None
        return found


def engine_core_of(target: Any) -> tuple[Any, Any]:
    """``(engine_core, scheduler)`` for an EngineCore, an in-process LLM / LLMEngine, or a
    Scheduler; ``engine_core`` is None for a scheduler no EngineCore owns."""
    if _is_engine_core(target):
        return target, getattr(target, "scheduler", None)
    if _is_scheduler(target):
        return _owning_engine_core(target), target
    # LLM -> llm_engine (LLMEngine) -> engine_core (an EngineCoreClient); the in-process
    # client (InprocClient) keeps the EngineCore as .engine_core (0.10.2 through 0.34.0).
    engine = getattr(target, "llm_engine", target)
    client = getattr(engine, "engine_core", None)
    if client is None:
        raise VllmCompatError(
            f"block_hasher_for() takes an EngineCore, an LLM, an LLMEngine or a Scheduler; "
            f"got {type(target).__name__}")
    core = getattr(client, "engine_core", None)
    if not _is_engine_core(core):
        raise UnsupportedFeatureError(
            f"this {type(target).__name__}'s engine core runs in another process "
            f"({type(client).__name__}), where its hasher cannot be reached: build the LLM "
            "with VLLM_ENABLE_V1_MULTIPROCESSING=0, or pass the engine's Scheduler / "
            "EngineCore from inside its process")
    return core, getattr(core, "scheduler", None)


def engine_request_hasher(core: Any) -> Callable[[Any], list[bytes]] | None:
    """The hasher ``core`` admits requests with, or None (prefix caching off, no connector)."""
    return getattr(core, HASHER_ATTR, None)


# ------------------------------------------------------------------ the engine path, model-less


def _assigns_hasher(node: ast.AST) -> bool:
    targets: list[ast.AST] = []
    value: ast.expr | None
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
        value = node.value
    elif isinstance(node, ast.AnnAssign):
        targets, value = [node.target], node.value
    else:
        return False
    if isinstance(value, ast.Constant) and value.value is None:
        return False
    return any(isinstance(t, ast.Attribute) and t.attr == HASHER_ATTR
               and isinstance(t.value, ast.Name) and t.value.id == "self" for t in targets)


_block_cache: dict[type, tuple[Any, tuple[str, ...], str]] = {}


def _hasher_block(cls: type) -> tuple[Any, tuple[str, ...], str]:
    """The statements of ``cls.__init__`` that build the request hasher (the body of the
    ``if`` that assigns ``self.request_block_hasher``), compiled, with their free names."""
    cached = _block_cache.get(cls)
    if cached is not None:
        return cached
    init = vars(cls).get("__init__", cls.__init__)  # type: ignore[misc]
    try:
        src = textwrap.dedent(inspect.getsource(init))
        filename = inspect.getsourcefile(init) or "<EngineCore.__init__>"
        first = inspect.getsourcelines(init)[1]
    except (OSError, TypeError) as exc:
        raise EnginePathUnknown(f"the source of {cls.__qualname__}.__init__ is not readable: "
                                f"{exc}") from None
    tree = ast.parse(src)
    body = None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(_assigns_hasher(n) for s in node.body
                                            for n in ast.walk(s)):
            body = node.body
            break
    if body is None:
        raise EnginePathUnknown(f"{cls.__qualname__}.__init__ has no `if ...: "
                                f"self.{HASHER_ATTR} = ...` block")
    module = ast.Module(body=body, type_ignores=[])
    ast.increment_lineno(module, first - 1)
    stored = {n.id for s in body for n in ast.walk(s)
              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    loaded = tuple(sorted({n.id for s in body for n in ast.walk(s)
                           if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - stored))
    out = (compile(module, filename, "exec"), loaded, cls.__module__)
    _block_cache[cls] = out
    return out


def _stand_in_config(hash_algo: str, block_size: int, lookahead_tokens: int) -> Any:
    # what EngineCore.__init__'s hasher block reads of its VllmConfig, for one algorithm
    return SimpleNamespace(
        cache_config=SimpleNamespace(prefix_caching_hash_algo=hash_algo, block_size=block_size,
                                     enable_prefix_caching=True),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1),
        num_hash_lookahead_tokens=lookahead_tokens)


def engine_path_hasher(hash_algo: str, block_size: int,
                       lookahead_tokens: int = 0) -> Callable[[Any], list[bytes]]:
    """The request hasher an EngineCore of the installed vLLM would build for ``hash_algo``
    and hash block ``block_size``: its own set-up statements, run on a stand-in engine.

    Runs the engine's ``init_none_hash`` (it re-seeds vLLM's ``NONE_HASH``): callers save
    and restore that state (``hash_check.root_state``)."""
    code, free, modname = _hasher_block(engine_core_class())
    module = sys.modules[modname]
    scope = dict(vars(module))
    me = SimpleNamespace()
    config = _stand_in_config(hash_algo, block_size, lookahead_tokens)
    for name in free:
        if name in scope or hasattr(builtins, name):
            continue
        if name == "self":
            scope[name] = me
        elif name == "vllm_config":
            scope[name] = config
        elif name.endswith("block_size"):  # block_size (0.10), scheduler_/hash_block_size
            scope[name] = block_size
        elif name == "kv_connector":
            scope[name] = None
        else:
            raise EnginePathUnknown(f"EngineCore.__init__ builds its hasher from {name!r}, "
                                    "which vllm_compat cannot stand in for")
    try:
        exec(code, scope)  # noqa: S102 - vLLM's own statements, from its installed source
    except AttributeError as exc:
        raise EnginePathUnknown(f"EngineCore.__init__'s hasher set-up reads something the "
                                f"stand-in config lacks: {exc}") from None
    hasher = getattr(me, HASHER_ATTR, None)
    if not callable(hasher):
        raise EnginePathUnknown(f"EngineCore.__init__'s hasher set-up left {HASHER_ATTR} = "
                                f"{hasher!r}")
    return hasher
