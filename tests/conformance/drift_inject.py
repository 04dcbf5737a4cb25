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
- ``renamed_step``: the second phase of the model step, ``sample_tokens``, renamed
  ``sample_step_tokens`` on the executors, workers and model runners (0.11+).
- ``request_moved``: ``vllm.v1.request`` gone; ``Request`` and ``RequestStatus`` live in
  ``vllm.v1.engine.request_state`` (vLLM's own callers keep the classes they imported).
- ``hash_keyword``: ``hash_block_tokens`` gains a required keyword ``scheme``; vLLM's request
  hasher (its one caller) passes it.
- ``field_type``: ``ModelRunnerOutput.sampled_token_ids`` becomes ``list[np.ndarray]`` (as in
  0.11.x); the scheduler turns the arrays into lists, as 0.11.x did.
- ``now_required``: ``Scheduler``'s optional ``hash_block_size`` (0.20+) becomes required.
- ``module_split``: the block-hash functions and their ``NONE_HASH`` state leave
  ``vllm.v1.core.kv_cache_utils`` for a new module, ``vllm.v1.core.block_hashing``.
- ``salted_engine_hash``: the hash function ``EngineCore`` builds its request hasher with is
  salted, on the engine's path only (``vllm.v1.engine.core.get_hash_fn_by_name``);
  ``kv_cache_utils.hash_block_tokens`` and ``vllm.utils.hashing`` are unchanged.

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

KINDS = ("none", "moved", "deleted", "required_param", "removed_param", "return_type",
         "renamed_step", "request_moved", "hash_keyword", "field_type", "now_required",
         "module_split")
NEW_STEP_NAME = "sample_step_tokens"
ENV = "VLLM_COMPAT_TEST_DRIFT"


def hashing_module():
    """Where 0.11+ keeps the hash helpers (``vllm.utils.hashing``), ``vllm.utils`` on 0.10.2."""
    name = "vllm.utils.hashing" if importlib.util.find_spec("vllm.utils.hashing") else "vllm.utils"
    return importlib.import_module(name)


def _engine_core():
    # vLLM's one caller of init_none_hash (EngineCore, every release), imported before the
    # change so that its `from ...kv_cache_utils import init_none_hash` still binds
    return importlib.import_module("vllm.v1.engine.core")


def _engine_reads_root_from(core, kcu, target) -> None:
    """0.34's EngineCore reads ``kv_cache_utils.NONE_HASH`` through the module: vLLM's caller,
    updated as vLLM would, reads it from where it moved (every other name as before)."""
    if getattr(core, "kv_cache_utils", None) is not kcu:
        return
    view = types.ModuleType(kcu.__name__)
    view.__getattr__ = lambda name: target.NONE_HASH if name == "NONE_HASH" else getattr(kcu, name)
    core.kv_cache_utils = view


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
    _engine_reads_root_from(core, kcu, target)
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


def _renamed(fn, old: str, new: str):
    """``fn`` under the name ``new``, its string constant ``old`` (the name it forwards to
    through collective_rpc) renamed too."""
    code = fn.__code__
    consts = tuple(new if c == old else c for c in code.co_consts)
    out = types.FunctionType(code.replace(co_consts=consts, co_name=new), fn.__globals__,
                             new, fn.__defaults__, fn.__closure__)
    out.__qualname__ = fn.__qualname__.replace(old, new)
    out.__module__, out.__doc__ = fn.__module__, fn.__doc__
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    if hasattr(fn, "__wrapped__"):  # a decorated method keeps its signature
        out.__wrapped__ = fn.__wrapped__
    return out


STEP_CLASSES = ("vllm.v1.executor.abstract:Executor", "vllm.v1.executor.uniproc_executor:UniProcExecutor",
                "vllm.v1.executor.multiproc_executor:MultiprocExecutor",
                "vllm.v1.worker.worker_base:WorkerBase", "vllm.v1.worker.gpu_worker:Worker",
                "vllm.v1.worker.cpu_worker:CPUWorker",
                "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
                "vllm.v1.worker.gpu.model_runner:GPUModelRunner")


RENAMED_STEP_CLASSES: list[str] = []  # what rename_sample_tokens changed in this process


def rename_sample_tokens() -> list[str]:
    renamed = RENAMED_STEP_CLASSES
    for spec in STEP_CLASSES:
        module, _, name = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception:  # noqa: BLE001 - not in this release, or needs a GPU stack
            continue
        fn = vars(cls).get("sample_tokens")
        if fn is None:
            continue
        setattr(cls, NEW_STEP_NAME, _renamed(fn, "sample_tokens", NEW_STEP_NAME))
        delattr(cls, "sample_tokens")
        renamed.append(spec)
    return renamed


NEW_REQUEST_MODULE = "vllm.v1.engine.request_state"


def move_request_module() -> None:
    import sys

    from vllm_compat import surface

    old = importlib.import_module("vllm.v1.request")
    # vLLM's callers keep the classes they imported: every module of the surface is loaded first
    for loc in {loc.module for s in surface.SYMBOLS for loc in s.locations}:
        with contextlib.suppress(Exception):
            importlib.import_module(loc)
    new = types.ModuleType(NEW_REQUEST_MODULE)
    new.__dict__.update({k: v for k, v in vars(old).items() if not k.startswith("__")})
    for name in ("Request", "RequestStatus"):
        getattr(old, name).__module__ = NEW_REQUEST_MODULE
    sys.modules[NEW_REQUEST_MODULE] = new
    importlib.import_module("vllm.v1.engine").request_state = new
    sys.modules["vllm.v1.request"] = None  # `import vllm.v1.request` now fails
    delattr(importlib.import_module("vllm.v1"), "request")


def _with_globals(fn, namespace: dict):
    return functools.update_wrapper(types.FunctionType(
        fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__), fn)


def require_hash_keyword() -> None:
    from vllm.v1.core import kv_cache_utils as kcu

    original = kcu.hash_block_tokens

    def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids,
                          extra_keys=None, *, scheme):
        assert scheme == "v1", scheme
        return original(hash_function, parent_block_hash, curr_block_token_ids, extra_keys)

    hash_block_tokens.__module__ = kcu.__name__
    hash_block_tokens.__annotations__ = {**original.__annotations__, "scheme": str}
    # vLLM's one caller, the request hasher, passes the keyword (its own namespace sees a
    # hash_block_tokens that fills it in)
    state = dict(vars(kcu))
    state["hash_block_tokens"] = functools.partial(hash_block_tokens, scheme="v1")
    kcu.get_request_block_hasher = _with_globals(kcu.get_request_block_hasher, state)
    kcu.hash_block_tokens = hash_block_tokens
    core = _engine_core()
    core.get_request_block_hasher = kcu.get_request_block_hasher


