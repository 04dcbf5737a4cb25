"""The extraction engine: an in-process vLLM ``LLM`` whose engine core we drive step by step.

Release-agnostic: every branch is chosen by a feature probe, with a comment naming the
vLLM release or change behind it. :class:`vllm_compat.extract.HiddenStatesExtractor` is the
public face; :mod:`.capture_plan` decides the capture mode and :mod:`.capture_worker` runs
inside vLLM's worker.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any, Iterable, Mapping, Sequence

import torch
import vllm

from ..resolve import check_call, get, probe, sym
from ..detect import detect
from ..extract import fp8
from ..extract.staging import StagedCopy
from ..requests import make_request
from ..rpc import collective_rpc
from ..step import StepPipeline
from ..target import TargetInfo
from . import capture_worker
from .capture_plan import plan
from .llm import free_gpu_memory, release_llm


def _engine_args_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(sym("EngineArgs"))}


def set_env(**values: str) -> dict[str, str | None]:
    """Set environment variables; returns what to hand :func:`restore_env` afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    return old


def restore_env(old: Mapping[str, str | None]) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v



def _multimodal_wrapper_args(target: TargetInfo, fields: set[str],
                             kw: Mapping[str, Any]) -> dict[str, Any]:
    """Engine arguments for a multimodal wrapper (Kimi-K2.5): text only, and where the release
    loads the tokenizer and image processor at engine start, with them."""
    if not target.is_multimodal_wrapper:
        return {}
    out: dict[str, Any] = {}
    if "language_model_only" in fields:  # 0.18.1+: no vision tower, no encoder profiling
        out["language_model_only"] = kw.get("language_model_only", True)
    # vLLM 0.21 catches the tokenizer error raised while it builds a multimodal model's
    # processing info without a tokenizer and starts text-only; 0.15-0.20 fail the engine start
    if not probe("text_only_without_tokenizer") and not kw.get("skip_tokenizer_init"):
        if not kw.get("trust_remote_code"):
            raise ValueError(
                f"{target.architectures[0]} on vLLM {vllm.__version__} loads its tokenizer and "
                "image processor at engine start, and this checkpoint's are remote code: pass "
                "trust_remote_code=True to run them (or use vLLM 0.21+, which starts it "
                "text-only without them)")
        out["skip_tokenizer_init"] = False
    return out


# Run-time variables held by open engines: name -> [the value before the first hold, holders].
# One engine's close must not take a variable from another engine still running.
_run_env_holds: dict[str, list[Any]] = {}


def _hold_run_env(values: Mapping[str, str]) -> None:
    for k, v in values.items():
        held = _run_env_holds.setdefault(k, [os.environ.get(k), 0])
        held[1] += 1
        os.environ[k] = v


def _release_run_env(names: Iterable[str]) -> None:
    """Drop one hold on each variable; the last one puts back the value from before the first."""
    for k in names:
        held = _run_env_holds.get(k)
        if held is None:
            continue
        held[1] -= 1
        if held[1] <= 0:
            del _run_env_holds[k]
            restore_env({k: held[0]})


