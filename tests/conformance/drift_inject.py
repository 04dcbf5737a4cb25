"""Make one kind of vLLM drift in the real installed vLLM, in this process, before vllm_compat
reads it: what a nightly that changed its internals looks like, without building a wheel.

Kinds (``KINDS``):

- ``none``: nothing changed (the control).
- ``moved``: ``init_none_hash`` and its ``NONE_HASH`` state (and, 0.29+, the seed) moved out of
  ``vllm.v1.core.kv_cache_utils``: to ``vllm.utils.hashing`` (a known alternate place), or on
  0.10.2, which has no such module, to ``vllm.utils`` (found by searching). vLLM's own callers
  still work, as they would after vLLM moved it.
- ``deleted``: ``init_none_hash`` gone from vLLM.
- ``required_param``: ``Request.__init__`` gains a required keyword ``priority_class``.
- ``removed_param``: ``Scheduler.__init__`` no longer takes ``include_finished_set``.
- ``return_type``: ``get_hash_fn_by_name`` hands out functions that return ``str`` (hex).

``python -m tests.conformance.drift_inject KIND`` applies it, calls the vllm_compat API that the
change hits, then ``vllm-compat doctor --drift --json``, and prints ``RESULT <json>``. With
``--as-version V [--strict MODE]`` the installed vLLM also reports version V (its metadata and
``vllm.__version__``: an untested build, as a repacked nightly is) and only ``detect()`` runs,
under ``VLLM_COMPAT_STRICT=MODE``: its result, error and warning are printed. As a pytest
plugin (``-p tests.conformance.drift_inject`` with ``VLLM_COMPAT_TEST_DRIFT=KIND``) it applies
the change before any test runs. Test-side code: it may import vLLM.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import json
import os
import tempfile
import types

KINDS = ("none", "moved", "deleted", "required_param", "removed_param", "return_type")
ENV = "VLLM_COMPAT_TEST_DRIFT"


def hashing_module():
    """Where 0.11+ keeps the hash helpers (``vllm.utils.hashing``), ``vllm.utils`` on 0.10.2."""
    name = "vllm.utils.hashing" if importlib.util.find_spec("vllm.utils.hashing") else "vllm.utils"
    return importlib.import_module(name)


def _engine_core():
    # vLLM's one caller of init_none_hash (EngineCore, every release), imported before the
    # change so that its `from ...kv_cache_utils import init_none_hash` still binds
    return importlib.import_module("vllm.v1.engine.core")


def move_init_none_hash() -> str:
    from vllm.v1.core import kv_cache_utils as kcu

    core = _engine_core()
    target = hashing_module()
    original = kcu.init_none_hash
    # vLLM's block hashing now reads the root from where it moved: hash_block_tokens (its only
    # reader, called by name inside kv_cache_utils) gets globals of its own that hold it
    state = dict(vars(kcu))
    state.pop("NONE_HASH", None)
    old_hbt = kcu.hash_block_tokens
    kcu.hash_block_tokens = functools.update_wrapper(types.FunctionType(
        old_hbt.__code__, state, old_hbt.__name__, old_hbt.__defaults__, old_hbt.__closure__),
        old_hbt)

    @functools.wraps(original)
    def init_none_hash(hash_fn):
        original(hash_fn)  # computes the root (into kv_cache_utils), which then moves
        state["NONE_HASH"] = target.NONE_HASH = vars(kcu).pop("NONE_HASH")

    init_none_hash.__module__ = target.__name__
    target.init_none_hash = init_none_hash
    core.init_none_hash = init_none_hash  # vLLM's caller updated, as vLLM would do
    target.__annotations__["NONE_HASH"] = bytes  # declared there, set by init_none_hash
    del kcu.init_none_hash
    kcu.__annotations__.pop("NONE_HASH", None)
    # 0.29+: the seed goes with it (vLLM's own init keeps its module's copy)
    if hasattr(kcu, "DEFAULT_NONE_HASH_SEED"):
        target.DEFAULT_NONE_HASH_SEED = kcu.DEFAULT_NONE_HASH_SEED
    return target.__name__


def delete_init_none_hash() -> None:
    from vllm.v1.core import kv_cache_utils as kcu

    _engine_core()  # vLLM seeds some other way now; its engine still imports
    del kcu.init_none_hash


def add_required_request_param() -> None:
    from vllm.v1.request import Request

    original = Request.__init__
    sig = inspect.signature(original)

    def __init__(self, *args, priority_class, **kwargs):
        original(self, *args, **kwargs)
        self.priority_class = priority_class

    params = list(sig.parameters.values())
    params.append(inspect.Parameter("priority_class", inspect.Parameter.KEYWORD_ONLY))
    __init__.__signature__ = sig.replace(parameters=params)
    __init__.__qualname__ = original.__qualname__
    Request.__init__ = __init__


def remove_scheduler_param() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__init__
    sig = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        if "include_finished_set" in kwargs:
            raise TypeError("Scheduler.__init__() got an unexpected keyword argument "
                            "'include_finished_set'")
        original(self, *args, **kwargs)

    __init__.__signature__ = sig.replace(
        parameters=[p for p in sig.parameters.values() if p.name != "include_finished_set"])
    Scheduler.__init__ = __init__


def hex_hash_functions() -> None:
    mod = hashing_module()
    original = mod.get_hash_fn_by_name

    @functools.wraps(original)
    def get_hash_fn_by_name(*args, **kwargs):
        fn = original(*args, **kwargs)
        return lambda value: fn(value).hex()

    mod.get_hash_fn_by_name = get_hash_fn_by_name


def apply(kind: str) -> None:
    if kind not in KINDS:
        raise SystemExit(f"unknown drift kind {kind!r}: one of {KINDS}")
    {"none": lambda: None, "moved": move_init_none_hash, "deleted": delete_init_none_hash,
     "required_param": add_required_request_param, "removed_param": remove_scheduler_param,
     "return_type": hex_hash_functions}[kind]()


def apply_from_env() -> str | None:
    kind = os.environ.get(ENV)
    if kind:
        apply(kind)
    return kind


def pytest_configure(config) -> None:  # as a pytest plugin: drift before any test
    apply_from_env()


# ----------------------------------------------------------------------------- the probe


def _error(exc: Exception) -> dict:
    out = {"type": type(exc).__name__, "message": str(exc)}
    for k in ("capability", "vllm_version", "symbol", "expected", "found", "workaround"):
        if hasattr(exc, k):
            out[k] = getattr(exc, k)
    return out


def _api(kind: str, out: dict) -> None:
    """Call the vllm_compat API the change hits."""
    import vllm_compat as vc

    tokens = list(range(100, 140))
    if kind == "required_param":
        try:
            vc.make_request("r", tokens)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            out["error"] = _error(exc)
        req = vc.make_request("r", tokens, priority_class=0)  # the workaround the error names
        out["workaround_request"] = {"priority_class": req.priority_class,
                                     "block_hashes": len(req.block_hashes)}
        return
    if kind == "removed_param":
        with tempfile.TemporaryDirectory() as d:
            from vllm_compat.testing.models import write_tiny_llama_config

            cfg = vc.make_vllm_config(write_tiny_llama_config(d))
            try:
                vc.make_scheduler(cfg)
            except Exception as exc:  # noqa: BLE001
                out["error"] = _error(exc)
        return
    try:
        hasher = vc.make_block_hasher(16)
        req = vc.make_request("r", tokens, block_hasher=hasher)
    except Exception as exc:  # noqa: BLE001
        out["error"] = _error(exc)
        return
    out["hashes"] = [h.hex() for h in req.block_hashes]
    # vLLM's own hasher over the same request (it reads vLLM's root): equal when vLLM
    # itself still hashes as before and we found its root where it moved
    from vllm.v1.core import kv_cache_utils as kcu

    raw = kcu.get_request_block_hasher(16, vc.adapter().hash_function("sha256"))
    bare = vc.make_request("bare", tokens, block_hasher=None)
    out["vllm_hashes"] = [h.hex() for h in raw(bare)]


def report_version(version: str) -> None:
    """The installed vLLM says it is ``version`` (metadata and ``vllm.__version__``)."""
    import importlib.metadata as md

    import vllm

    real = md.version
    md.version = lambda name: version if name == "vllm" else real(name)
    vllm.__version__ = version


def _detect(out: dict) -> None:
    import warnings

    import vllm_compat as vc

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            info = vc.detect()
            out["detect"] = {"version": info.version, "era": info.era, "routing": info.routing,
                             "newer_than_tested": info.newer_than_tested, "drift": info.drift}
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            out["error"] = _error(exc)
    out["warnings"] = [str(w.message) for w in caught if "newer than the newest" in str(w.message)]


def main(kind: str, as_version: str | None = None, strict: str | None = None) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if strict is not None:
        os.environ["VLLM_COMPAT_STRICT"] = strict
    apply(kind)
    if as_version is not None:
        report_version(as_version)
        out = {"kind": kind, "as_version": as_version, "strict": strict}
        _detect(out)
        print("RESULT " + json.dumps(out))
        return
    import vllm

    from vllm_compat.cli import main as cli_main

    out: dict = {"kind": kind, "vllm": vllm.__version__}
    _api(kind, out)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out["doctor_exit"] = cli_main(["doctor", "--drift", "--json"])
    text = buf.getvalue()
    out["doctor"] = json.loads(text[text.index("{"):])
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--as-version")
    parser.add_argument("--strict")
    args = parser.parse_args()
    main(args.kind, args.as_version, args.strict)