def ndarray_sampled_token_ids() -> None:
    import numpy as np
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput

    ModelRunnerOutput.__dataclass_fields__["sampled_token_ids"].type = list[np.ndarray]
    ModelRunnerOutput.__annotations__["sampled_token_ids"] = list[np.ndarray]
    original = Scheduler.update_from_output

    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        ids = model_runner_output.sampled_token_ids
        if ids and isinstance(ids[0], np.ndarray):  # what the 0.11.x scheduler did
            model_runner_output.sampled_token_ids = [a.tolist() for a in ids]
        return original(self, scheduler_output, model_runner_output)

    Scheduler.update_from_output = update_from_output


def require_hash_block_size() -> bool:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__init__
    sig = inspect.signature(original)
    if "hash_block_size" not in sig.parameters:
        return False

    def __init__(self, *args, **kwargs):
        if "hash_block_size" not in kwargs:
            raise TypeError("Scheduler.__init__() missing 1 required keyword-only argument: "
                            "'hash_block_size'")
        original(self, *args, **kwargs)

    params = [p.replace(default=inspect.Parameter.empty, kind=inspect.Parameter.KEYWORD_ONLY)
              if p.name == "hash_block_size" else p for p in sig.parameters.values()]
    # a required keyword-only parameter may follow optional ones
    __init__.__signature__ = sig.replace(parameters=sorted(
        params, key=lambda p: p.kind == inspect.Parameter.KEYWORD_ONLY and p.name == "hash_block_size"))
    __init__.__qualname__ = original.__qualname__
    Scheduler.__init__ = __init__
    return True


