"""Two-phase model step and collective_rpc reply shapes, through vLLM's real classes.

On CPU no model can run, so the *worker* is a stand-in that returns fabricated outputs
with the real contract of its release (0.10: ``execute_model`` returns the final output;
0.11+: it returns None, keeps state, and ``sample_tokens`` returns the output, possibly as
an ``AsyncModelRunnerOutput``). Everything around it is vLLM's own: the UniProcExecutor
whose ``collective_rpc`` / ``execute_model`` / ``sample_tokens`` we call, the Scheduler,
``ModelRunnerOutput``, and the real V1 ``GPUModelRunner``'s state guard.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
from packaging.version import Version

import vllm_compat as vc

from . import reference
from .driver import BLOCK, FAKE_TOKEN, SecondPhaseByAlias, make_async, real_executor, sp, tokens
from .oracle import oracle


class StandInWorker(SecondPhaseByAlias):
    """Fabricates the model's output with the step contract of the installed release."""

    def __init__(self, scheduler, two_phase: bool, async_output: bool = False):
        self.scheduler = scheduler
        self.two_phase = two_phase
        self.async_output = async_output
        self.pending = None
        self.calls: list[str] = []

    def _output(self, so):
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.scheduler.requests[rid]
            sampled.append([FAKE_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        out = vc.make_model_runner_output(ids, sampled)
        return make_async(out) if self.async_output else out

    def execute_model(self, so):
        self.calls.append("execute_model")
        if not self.two_phase:
            return self._output(so)
        if self.pending is not None:  # the V1 runner's guard, same message
            raise RuntimeError("State error: sample_tokens() must be called after execute_model() returns None.")
        self.pending = so
        return None

    def sample_tokens(self, grammar_output):
        self.calls.append("sample_tokens")
        so, self.pending = self.pending, None
        return self._output(so)

    def rank(self):
        return 0

    def shutdown(self):  # the executor's __del__ calls it
        pass

    def async_value(self):
        return make_async("resolved")


@pytest.fixture
def sched(model_dir):
    cfg = vc.make_vllm_config(model_dir, block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks=64)
    return vc.make_scheduler(cfg)


def two_phase(info) -> bool:
    return info.probes["two_phase_step"]


def add_requests(sched, n=3):
    for i in range(n):
        sched.add_request(vc.make_request(f"r{i}", tokens(20 + 9 * i, start=40 * i),
                                          sampling_params=sp(3), block_hasher=vc.block_hasher_for(sched)))


@pytest.mark.parametrize("async_output", [False, True], ids=["sync", "async-output"])
def test_run_model_step_drives_real_executor_to_completion(sched, info, async_output):
    worker = StandInWorker(sched, two_phase(info), async_output)
    executor = real_executor(worker)
    add_requests(sched)
    finished, steps = set(), 0
    while sched.has_unfinished_requests():
        so = vc.schedule(sched)
        out = vc.run_model_step(executor, so, scheduler=sched)
        for eco in vc.update_from_output(sched, so, out).values():
            finished |= {o.request_id for o in eco.outputs if o.finish_reason is not None}
        steps += 1
        assert steps < 50
    assert finished == {"r0", "r1", "r2"}
    expected = ["execute_model", "sample_tokens"] if two_phase(info) else ["execute_model"]
    assert worker.calls == expected * steps


def test_naive_single_call_breaks_on_two_phase_releases(sched, info):
    """What fork code written for 0.10 does: execute_model, then update_from_output."""
    worker = StandInWorker(sched, two_phase(info))
    executor = real_executor(worker)
    add_requests(sched, 1)
    so = vc.schedule(sched)
    out = executor.execute_model(so)
    if not two_phase(info):
        sched.update_from_output(so, out)  # 0.10: fine
        return
    assert out is None  # 0.11+: the output only comes from sample_tokens
    with pytest.raises(Exception):  # vLLM's own error, whichever it is
        sched.update_from_output(so, out)
    with pytest.raises(RuntimeError, match="State error"):
        executor.execute_model(vc.schedule(sched))


def _v1_runner_removed(info) -> bool:
    # vLLM 0.34 deleted the V1 runner module: Model Runner V2 is the only GPU runner
    return (info.probes["model_runner_v2_available"]
            and importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None)


def test_real_v1_runner_has_the_state_guard(info):
    if _v1_runner_removed(info):
        pytest.skip("this release has no V1 model runner (removed in 0.34)")
    GPUModelRunner = reference.v1_runner_class()

    if not two_phase(info):
        assert not hasattr(GPUModelRunner, "sample_tokens")
        return
    with oracle("the V1 runner's sample_tokens"):
        assert list(inspect.signature(GPUModelRunner.sample_tokens).parameters) == ["self", "grammar_output"]
    runner = object.__new__(GPUModelRunner)  # no GPU: only the guard at the top runs
    runner.execute_model_state = object()
    with pytest.raises(Exception) as guard:
        runner.execute_model(None)
    with oracle("the V1 runner's state guard message"):
        assert "sample_tokens" in str(guard.value)


def test_worker_and_executor_signatures(info):
    Executor, Worker = reference.executor_and_worker_classes()

    with oracle("vLLM's Worker and Executor step methods"):  # what vLLM names them
        assert "scheduler_output" in inspect.signature(Worker.execute_model).parameters
        assert hasattr(Worker, "sample_tokens") == two_phase(info)
        assert hasattr(Executor, "sample_tokens") == two_phase(info)


def test_v2_runner_contract_where_present(info):
    if not info.probes["model_runner_v2_available"]:
        pytest.skip("this release has no Model Runner V2 (added in 0.12)")
    try:
        V2Runner = reference.v2_runner_class()
    except Exception as exc:  # noqa: BLE001 - its CUDA-only imports may fail on CPU
        pytest.skip(f"Model Runner V2 does not import on CPU here: {type(exc).__name__}: {exc}")
    with oracle("Model Runner V2's sample_tokens"):
        assert "grammar_output" in inspect.signature(V2Runner.sample_tokens).parameters

    def worker_with(runner_cls):  # a Worker's shape: .model_runner holds the real class
        return type("W", (), {"model_runner": object.__new__(runner_cls)})()

    assert vc.runner_flavour(worker_with(V2Runner)) == "v2"
    if not _v1_runner_removed(info):
        assert vc.runner_flavour(worker_with(reference.v1_runner_class())) == "v1"


def test_collective_rpc_one_shape_on_every_release(sched, info, vllm_version):
    executor = real_executor(StandInWorker(sched, two_phase(info)))
    assert vc.collective_rpc(executor, "rank") == [0]
    assert vc.collective_rpc(executor, "rank", rank=0) == 0
    assert vc.collective_rpc(executor, lambda w, x: x * 2, args=(21,), rank=0) == 42
    # Async outputs are resolved whatever the release's UniProc sync path does.
    assert vc.collective_rpc(executor, "async_value") == ["resolved"]
    raw = executor.collective_rpc("async_value")
    resolves = vllm_version >= Version("0.24.0")  # UniProc sync path resolves from 0.24
    assert isinstance(raw[0], reference.async_model_runner_output_class()) != resolves
    with pytest.raises(vc.VllmCompatError, match="rank 3 out of range"):
        vc.collective_rpc(executor, "rank", rank=3)
