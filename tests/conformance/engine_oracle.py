"""A real vLLM ``EngineCore`` on CPU, its model replaced by a stand-in executor: the oracle
for "same tokens, same block hashes, prefix-cache hits both ways".

``engine_path.py`` replays the calls EngineCore makes with the same vLLM functions the library
calls, so it cannot see a vLLM build whose *engine* hashes otherwise. Here the engine is
vLLM's own ``EngineCore.__init__`` (it builds its request hasher, its scheduler and its
KV-cache manager itself), requests enter through its front door (``EngineCoreRequest`` ->
``preprocess_add_request`` -> ``add_request``) and run through ``step()``. Only what has no
CPU implementation is stood in for: the executor, which reports one full-attention KV layer
and fabricates one sampled token per request per step (as the quick start does), and never
runs a model. Test-side code: it may import vLLM; it runs under the oracle rules (oracle.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from .oracle import oracle, oracle_fn

LAYER = "model.layers.0.self_attn.attn"
NUM_BLOCKS = 128  # max_model_len 1024 / block 16 = 64 blocks must fit, with room


class StandInExecutor:
    """What EngineCore asks of its executor, without a model (0.10.2 through 0.33.0)."""

    max_concurrent_batches = 1
    supported_tasks = ("generate",)
    is_sleeping = False

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.pending: Any = None
        # request id -> prompt tokens the scheduler served from the prefix cache (what it
        # hands the model as already computed when the request is first scheduled)
        self.cached: dict[str, int] = {}

    # --- KV-cache set-up (EngineCore._initialize_kv_caches)
    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        import inspect

        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        kw = dict(block_size=self.vllm_config.cache_config.block_size, num_kv_heads=1,
                  head_size=64, dtype=torch.float32)
        if "use_mla" in inspect.signature(FullAttentionSpec).parameters:  # 0.10.2 requires it
            kw["use_mla"] = False
        return [{LAYER: FullAttentionSpec(**kw)}]

    def determine_available_memory(self) -> list[int]:
        spec = self.get_kv_cache_specs()[0][LAYER]
        return [spec.page_size_bytes * NUM_BLOCKS]

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        pass

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:  # 0.33.0: one list per worker
        return [["NHD"]]  # vLLM's legacy name of its default layout, accepted as an alias

    def set_kv_cache_layout(self, *args: Any, **kwargs: Any) -> None:  # 0.33.0
        pass

    def compile_or_warm_up_model(self) -> None:  # 0.33.0
        pass

    def get_simple_cpu_offload_num_blocks(self) -> int:  # 0.33.0
        return 0

    def collective_rpc(self, method: Any, timeout: Any = None, args: tuple = (),
                       kwargs: Any = None, **_: Any) -> list[Any]:
        return [None]  # initialize_cache, update_max_model_len: nothing to set up

    def register_failure_callback(self, callback: Any) -> None:
        pass

    def init_kv_output_aggregator(self, *args: Any) -> None:
        pass

    def init_ec_output_aggregator(self, *args: Any) -> None:
        pass

    def get_kv_connector_handshake_metadata(self) -> list[Any]:
        return []

    # --- the step: one fabricated token for every request that finished its prefill
    def _output(self, scheduler_output: Any) -> Any:
        import vllm_compat as vc

        for new in scheduler_output.scheduled_new_reqs:
            self.cached[new.req_id] = new.num_computed_tokens
        ids = list(scheduler_output.num_scheduled_tokens)
        return vc.make_model_runner_output(ids, [[7] for _ in ids])

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        # 0.10.2: single-phase, the output comes back here; 0.11+: two-phase, None then
        # sample_tokens (non_block: a Future)
        out = self._output(scheduler_output)
        if not hasattr(self, "sample_tokens_phase"):
            result: Any = out
        else:
            self.pending, result = out, None
        if non_block:
            f: Future = Future()
            f.set_result(result)
            return f
        return result

    def take_draft_token_ids(self) -> None:
        return None

    def shutdown(self) -> None:
        pass


class TwoPhaseStandInExecutor(StandInExecutor):
    sample_tokens_phase = True

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        out, self.pending = self.pending, None
        if non_block:
            f: Future = Future()
            f.set_result(out)
            return f
        return out


@oracle_fn("vLLM's EngineCore with a stand-in executor (engine_oracle.engine_core)")
def engine_core(vllm_config: Any) -> Any:
    """vLLM's real EngineCore for ``vllm_config`` (prefix caching on), its model stood in for."""
    import inspect

    from vllm.v1.engine.core import EngineCore

    two_phase = "sample_tokens" in inspect.getsource(EngineCore.step)  # 0.11+
    executor = TwoPhaseStandInExecutor if two_phase else StandInExecutor
    sc = vllm_config.scheduler_config
    cls = getattr(sc, "scheduler_cls", None)
    if isinstance(cls, str) and not cls.startswith("vllm.v1."):
        # 0.10.2's SchedulerConfig defaults to the V0 scheduler's path; its EngineArgs
        # points a V1 engine at the V1 scheduler, as here
        sc.scheduler_cls = "vllm.v1.core.sched.scheduler.Scheduler"
    return EngineCore(vllm_config, executor, log_stats=False)