SPLIT_MODULE = "vllm.v1.core.block_hashing"
SPLIT_NAMES = ("init_none_hash", "resolve_none_hash_seed", "get_none_hash_seed",
               "hash_block_tokens", "get_request_block_hasher",
               "generate_block_hash_extra_keys", "DEFAULT_NONE_HASH_SEED")


def split_block_hashing() -> None:
    import sys

    from vllm.v1.core import kv_cache_utils as kcu

    core = _engine_core()
    new = types.ModuleType(SPLIT_MODULE)
    state = new.__dict__
    state.update({k: v for k, v in vars(kcu).items() if not k.startswith("__")})
    state["__name__"] = SPLIT_MODULE
    state["__annotations__"] = {"NONE_HASH": bytes}
    state.pop("NONE_HASH", None)
    for name in SPLIT_NAMES:
        obj = getattr(kcu, name, None)
        if obj is None:
            continue
        if isinstance(obj, types.FunctionType):
            obj = _with_globals(obj, state)
            obj.__module__ = SPLIT_MODULE
        state[name] = obj
        delattr(kcu, name)
    # the rest of kv_cache_utils, and vLLM's callers, use the new module
    for name in ("get_request_block_hasher", "init_none_hash"):
        setattr(core, name, state[name])
    kcu.__annotations__.pop("NONE_HASH", None)
    vars(kcu).pop("NONE_HASH", None)
    _engine_reads_root_from(core, kcu, new)
    sys.modules[SPLIT_MODULE] = new
    importlib.import_module("vllm.v1.core").block_hashing = new


def apply(kind: str) -> None:
    if kind not in KINDS:
        raise SystemExit(f"unknown drift kind {kind!r}: one of {KINDS}")
    if kind in EXTRA_KINDS:
        return EXTRA_KINDS[kind]()
    {"none": lambda: None, "moved": move_init_none_hash, "deleted": delete_init_none_hash,
     "required_param": add_required_request_param, "removed_param": remove_scheduler_param,
     "return_type": hex_hash_functions, "renamed_step": rename_sample_tokens,
     "request_moved": move_request_module, "hash_keyword": require_hash_keyword,
     "field_type": ndarray_sampled_token_ids, "now_required": require_hash_block_size,
     "module_split": split_block_hashing}[kind]()


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
    if kind in EXTRA_APIS:
        return EXTRA_APIS[kind](out)

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
    # itself still hashes as before and we found its root where it moved. Taken from
    # EngineCore's module, vLLM's one caller, wherever vLLM keeps the function.
    raw = _engine_core().get_request_block_hasher(16, vc.adapter().hash_function("sha256"))
    bare = vc.make_request("bare", tokens, block_hasher=None)
    out["vllm_hashes"] = [h.hex() for h in raw(bare)]
    if kind in ("renamed_step", "request_moved", "field_type", "now_required", "hash_keyword",
                "module_split"):
        out["detect_drifted"] = vc.detect().drifted
        out["scheduler"] = _schedule_to_the_end(tokens)
    if kind == "renamed_step" and RENAMED_STEP_CLASSES:
        # 0.10.2's step is single-phase: it has no sample_tokens, so nothing was renamed
        _step(out)


class StepStandIn:
    """The worker a renamed build would have: execute_model, then sample_step_tokens."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.pending, self.calls = scheduler, None, []

    def execute_model(self, so):
        import vllm_compat as vc

        self.calls.append("execute_model")
        ids = list(so.num_scheduled_tokens)
        done = [self.scheduler.requests[r].num_computed_tokens >= self.scheduler.requests[r].num_tokens
                for r in ids]
        self.pending = vc.make_model_runner_output(ids, [[7] if d else [] for d in done])
        return None

    def sample_step_tokens(self, grammar_output):
        self.calls.append(NEW_STEP_NAME)
        out, self.pending = self.pending, None
        return out

    def shutdown(self):  # the executor's __del__ calls it
        pass


def _executor(worker):
    """vLLM's UniProcExecutor around ``worker`` (its __init__, which loads a model, skipped)."""
    from tests.conformance import reference

    ex = object.__new__(reference.uniproc_executor_class())
    ex.driver_worker = worker
    return ex


