"""vLLM's own engine-core hashing path, replayed step by step with vLLM's functions.

EngineCore cannot be built on CPU (it needs an executor), so the reference is the same
sequence of vLLM calls it makes (v1/engine/core.py, EngineCore.__init__ and
preprocess_add_request): get_hash_fn_by_name -> init_none_hash -> get_request_block_hasher
-> Request.from_engine_core_request. Test-side code: it may import vllm. It is the tests'
oracle: on a drifted build its own failure is reported as "oracle needs updating" (oracle.py).
"""

from __future__ import annotations

import importlib
import time

from .oracle import oracle_fn


@oracle_fn("vLLM's get_hash_fn_by_name (engine_path.hash_fn)")
def _get_hash_fn_by_name():
    try:  # 0.11 moved the hash helpers to vllm.utils.hashing
        mod = importlib.import_module("vllm.utils.hashing")
    except ModuleNotFoundError:
        mod = importlib.import_module("vllm.utils")
    return mod.get_hash_fn_by_name


def hash_fn(algo: str):
    # only finding the function is the oracle's: what it does with a name is under test
    return _get_hash_fn_by_name()(algo)


@oracle_fn("vLLM's engine-core hashing path (engine_path.engine_request)")
def engine_request(algo: str, block_size: int, tokens: list[int], *, init: bool = True,
                   request_id: str = "engine"):
    from vllm import SamplingParams
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    fn = hash_fn(algo)
    if init:
        kcu.init_none_hash(fn)
    hasher = kcu.get_request_block_hasher(block_size, fn)
    values = dict(
        request_id=request_id, prompt_token_ids=list(tokens), mm_features=None,
        sampling_params=SamplingParams(max_tokens=1), pooling_params=None, eos_token_id=None,
        arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
    )
    fields = EngineCoreRequest.__struct_fields__
    ecr = EngineCoreRequest(**{k: v for k, v in values.items() if k in fields})
    return Request.from_engine_core_request(ecr, hasher)
