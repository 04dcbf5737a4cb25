"""GPU memory a closed, compiled vLLM engine leaves in its process, with vLLM and torch alone
(no vllm_compat): does opening and closing ``vllm.LLM`` grow what the process holds?

    python -m bench.compiled_engine_memory --model CKPT --cycles 4 --out OUT.json
    python -m bench.compiled_engine_memory --model CKPT --cycles 4 --dynamo-reset --out OUT.json

Each cycle builds an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
torch.compile and CUDA graphs, runs one prompt, and closes it the way vLLM's own examples and
tests do (``del llm``, ``gc.collect()``, ``cleanup_dist_env_and_memory()``); then records
``torch.cuda.memory_reserved()``. ``--dynamo-reset`` also calls ``torch._dynamo.reset()``
after each close: if that stops the growth, what is kept is dynamo's code cache.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

MIB = 1 << 20


def cycle(model: str, kv_bytes: int) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=False,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=kv_bytes, max_model_len=512,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                 SamplingParams(max_tokens=2, temperature=0.0, detokenize=False), use_tqdm=False)
    del llm


def close() -> None:
    import torch
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--dynamo-reset", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine's memory in this process
    import torch
    import vllm

    held, error, t0 = [], None, time.perf_counter()
    for i in range(a.cycles):
        try:
            cycle(a.model, a.kv_cache_bytes)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot start again is a result
            error = f"cycle {i + 1}: {type(exc).__name__}: {exc}"[:2000]
            break
        close()
        if a.dynamo_reset:
            torch._dynamo.reset()
            close()
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_reserved())
    per_cycle = (held[-1] - held[1]) / max(1, len(held) - 2) / MIB if len(held) > 2 else None
    res = {"vllm": vllm.__version__, "torch": torch.__version__, "model": a.model,
           "dynamo_reset": a.dynamo_reset, "kv_cache_mib": a.kv_cache_bytes / MIB,
           "reserved_after_close_mib": [round(h / MIB, 1) for h in held],
           "growth_per_cycle_mib": per_cycle,
           "error": error, "wall_s": round(time.perf_counter() - t0, 1)}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