def _scheduler():
    import vllm_compat as vc
    from vllm_compat.testing.models import write_tiny_llama_config

    d = tempfile.mkdtemp(prefix="drift-inject-")
    return vc.make_scheduler(vc.make_vllm_config(write_tiny_llama_config(d), block_size=16))


def _schedule_to_the_end(tokens: list[int]) -> dict:
    """A request through the real scheduler, its model output fabricated: what keeps working."""
    import vllm_compat as vc
    from vllm import SamplingParams

    sched = _scheduler()
    sched.add_request(vc.make_request("s", tokens, sampling_params=SamplingParams(max_tokens=2),
                                      block_hasher=vc.block_hasher_for(sched)))
    steps, outputs = 0, []
    while sched.has_unfinished_requests() and steps < 10:
        so = vc.schedule(sched)
        ids = list(so.num_scheduled_tokens)
        done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens for r in ids]
        eo = vc.update_from_output(sched, so, vc.make_model_runner_output(
            ids, [[7] if d else [] for d in done]))
        outputs += [t for eco in eo.values() for o in eco.outputs for t in o.new_token_ids]
        steps += 1
    return {"type": type(sched).__name__, "steps": steps, "tokens": outputs,
            "finished": not sched.has_unfinished_requests()}


def _step(out: dict) -> None:
    """run_model_step on a renamed build: refused before execute_model; then with the alias."""
    import vllm_compat as vc
    from vllm import SamplingParams

    sched = _scheduler()
    worker = StepStandIn(sched)
    sched.add_request(vc.make_request("m", list(range(100, 120)),
                                      sampling_params=SamplingParams(max_tokens=1)))
    so = vc.schedule(sched)
    try:
        vc.run_model_step(_executor(worker), so)
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        out["error"] = _error(exc)
    out["calls_before_alias"] = list(worker.calls)  # nothing half done
    try:
        vc.StepPipeline(sched, _executor(worker))
    except Exception as exc:  # noqa: BLE001
        out["pipeline_error"] = _error(exc)
    out["doctor_before_alias"] = _doctor()
    vc.alias(sample_tokens=NEW_STEP_NAME)  # the user's way out, checked by the resolver
    result = vc.run_model_step(_executor(worker), so)
    out["calls_with_alias"] = list(worker.calls)
    out["finished_with_alias"] = [rid for eco in vc.update_from_output(sched, so, result).values()
                                  for o in eco.outputs if o.finish_reason is not None
                                  for rid in [o.request_id]]


def _doctor() -> dict:
    from vllm_compat.cli import main as cli_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(["doctor", "--drift", "--json"])
    text = buf.getvalue()
    return {"exit": code, **json.loads(text[text.index("{"):])}


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

    out: dict = {"kind": kind, "vllm": vllm.__version__}
    _api(kind, out)
    doctor = _doctor()
    out["doctor_exit"] = doctor.pop("exit")
    out["doctor"] = doctor
    print("RESULT " + json.dumps(out))



# ----------------------------------------------------------------------------- salted engine hash

ENGINE_SALT = "nightly-engine-salt"


def salt_engine_hash() -> None:
    """EngineCore's hash function salted: what a build that changes the engine's hashing
    only looks like. vLLM's hash helpers and kv_cache_utils stay as they were."""
    core = _engine_core()
    original = core.get_hash_fn_by_name

    @functools.wraps(original)
    def get_hash_fn_by_name(name):
        fn = original(name)

        @functools.wraps(fn)
        def salted(data):
            return fn((ENGINE_SALT, data))

        return salted

    core.get_hash_fn_by_name = get_hash_fn_by_name


def _salted_api(out: dict) -> None:
    """block_hasher_for on a standalone scheduler checks ours against the engine's hasher."""
    import vllm_compat as vc

    try:
        h = vc.block_hasher_for(_scheduler())
        out["block_hasher_for"] = {"source": h.source}
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        out["error"] = {**_error(exc), "differs": getattr(exc, "differs", None)}


KINDS = KINDS + ("salted_engine_hash",)
EXTRA_KINDS = {"salted_engine_hash": salt_engine_hash}
EXTRA_APIS = {"salted_engine_hash": _salted_api}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--as-version")
    parser.add_argument("--strict")
    args = parser.parse_args()
    main(args.kind, args.as_version, args.strict)