def engine_env(*, compiled: bool, aux_ids_for_workers: Sequence[int] = (),
               tap_for_workers: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """The variables an extraction engine needs: ``(build, run)``. ``build`` is set only while
    the ``LLM`` is built; ``run`` stays set until the engine is closed. Nothing stays set
    after that: every later engine of the process sees the caller's environment."""
    # vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING only while an engine is built (LLMEngine,
    # EngineArgs, 0.10.2-0.34). Left set, it put every later LLM of the process in-process,
    # where engines built after a torn-down one failed (vLLM 0.26.0, H200).
    build = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run: dict[str, str] = {}
    if compiled:
        # The aux layers live on the model object, not in the config hash: a compile
        # cache from a run with other layers would be reused silently. Recompile.
        run["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        # 0.26 (torch >= 2.10): VLLM_USE_AOT_COMPILE defaults to on unless the compile
        # cache is disabled, and the compiled forward asserts it is off at *run* time
        # (seen on the H200: AssertionError in compilation/decorators.py). Both must
        # stay set while this engine runs, not only while it is built.
        run["VLLM_USE_AOT_COMPILE"] = "0"
    if aux_ids_for_workers:  # read by the spawned workers, at start
        build[capture_worker.ENV_AUX] = ",".join(map(str, aux_ids_for_workers))
    if tap_for_workers:
        build[capture_worker.ENV_TAP] = "1"
    return build, run


def _refuse_unsupported(kw: Mapping[str, Any]) -> None:
    if kw.get("enable_prefix_caching"):
        raise ValueError("enable_prefix_caching=True: cached prompt tokens are not recomputed, "
                         "so their hidden states would be missing; leave it off")
    if kw.get("pipeline_parallel_size", 1) != 1:
        raise ValueError("pipeline_parallel_size > 1 is not supported")


def reset_envs_cache() -> None:
    """Make vLLM read its environment variables again (before building another engine)."""
    # 0.2x: EngineCore.__init__ calls envs.enable_envs_cache(), freezing env reads for the
    # rest of the process; a second LLM must see our variables again.
    fn = get("disable_envs_cache")
    if fn is not None:
        fn()


def _saved(path: str) -> bool:
    import fcntl
    lock = path + ".lock"
    if not os.path.exists(lock):  # 0.17.1-0.21.0: synchronous save, no lock file
        return os.path.exists(path)
    with open(lock) as lf:
        try:
            fcntl.flock(lf, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lf, fcntl.LOCK_UN)
        return True


def wait_hidden_states_saved(paths: Sequence[str], llm: Any, timeout: float = 120.0) -> None:
    """Until vLLM's hidden-states connector has written every file of ``paths`` (the
    ``kv_transfer_params["hidden_states_path"]`` of ``generate()``'s outputs).

    0.24.0+ saves in the worker's ``get_finished`` (PendingSave) and holds a LOCK_EX on
    ``<path>.lock`` until then; ``LLM.generate`` returns as soon as the request's output
    is out, before that step runs. ``load_hidden_states`` (0.22.1+) then blocks on LOCK_SH
    for ever in an in-process engine (seen on 0.26.0, H200). We take the lock non-blocking
    and, for an in-process engine core (which would otherwise stall), step it meanwhile; a
    separate engine-core process keeps stepping on its own. Deadline: ``timeout`` seconds.
    """
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    pending = list(paths)
    deadline = time.monotonic() + timeout
    while True:
        pending = [p for p in pending if not _saved(p)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM's hidden-states connector did not write {len(pending)} "
                               f"file(s) within {timeout:.0f} s, e.g. {pending[0]}")
        if core is not None and core.scheduler.has_requests():
            core.step()
        else:
            time.sleep(0.002)


class ExtractionEngine:
    """An in-process vLLM engine driven step by step for prefill-only capture: ``add`` prompts,
    ``step`` collects the chunks of hidden states each engine step produced."""

    def __init__(self, target: TargetInfo, layer_ids: Sequence[int], *, backend: str = "auto", tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.5,
                 overlap_copy: bool | None = None, launch_ahead: bool | None = None,
                 states_dtype: torch.dtype | None = None,
                 llm_kwargs: Mapping[str, Any] | None = None) -> None:
        kw = dict(llm_kwargs or {})
        self.states_dtype = states_dtype
        _refuse_unsupported(kw)
        self.plan = plan(target, layer_ids, backend=backend, enforce_eager=enforce_eager)
        self.target = target
        self.layer_ids = tuple(layer_ids)
        self.tensor_parallel_size = tensor_parallel_size
        self._tmpdir: str | None = None
        self._run_env: tuple[str, ...] = ()  # run-time variables this engine holds
        # Pipelined steps (StepPipeline, depth 2) schedule step N+1 before step N's output is
        # in, as vLLM's async scheduling does: the engine is built for it (AsyncScheduler's
        # output placeholders; the V1 runner then hands its sampled tokens back without a
        # sync). In-process (TP=1) and 0.11.2+ (two-phase step) only; native runs generate().
        self._pipelined_engine = (tensor_parallel_size == 1 and self.plan.mode != "native"
                                  and detect().probes["two_phase_step"])
        args = self._engine_args(target.path, kw, gpu_memory_utilization=gpu_memory_utilization,
                                 max_model_len=max_model_len,
                                 max_num_batched_tokens=max_num_batched_tokens)
        self.llm = self._build_llm(args)
        try:
            self._attach_engine_core()
            self.info["async_scheduling"] = bool(args.get("async_scheduling", False))
            self._init_step_loop(overlap_copy, launch_ahead)
        except BaseException:
            self.close()  # a half-built engine still holds the GPU and the environment
            raise

    def _engine_args(self, model_path: str, kw: dict[str, Any], *,
                     gpu_memory_utilization: float, max_model_len: int | None,
                     max_num_batched_tokens: int | None) -> dict[str, Any]:
        """``vllm.LLM`` keywords for this plan (``kw``: the caller's, which win)."""
        fields = _engine_args_fields()
        args: dict[str, Any] = dict(
            model=model_path, skip_tokenizer_init=True, enable_prefix_caching=False,
            tensor_parallel_size=self.tensor_parallel_size,
            enforce_eager=self.plan.enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, seed=0,
        )
        if "async_scheduling" in fields:  # 0.11+
            args["async_scheduling"] = kw.pop("async_scheduling", self._pipelined_engine)
        if max_model_len is not None:
            args["max_model_len"] = max_model_len
        if max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = max_num_batched_tokens
            args["enable_chunked_prefill"] = True
            if "max_num_seqs" not in kw:
                args["max_num_seqs"] = max(1, min(256, max_num_batched_tokens))
        if self.plan.mode == "native":
            self._tmpdir = tempfile.mkdtemp(prefix="vllm-compat-hs-")
            ids = list(self.plan.native_ids)
            args["speculative_config"] = {
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
            }
            args["kv_transfer_config"] = {
                "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._tmpdir},
            }
        args.update(_multimodal_wrapper_args(self.target, fields, kw))
        if self._aux_in_worker_processes:
            if kw.get("worker_extension_cls"):
                raise ValueError("worker_extension_cls is used by the extractor for TP > 1")
            args["worker_extension_cls"] = f"{capture_worker.__name__}.AuxWorkerExtension"
        args.update(kw)
        return args

    @property
    def _aux_in_worker_processes(self) -> bool:
        # Worker processes: vLLM forces spawn once CUDA is initialised here, and a spawned
        # worker does not inherit our class patch (seen on 0.26.0, 2x H200: "aux capture was
        # not configured on the worker"). The ids go by environment and the worker imports
        # capture_worker through worker_extension_cls.
        return (self.tensor_parallel_size > 1 and self.plan.mode == "aux"
                and (bool(self.plan.native_ids) or self.plan.tap_final))

    def _build_llm(self, args: dict[str, Any]) -> Any:
        """Build the ``LLM`` with the environment it needs (:func:`engine_env`), aux capture
        configured at load. The run-time variables are put back by :meth:`close`."""
        build, run = engine_env(
            compiled=not args["enforce_eager"],
            aux_ids_for_workers=self.plan.native_ids if self._aux_in_worker_processes else (),
            tap_for_workers=self._aux_in_worker_processes and self.plan.tap_final)
        old_build = set_env(**build)
        try:  # from the first variable set on, a failure must put them all back
            _hold_run_env(run)
            reset_envs_cache()
            with capture_worker.aux_configured(
                    self.plan.native_ids if self.plan.mode == "aux" else None,
                    tap_final=self.plan.tap_final):
                llm_cls = sym("LLM")
                check_call("LLM", llm_cls, 0, args)
                llm = llm_cls(**args)
        except BaseException:
            _release_run_env(run)
            raise
        finally:
            restore_env(old_build)
            reset_envs_cache()
        self._run_env = tuple(run)
        return llm

    def _attach_engine_core(self) -> None:
        """Find the in-process engine core and executor; install hooks; describe the worker."""
        client = self.llm.llm_engine.engine_core
        self.core: Any = getattr(client, "engine_core", None)  # None when native
        if self.plan.mode != "native" and self.core is None:
            raise RuntimeError(f"expected an in-process engine core, got {type(client).__name__} "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0 was ignored?)")
        self.executor = self.core.model_executor if self.core is not None else None
        if self.plan.mode == "hooks":
            collective_rpc(self.executor, capture_worker.install_hooks, args=(self.layer_ids,))
        info = collective_rpc(self.executor, capture_worker.describe, rank=0) \
            if self.executor is not None else {}
        if self.plan.mode == "aux" and self.plan.native_ids and not info.get("use_aux"):
            raise RuntimeError(f"aux capture was not configured on the worker: {info}")
        if self.plan.tap_final and not info.get("tap_final"):
            raise RuntimeError(f"the final-state tap was not installed on the worker: {info}")
        self.info = dict(info, mode=self.plan.mode, note=self.plan.note,
                         vllm=vllm.__version__, tp=self.tensor_parallel_size,
                         enforce_eager=self.plan.enforce_eager)
        self._block_hasher = getattr(self.core, "request_block_hasher", None)
        self._sp = sym("SamplingParams")(max_tokens=1, temperature=0.0, detokenize=False)

    def _init_step_loop(self, overlap_copy: bool | None, launch_ahead: bool | None) -> None:
        # TP=1 runs the worker in this process (UniProcExecutor): its tensors need no pickling
        self._in_process_worker = self.tensor_parallel_size == 1
        # Overlap each step's device->host copy with the next forward (HostStaging); in-process
        # only. VLLM_COMPAT_EXTRACT_OVERLAP=0 (or overlap_copy=False) restores the blocking copy.
        if overlap_copy is None:
            overlap_copy = os.environ.get("VLLM_COMPAT_EXTRACT_OVERLAP", "1") != "0"
        self.overlap_copy = bool(overlap_copy) and self._in_process_worker
        self.info["overlap_copy"] = self.overlap_copy
        self._tickets: collections.deque[StagedCopy] = collections.deque()  # finished steps'
        self._pipe = StepPipeline(self.core.scheduler, self.executor, depth=1,
                                  between=self._collect) if self.core is not None else None
        self._collect_s = 0.0
        self._handoff_s = 0.0
        self._empty_steps = 0  # consecutive steps that scheduled nothing
        # Pipelined steps (launch_ahead): step N+1 is scheduled and launched before step N's
        # sampled tokens are waited for (StepPipeline, depth 2), so the GPU never idles
        # between two forwards. On by default where the engine was built for it (TP=1,
        # 0.11.2+); VLLM_COMPAT_EXTRACT_LAUNCH_AHEAD=0/1 (or launch_ahead=) decides.
        if launch_ahead is None:
            env = os.environ.get("VLLM_COMPAT_EXTRACT_LAUNCH_AHEAD")
            launch_ahead = self._pipelined_engine if env is None else env == "1"
        self.launch_ahead = bool(launch_ahead)
        self._emb0 = self.plan.mode == "aux" and 0 in self.layer_ids
        self._pending: dict[str, tuple[list[int], int]] = {}  # req -> (prompt, offset)

    @property
    def states_dtype(self) -> torch.dtype | None:
        """None: states in the model's dtype; ``torch.float8_e4m3fn``: FP8 with scales,
        encoded in the worker, on the GPU, before the copy to the host. Settable between
        extractions."""
        return fp8.FP8_DTYPE if self._encode == "fp8" else None

    @states_dtype.setter
    def states_dtype(self, dtype: torch.dtype | None) -> None:
        if dtype is not None and not fp8.is_fp8(dtype):
            raise ValueError(f"states_dtype must be None (the model's dtype) or "
                             f"torch.float8_e4m3fn, got {dtype}")
        pipe = getattr(self, "_pipe", None)  # None while __init__ runs, and for native
        if pipe is not None and (pipe.in_flight or self._tickets):
            raise RuntimeError("states_dtype changed while an extraction was running")
        self._encode = "fp8" if dtype is not None else None

    @property
    def _steps(self) -> StepPipeline:
        if self._pipe is None:
            if self.llm is None:
                raise RuntimeError("the extraction engine is closed")
            raise RuntimeError("backend='native' runs through LLM.generate: it has no step loop")
        return self._pipe

    @property
    def launch_ahead(self) -> bool:
        return self._pipe is not None and self._pipe.depth > 1

    @launch_ahead.setter
    def launch_ahead(self, on: bool) -> None:
        self.info["launch_ahead"] = bool(on) and self._pipe is not None
        if self._pipe is None:
            return
        if self._pipe.in_flight or self._tickets:
            raise RuntimeError("launch_ahead changed while an extraction was running")
        self._pipe.depth = 2 if on else 1

    @property
    def num_steps(self) -> int:
        return self._pipe.num_steps if self._pipe is not None else 0

    @property
    def max_step_tokens(self) -> int:
        return self._pipe.max_step_tokens if self._pipe is not None else 0

    @property
    def phase_s(self) -> dict[str, float]:
        """Wall seconds per phase of step(), summed: where a slow extraction spends its time.
        ``execute``: execute_model and the sample_tokens call; ``collect``: queueing (or, with
        the blocking copy, making) the host copy; ``wait``: waiting for a step's output (the
        forward, when the GPU is the bottleneck); ``handoff``: the pageable copy."""
        ph = self._pipe.phase_s if self._pipe is not None else {}
        return {"schedule": ph.get("schedule", 0.0),
                "execute": ph.get("launch", 0.0) - self._collect_s,
                "collect": self._collect_s, "wait": ph.get("wait", 0.0),
                "update": ph.get("update", 0.0), "handoff": self._handoff_s}

    # ---- aux / hooks: we drive the engine core

    def add(self, req_id: str, token_ids: Sequence[int]) -> None:
        req = make_request(req_id, token_ids, sampling_params=self._sp,
                           block_hasher=self._block_hasher)
        self.core.scheduler.add_request(req)
        if self._emb0:
            self._pending[req_id] = (list(token_ids), 0)

    def abort(self, req_ids: Iterable[str]) -> None:
        for fs in self._steps.drain():  # steps in flight: finish them, drop their states
            if isinstance(fs.value, StagedCopy):
                fs.value.discard()
        self.core.scheduler.finish_requests(list(req_ids), sym("RequestStatus.FINISHED_ABORTED"))
        while self._tickets:  # their states belong to the aborted extraction
            self._tickets.popleft().discard()

    def cancel(self, req_ids: Iterable[str]) -> None:
        """Finish these requests now (aborted), freeing their KV blocks, without touching the
        other requests or the steps in flight: a step launched before the cancel still
        returns the cancelled requests' chunks, which the caller drops. The scheduler skips a
        finished request when that step's output comes back (``update_from_output``, as vLLM's
        engine core does for an abort that arrives while a step runs)."""
        ids = list(req_ids)
        self.core.scheduler.finish_requests(ids, sym("RequestStatus.FINISHED_ABORTED"))
        for r in ids:  # steps already launched took their ids at launch (_collect)
            self._pending.pop(r, None)

    def has_unfinished(self) -> bool:
        """Requests in the scheduler, steps in flight, or states not handed out yet."""
        return self._has_work() or bool(self._tickets)

    def _has_work(self) -> bool:
        return bool(self._steps.in_flight) or bool(self.core.scheduler.has_unfinished_requests())

    def kv_blocks(self) -> tuple[int, int]:
        """``(free, total)`` KV-cache blocks of the scheduler's pool (same attributes
        0.10.2-0.34.0). The null block is never free, so an idle pool shows total - 1."""
        pool = self.core.scheduler.kv_cache_manager.block_pool
        return int(pool.get_num_free_blocks()), int(pool.num_gpu_blocks)

    def step(self) -> dict[str, torch.Tensor]:
        """One engine step; returns the chunks that are ready, per request.

        Blocking copy: the finished step's own chunks. ``overlap_copy``: pipelined, the
        finished step's (their copy ran during the next forward); lockstep, the previous
        step's, so the last call may schedule nothing. At most one step's chunks per call.
        """
        pipe, sched = self._steps, self.core.scheduler
        if self._has_work():
            pipe.fill()
            fs = pipe.finish()
            # an empty step carries finished-request ids; a run of them means nothing fits
            self._empty_steps = 0 if fs.scheduler_output.total_num_scheduled_tokens else \
                self._empty_steps + 1
            if self._empty_steps > pipe.depth and sched.has_unfinished_requests():
                raise RuntimeError("the scheduler scheduled nothing while requests are pending "
                                   "(KV cache too small for one prompt?)")
            if isinstance(fs.value, StagedCopy):
                self._tickets.append(fs.value)
            elif fs.value:
                if self._tickets:  # overlap_copy was switched off in the middle of a run
                    raise RuntimeError("overlap_copy changed while an extraction was running; "
                                       "change it only between extract() calls")
                return fs.value
        # lockstep + overlap: keep the newest step's states back one step, so that their copy
        # runs during the next forward; pipelined: the next forward is already running
        lag = 1 if pipe.depth == 1 and self._has_work() else 0
        if len(self._tickets) <= lag:
            return {}
        t0 = time.perf_counter()
        ready = self._tickets.popleft().finish()
        self._handoff_s += time.perf_counter() - t0
        return ready

    def _collect(self, so: Any) -> dict[str, torch.Tensor] | StagedCopy | None:
        """StepPipeline's ``between``: after execute_model, before sample_tokens."""
        t0 = time.perf_counter()
        chunk_ids = None
        if self._emb0:
            chunk_ids = {}
            for rid, n in so.num_scheduled_tokens.items():
                ids, off = self._pending[rid]
                chunk_ids[rid] = ids[off: off + n]
                if off + n >= len(ids):
                    del self._pending[rid]
                else:
                    self._pending[rid] = (ids, off + n)
        chunks = collective_rpc(self.executor, capture_worker.collect, args=(
            dict(so.num_scheduled_tokens), self.plan.mode, self.layer_ids, chunk_ids,
            self._in_process_worker, self.overlap_copy, self._encode), rank=0)
        self._collect_s += time.perf_counter() - t0
        return chunks

    # ---- native: vLLM's own extract_hidden_states + connector

    def run_native(self, batch: Sequence[tuple[str, Sequence[int]]]) -> list[Any]:
        tokens_prompt = sym("TokensPrompt")
        prompts = [tokens_prompt(prompt_token_ids=list(ids)) for _, ids in batch]
        outs = self.llm.generate(prompts, self._sp, use_tqdm=False)
        order = self.plan.native_ids
        pos = [order.index(k) for k in self.layer_ids]
        res = []
        for o, (_, ids) in zip(outs, batch):
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError("no hidden_states_path in kv_transfer_params")
            self._wait_saved(path)
            from safetensors.torch import load_file
            data = load_file(path, device="cpu")
            hs = data["hidden_states"][: len(ids)][:, pos]
            # vLLM's connector writes the model's dtype: FP8 is encoded here, on the CPU
            res.append(fp8.encode(hs) if self._encode == "fp8" else hs.clone())
            for p in (path, path + ".lock"):
                with contextlib.suppress(OSError):
                    os.remove(p)
        return res

    def _wait_saved(self, path: str, timeout: float = 120.0) -> None:
        wait_hidden_states_saved([path], self.llm, timeout)

    # ---- helpers for tests / callers

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float | None]]:
        """vLLM's own prompt logprobs of the actual prompt tokens (``llm.generate``)."""
        tokens_prompt = sym("TokensPrompt")
        sp = sym("SamplingParams")(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([tokens_prompt(prompt_token_ids=list(p)) for p in prompts], sp,
                                 use_tqdm=False)
        res = []
        for o, p in zip(outs, prompts):
            row: list[float | None] = []
            for t, d in zip(p, o.prompt_logprobs or ()):
                row.append(None if d is None else float(d[t].logprob))
            res.append(row)
        return res

    def close(self) -> None:
        """Shut the engine down and give back its GPU memory and environment: every reference
        to the engine is dropped here (the model is freed with the last one), the compiled
        modules' dynamo hooks and vLLM's CUDA-graph pool handle are released
        (:func:`~.llm.release_llm`), and the variables of :func:`engine_env` are restored.
        Another engine can then be built in this process."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        if self.plan.tap_final and self.executor is not None:
            with contextlib.suppress(Exception):  # the buffer is the tap's, the model's is freed below
                collective_rpc(self.executor, capture_worker.release_tap)
        try:
            release_llm(llm)
        finally:
            self.llm = None  # type: ignore[assignment]
            self.core = self.executor = None
            self._pipe = None  # holds the scheduler and the executor (its worker and model)
            for held in (getattr(self, "_tickets", None), getattr(self, "_pending", None)):
                if held is not None:
                    held.clear()
            self._block_hasher = None
            del llm  # the in-process engine's model is freed only with the last reference
            free_gpu_memory()
            _release_run_env(self._run_env)
            self._run_env = ()
            reset_envs_cache()
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