@oracle_fn("vLLM's EngineCoreRequest (engine_oracle.engine_core_request)")
def engine_core_request(request_id: str, tokens: list[int], cache_salt: str | None = None,
                        max_tokens: int = 1) -> Any:
    """What the engine's front end sends its core for a token prompt."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    values = dict(
        request_id=request_id, prompt_token_ids=list(tokens), mm_features=None,
        sampling_params=SamplingParams(max_tokens=max_tokens), pooling_params=None,
        eos_token_id=None, arrival_time=time.time(), lora_request=None, cache_salt=cache_salt,
        data_parallel_rank=None,
    )
    fields = EngineCoreRequest.__struct_fields__
    return EngineCoreRequest(**{k: v for k, v in values.items() if k in fields})


def add_through_front_door(core: Any, ecr: Any) -> Any:
    """The engine's own admission: ``preprocess_add_request`` (its hasher) -> ``add_request``."""
    with oracle("EngineCore.preprocess_add_request / add_request (engine_oracle)"):
        req, wave = core.preprocess_add_request(ecr)
        core.add_request(req, wave)
    return req


def add_built_request(core: Any, request: Any) -> Any:
    """A Request built elsewhere (by vllm_compat), added the way the engine adds its own."""
    with oracle("EngineCore.add_request (engine_oracle)"):
        core.add_request(request, 0)
    return request


def run_to_completion(core: Any, max_steps: int = 20) -> int:
    """``EngineCore.step()`` until nothing is left; the number of steps."""
    with oracle("EngineCore.step (engine_oracle)"):
        steps = 0
        while core.scheduler.has_requests() and steps < max_steps:
            core.step()
            steps += 1
        return steps


def cached_tokens(core: Any, request_id: str) -> int:
    """The prompt tokens the engine served from its prefix cache for ``request_id`` (what its
    scheduler handed the executor as already computed)."""
    return core.model_executor.cached[request_id]


# ----------------------------------------------------------------------------- the scenario
#
# Run in a child process (``python -m tests.conformance.engine_oracle ALGO``): an EngineCore
# re-seeds vLLM's process-wide NONE_HASH, freezes the GC heap (0.16+) and caches vLLM's
# environment (0.16+), none of which may leak into the other tests.

KIMI_VOCAB = 163840
BLOCK = 16


def chat_tokens(case: int) -> list[int]:
    """A chat prompt in Kimi-K2.5's ids (special 163584-163601, reserved up to 163839),
    distinct per ``case`` from its first block on: 5 full blocks and 7 tokens."""
    x, text = 1000 + case, []
    for _ in range(72):
        x = (x * 1103515245 + 12345) % 2**31
        text.append(x % 163584)
    bos, im_system, im_user, im_assistant, im_middle, im_end = (
        163584, 163594, 163587, 163588, 163601, 163586)
    return ([bos, im_system, case, im_middle] + text[:20] + [im_end, im_user] + text[20:50]
            + [163777, 163839, im_end, im_assistant] + text[50:] + [im_end])


def _hex(hashes: Any) -> list[str]:
    return [bytes(h).hex() for h in hashes]


def scenario(algo: str) -> dict[str, Any]:
    """Requests admitted by the engine and requests built by vllm_compat, same tokens: their
    block hashes and the prefix-cache hits each gets after the other, both orders."""
    import tempfile

    import vllm_compat as vc
    from vllm_compat.testing.models import write_tiny_llama_config

    d = tempfile.mkdtemp(prefix="engine-oracle-")
    config = vc.make_vllm_config(write_tiny_llama_config(d, vocab_size=KIMI_VOCAB),
                                 block_size=BLOCK, enable_prefix_caching=True, hash_algo=algo)
    core = engine_core(config)
    out: dict[str, Any] = {"algo": algo, "cases": []}
    case = 0
    for salt, other_salt in ((None, None), ("tenant-a", "tenant-a"), ("tenant-a", "tenant-b")):
        for first in ("engine", "vllm_compat"):
            case += 1
            tokens = chat_tokens(case)
            row: dict[str, Any] = {"first": first, "salt": salt, "other_salt": other_salt}
            for side in (first, "vllm_compat" if first == "engine" else "engine"):
                rid = f"{side}-{case}"
                s = salt if side == first else other_salt
                if side == "engine":
                    req = add_through_front_door(core, engine_core_request(rid, tokens, s))
                else:
                    req = add_built_request(core, vc.make_request(
                        rid, tokens, block_size=BLOCK, hash_algo=algo, cache_salt=s))
                run_to_completion(core)
                row[side] = {"hashes": _hex(req.block_hashes)[:5],
                             "cached": cached_tokens(core, rid)}
            out["cases"].append(row)
    try:
        h = vc.block_hasher_for(core)
        out["for_core"] = {"source": h.source,
                           "is_engine_hasher": h._fn is core.request_block_hasher}
        # the way out on a build whose engine hashes otherwise: requests built with it
        tokens = chat_tokens(50)
        add_through_front_door(core, engine_core_request("engine-50", tokens))
        run_to_completion(core)
        add_built_request(core, vc.make_request("vllm_compat-50", tokens, block_hasher=h))
        run_to_completion(core)
        out["for_core"]["cached"] = cached_tokens(core, "vllm_compat-50")
        hs = vc.block_hasher_for(core.scheduler)
        probe = vc.make_request("probe", chat_tokens(99), block_hasher=None)
        eng = add_through_front_door(core, engine_core_request("probe-engine", chat_tokens(99)))
        out["for_scheduler"] = {"source": hs.source,
                                "equal": _hex(hs(probe)) == _hex(eng.block_hashes)}
    except Exception as exc:  # noqa: BLE001 - the library's answer is the result
        out["block_hasher_for_error"] = {"type": type(exc).__name__, "message": str(exc),
                                         "differs": getattr(exc, "differs", None)}
    return out


def main() -> None:
    import json
    import os
    import sys

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from .drift_inject import apply_from_env

    apply_from_env()  # the parent test run's simulated drift, if any
    print("RESULT " + json.dumps(scenario(sys.argv[1])))


if __name__ == "__main__":
    from .oracle import child_main

    child_main(main)
