"""GPU benchmark: prefill hidden-state extraction vs plain vLLM, HF transformers and vLLM's own.

    python -m bench.gpu_extraction --model llama-1b --out OUT
    python -m bench.gpu_extraction --model llama-8b --out OUT --modes a,e
    python -m bench.gpu_extraction --model llama-8b --out OUT --modes b,c,d --merge

One process per model; the modes run one after another, each with its own engine (``b`` and
``c`` share one), freed before the next starts:

  a  vLLM ``LLM.generate(max_tokens=1)`` on token-id prompts: the prefill ceiling.
  b  ``vllm_compat.extract.HiddenStatesExtractor`` (EAGLE-3 default layers + final), results
     kept in host memory.
  c  the same written to disk with ``BackgroundShardWriter`` + ``ShardWriter`` (every file
     fsync'ed), timed until every file is durable, in bf16 and in FP8 (e4m3 + a float32
     scale per token and layer, encoded on the GPU by the extractor); interleaved with each
     run, a plain sequential write + fsync of the same number of bytes in the same folder
     (``disk_*``). What binds is min(b, disk): the summary's ``c_limits`` holds
     ``c / min(b, disk)`` per dtype and workload, best runs and run by run.
  d  HF transformers forward (sdpa, batched by length, ``output_hidden_states``, states
     copied to host).
  e  vLLM's ``extract_hidden_states`` + ``ExampleHiddenStatesConnector``: until
     ``generate()`` returns, until every file is written (lock released) and until fsync'ed.
  a_sync (only when named) (a) with an in-process engine core and ``async_scheduling=False``
     (what the extractor's engine does at TP > 1): engine settings apart from extractor cost.
  b_sync (only when named) (b) on b's engine with ``overlap_copy`` off (a blocking copy of
     each step's states): what the overlapped copy gains, side by side.
  b_lockstep (only when named) (b) on b's engine with ``launch_ahead`` off: each step is
     scheduled only once the previous step's sampled tokens are in.
  c_cpu (only when named) (c) in FP8 with the states copied in bf16 and encoded on the CPU
     by the writer's encoding thread: what encoding on the GPU gains.

Workloads (seeded): ``--num-prompts`` (128) prompts x 1024 random token ids, and
``--mixed-prompts`` (128) prompts of lengths uniform in 64..2048. Each is warmed up (first
``--warmup-prompts`` prompts, not timed) and timed
``--repeats`` times; tok/s = prompt tokens / wall seconds; ratios of the best runs and of
the medians, each series' spread, and a note on timed runs under 10 s (noise-bound).
Results: ``<out>/gpu_extraction-<model>.json`` (rewritten after every run, so a killed run
leaves what it had) and ``<out>/gpu_extraction-<model>.png`` (``python -m
bench.plot_gpu_extraction`` renders it again from the JSON where matplotlib is missing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import gpu_models

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "vllm-compat-gpu-extraction/1"
MODES = ("a", "b", "c", "d", "e")
EXTRA_MODES = ("a_sync", "b_sync", "b_lockstep", "c_cpu")  # diagnostics, only when asked for
# Engines in their own process first, in-process ones (CUDA in this process) last.
# (b) right after (a): b/a is the number this benchmark exists for, and a time budget should
# cut the others first. c and c_cpu follow b on the extractor's engine, which closes before
# e starts its own.
RUN_ORDER = ("a", "b", "b_lockstep", "b_sync", "c", "c_cpu", "e", "a_sync", "d")
DESCRIPTION = {
    "a": "vLLM generate(max_tokens=1), prefill ceiling",
    "a_sync": "(a) in-process with async_scheduling=False (the extractor's engine settings at TP > 1)",
    "b": "vllm_compat extraction into host memory",
    "b_sync": "(b) on the same engine with overlap_copy off: a blocking device->host copy per step",
    "b_lockstep": "(b) on the same engine with launch_ahead off: one step in flight at a time",
    "c": "vllm_compat extraction written to disk (ShardWriter, fsync), bf16 and FP8 (GPU-encoded)",
    "c_cpu": "(c) in FP8 encoded on the CPU by the writer's encoding thread",
    "d": "HF transformers forward, output_hidden_states, sdpa",
    "e": "vLLM extract_hidden_states + ExampleHiddenStatesConnector",
}
TARGETS = {"b/a": 0.95, "b/e": 1.4}
C_TARGET = 0.95  # to disk: c >= 0.95 x min(b, disk) per dtype
PEAK_TFLOPS = 790.0  # H200 bf16, measured (8192^3 matmul, random data)


# --------------------------------------------------------------------------- arguments


def parse_modes(text: str) -> list[str]:
    modes = list(MODES) if text.strip() in ("all", "") else [
        m.strip() for m in text.split(",") if m.strip()]
    known = MODES + EXTRA_MODES
    bad = [m for m in modes if m not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; choose from {','.join(known)}")
    return [m for m in known if m in modes]


def parse_disk_dtypes(text: str) -> tuple[str, ...]:
    got = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in got if d not in ("bf16", "fp8")]
    if bad or not got:
        raise argparse.ArgumentTypeError(f"--disk-dtypes: {text!r}; choose from bf16,fp8")
    return got


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(gpu_models.SPECS))
    ap.add_argument("--out", default="/tmp/vllm-compat-bench/results",
                    help="folder for the JSON and the chart")
    ap.add_argument("--modes", type=parse_modes, default=list(MODES),
                    help="e.g. a,b,c,d,e (default all); a_sync: (a) with the extractor's "
                         "engine settings, to split engine settings from extractor overhead")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="vLLM modes without torch.compile / CUDA graphs")
    ap.add_argument("--time-budget-s", type=float, default=540.0,
                    help="skip what would end past this many seconds after the checkpoint is "
                         "ready (0: none)")
    ap.add_argument("--checkpoint", help="use this checkpoint instead of building --model's")
    ap.add_argument("--ckpt-dir", help="where to build (default /tmp/vllm-compat-bench/<model>)")
    ap.add_argument("--scratch-dir",
                    help="where (c), its disk check and (e) write; emptied at start and end "
                         "(default /tmp/vllm-compat-bench/scratch-<model>)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs mode d only (tests)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--mixed-prompts", type=int, default=128)
    ap.add_argument("--mixed-min", type=int, default=64)
    ap.add_argument("--mixed-max", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-prompts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--kv-cache-memory-bytes", type=int,
                    help="a fixed KV cache for every engine (vLLM then skips its memory profiling, "
                         "which counts other processes on the GPU as its own)")
    ap.add_argument("--max-in-flight", type=int, default=128, help="HiddenStatesExtractor window")
    ap.add_argument("--keep-states", choices=("all", "first"), default="all",
                    help="(b) hold every sample's states in host memory, or only prompt 0's "
                         "(the others are counted and dropped as a streaming consumer would): "
                         "long runs of a wide target outgrow host memory otherwise")
    ap.add_argument("--hf-batch-tokens", type=int, default=16384, help="(d) padded tokens/batch")
    ap.add_argument("--samples-per-shard", type=int, default=16)
    # fp8 alone: long FP8 runs fit a time budget that bf16 runs beside them would overrun
    ap.add_argument("--disk-dtypes", type=parse_disk_dtypes, default=("bf16", "fp8"),
                    help="(c) writes these, comma-separated: bf16, fp8")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--drain-timeout-s", type=float, default=300.0)
    ap.add_argument("--merge", action="store_true",
                    help="keep the modes of an existing JSON of the same model/workload")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    if a.mixed_min < 1 or a.mixed_max < a.mixed_min:
        ap.error("--mixed-min/--mixed-max: need 1 <= min <= max")
    if max(a.prompt_len, a.mixed_max) >= a.max_model_len:
        ap.error("--max-model-len must exceed the longest prompt")
    return a


# --------------------------------------------------------------------------- arithmetic


def make_workloads(num_prompts: int, prompt_len: int, mixed_prompts: int, mixed_min: int,
                   mixed_max: int, vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """Seeded random token ids (>= 3, below ``vocab``): ``fixed`` and ``mixed`` lengths."""
    g = torch.Generator().manual_seed(seed)
    hi = max(4, vocab)
    fixed = torch.randint(3, hi, (num_prompts, prompt_len), generator=g).tolist()
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(mixed_min, mixed_max + 1, (mixed_prompts,), generator=g).tolist()
    mixed = [torch.randint(3, hi, (n,), generator=g).tolist() for n in lengths]
    return {"fixed": fixed, "mixed": mixed}


def bytes_per_token(n_layers: int, hidden: int) -> dict[str, float]:
    """Hidden-state bytes per token (what crosses to host / goes to disk), per dtype; FP8
    with its float32 scale per token and layer."""
    return {"bf16": float(n_layers * hidden * 2), "fp8": float(n_layers * (hidden + 4))}


def ceiling(params: dict[str, int], peak_tflops: float) -> dict[str, Any]:
    """Compute-bound prefill tok/s: 2 x params FLOPs per token at ``peak_tflops``."""
    used = params.get("active", params["total"])
    mm = params.get("active_matmul", used)
    return {
        "peak_tflops": peak_tflops, "params": used, "flops_per_token": 2 * used,
        "tok_s": peak_tflops * 1e12 / (2 * used),
        "matmul_params": mm, "tok_s_matmul_only": peak_tflops * 1e12 / (2 * mm) if mm else None,
        "note": "2 x params (routed experts at top_k/n_experts); the matmul-only variant drops "
                "the embeddings and the LM head (prefill applies it to the last token only); "
                "attention FLOPs are not counted",
    }


def _best(runs: Iterable[dict[str, Any]]) -> float | None:
    vals = [r["tok_s"] for r in runs if isinstance(r, dict) and r.get("tok_s")]
    return max(vals) if vals else None


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


MIN_RUN_S = 10.0  # shorter timed runs are noise-bound (run-to-run swings of 10-20 % seen)


def _spread(runs: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """Median tok/s of the runs, the worst, the spread ``(max - min) / median``, and the
    shortest run in seconds."""
    ok = [r for r in runs if isinstance(r, dict) and r.get("tok_s")]
    if not ok:
        return None
    vals = sorted(r["tok_s"] for r in ok)
    med = statistics.median(vals)
    secs = [r["seconds"] for r in ok if r.get("seconds")]
    return {"median": med, "worst": vals[0], "spread": round((vals[-1] - vals[0]) / med, 4),
            "runs": len(vals), "shortest_s": min(secs) if secs else None}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Best tok/s per series and workload, the ratios, targets and which limit binds (c)."""
    tok: dict[str, dict[str, float | None]] = {}
    for mode in res.get("modes", {}).values():
        for name, per_wl in (mode.get("series") or {}).items():
            tok[name] = {wl: _best(runs) for wl, runs in per_wl.items()}
    wls = sorted({wl for v in tok.values() for wl in v})

    def t(name: str, wl: str) -> float | None:
        return (tok.get(name) or {}).get(wl)

    pairs = {"b/a": ("b", "a"), "c_bf16/a": ("c_bf16", "a"), "c_fp8/a": ("c_fp8", "a"),
             "b/d": ("b", "d"), "b/e": ("b", "e_drained"), "b/e_returned": ("b", "e_returned"),
             "e_returned/a": ("e_returned", "a"), "e_drained/a": ("e_drained", "a"),
             "d/a": ("d", "a"), "b/a_sync": ("b", "a_sync"), "a_sync/a": ("a_sync", "a"),
             "b_sync/a": ("b_sync", "a"), "b/b_sync": ("b", "b_sync"),
             "b_lockstep/a": ("b_lockstep", "a"), "b/b_lockstep": ("b", "b_lockstep")}
    ratios = {k: {wl: _ratio(t(x, wl), t(y, wl)) for wl in wls} for k, (x, y) in pairs.items()}
    targets = {f"{k} >= {v}": {wl: (None if ratios[k][wl] is None else ratios[k][wl] >= v)
                               for wl in wls} for k, v in TARGETS.items()}
    spread = {name: {wl: _spread(_runs(res, name, wl)) for wl in wls} for name in tok}

    def med(name: str, wl: str) -> float | None:
        return ((spread.get(name) or {}).get(wl) or {}).get("median")

    ratios_median = {k: {wl: _ratio(med(x, wl), med(y, wl)) for wl in wls}
                     for k, (x, y) in pairs.items()}
    short = sorted(f"{name}/{wl}" for name, per in spread.items() for wl, v in per.items()
                   if v and v["shortest_s"] is not None and v["shortest_s"] < MIN_RUN_S)
    ceil = (res.get("ceiling") or {}).get("tok_s")
    return {"tok_s_best": tok, "ratios": ratios, "targets": targets,
            "tok_s_spread": spread, "ratios_median": ratios_median,
            f"runs_under_{MIN_RUN_S:.0f}s": short,
            "c_limits": c_limits(res, wls, t),
            "a_over_ceiling": {wl: _ratio(t("a", wl), ceil) for wl in wls}}


# (c) series -> the plain write of the same bytes it is held against
C_SERIES = {"bf16": ("c_bf16", "disk_bf16"), "fp8": ("c_fp8", "disk_fp8"),
            "fp8_cpu": ("c_fp8_cpu", "disk_fp8")}


def _runs(res: dict[str, Any], name: str, wl: str) -> list[dict[str, Any]]:
    for mode in (res.get("modes") or {}).values():
        runs = ((mode.get("series") or {}).get(name) or {}).get(wl)
        if runs:
            return [r for r in runs if r.get("tok_s")]
    return []


def c_limits(res: dict[str, Any], wls: Sequence[str],
             t: Callable[[str, str], float | None]) -> dict[str, Any]:
    """Per dtype and workload: what binds the disk path, in-memory extraction (b) or the
    disk (a plain write + fsync of the same bytes: tok/s = its bytes/s / bytes per token),
    and ``c / min(b, disk)``: of the best runs, and run by run (run r of c against run r of
    the plain write, which ran right after it, and the best b)."""
    limits: dict[str, Any] = {}
    for dt, (c_name, disk_name) in C_SERIES.items():
        for wl in wls:
            got, mem, disk = t(c_name, wl), t("b", wl), t(disk_name, wl)
            if not got:
                continue
            cands = {k: v for k, v in (("in_memory", mem), ("disk", disk)) if v}
            bind = min(cands, key=cands.get) if cands else None
            disk_runs = {r["run"]: r["tok_s"] for r in _runs(res, disk_name, wl)}
            per_run = [_ratio(r["tok_s"], min(mem, disk_runs[r["run"]])) if mem and
                       r["run"] in disk_runs else None for r in _runs(res, c_name, wl)]
            best = _ratio(got, cands.get(bind)) if bind else None
            limits.setdefault(dt, {})[wl] = {
                "in_memory_tok_s": mem, "disk_tok_s": disk, "binding": bind, "c_tok_s": got,
                "c_over_binding": best, "c_over_binding_runs": per_run,
                f"meets_{C_TARGET}": None if best is None else best >= C_TARGET}
    return limits


# --------------------------------------------------------------------------- disk


def plain_write_bytes(wrote: dict[tuple[str, int], int], tag: str, prompts: Sequence[Sequence[int]],
                      bpt: float) -> int:
    """What the plain write beside a (c) run writes: the bytes that run wrote (``wrote``,
    keyed by dtype and token count); before any (c) run of these prompts (the warm-up), an
    estimate: the states plus int64 ids and a bool mask per token, ~4 KiB of headers per
    sample."""
    tokens = sum(map(len, prompts))
    return wrote.get((tag, tokens)) or int(tokens * (bpt + 9) + len(prompts) * 4096)


def _fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_BUF: bytes | None = None


def disk_write(path: str | os.PathLike[str], nbytes: int, chunk: int = 64 << 20) -> float:
    """Seconds for one sequential write of ``nbytes`` (incompressible) + fsync; file removed."""
    global _BUF
    if _BUF is None or len(_BUF) < chunk:
        _BUF = os.urandom(chunk)
    view = memoryview(_BUF)[:chunk]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, view[: min(chunk, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_path(os.path.dirname(os.path.abspath(path)))
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


# --------------------------------------------------------------------------- engines


def _free_gpu_gib() -> float | None:
    """Free GPU memory by nvidia-smi (does not initialise CUDA in this process)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout.split("\n")[0]
        used, total = (float(x) for x in out.split(","))
        return round((total - used) / 1024, 1)
    except Exception:  # noqa: BLE001
        return None


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip().split("\n")[0]
        return out or None
    except Exception:  # noqa: BLE001
        return None


def engine_info(llm: Any) -> dict[str, Any]:
    info: dict[str, Any] = {}
    vc = getattr(llm.llm_engine, "vllm_config", None)
    for key, get in {
        "max_num_batched_tokens": lambda: vc.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": lambda: vc.scheduler_config.max_num_seqs,
        "async_scheduling": lambda: vc.scheduler_config.async_scheduling,
        "enforce_eager": lambda: vc.model_config.enforce_eager,
        "compilation_mode": lambda: str(vc.compilation_config.mode),
        "cudagraph_mode": lambda: str(vc.compilation_config.cudagraph_mode),
        "num_gpu_blocks": lambda: vc.cache_config.num_gpu_blocks,
        "in_process_engine_core": lambda: hasattr(llm.llm_engine.engine_core, "engine_core"),
    }.items():
        with contextlib.suppress(Exception):
            info[key] = get()
    return info


def make_llm(ckpt: str, args: argparse.Namespace, **extra: Any) -> tuple[Any, float]:
    """A plain ``vllm.LLM`` as a user builds one (no tokenizer: random checkpoints)."""
    from vllm import LLM

    from vllm_compat.runtime.extraction import reset_envs_cache
    reset_envs_cache()  # a previous engine froze vLLM's environment reads
    from vllm_compat.target import read_target

    kw = dict(model=ckpt, skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
              dtype="bfloat16", max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    if read_target(ckpt).is_multimodal_wrapper:  # Kimi-K2.5: text only, as the extractor runs it
        kw["language_model_only"] = True
    if args.kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    kw.update(extra)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, time.perf_counter() - t0


def shutdown_llm(llm: Any) -> None:
    from vllm_compat.runtime.llm import close_llm
    close_llm(llm)


def free_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from vllm_compat.runtime.llm import free_gpu_memory
        free_gpu_memory()


def _sampling() -> Any:
    from vllm import SamplingParams
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


def _token_prompts(prompts: Sequence[Sequence[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt
    return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]


# --------------------------------------------------------------------------- HF (d)


class HFForward:
    """HF transformers prefill, batched by length (right padding), states copied to host."""

    def __init__(self, ckpt: str, layer_ids: Sequence[int], device: str, batch_tokens: int):
        from transformers import AutoModelForCausalLM
        kw: dict[str, Any] = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
        try:  # straight onto the GPU where transformers can (an 8B through host is slow)
            model = AutoModelForCausalLM.from_pretrained(
                ckpt, **kw, **({"device_map": device} if device != "cpu" else {}))
        except (ImportError, ValueError, TypeError):
            model = AutoModelForCausalLM.from_pretrained(ckpt, **kw)
        self.model = model.to(device).eval()
        self.device = device
        self.L = self.model.config.get_text_config().num_hidden_layers
        self.layer_ids = tuple(layer_ids)
        self.batch_tokens = batch_tokens
        self._final: list[torch.Tensor] = []
        # HF's hidden_states[L] is after the final norm: take the norm's input for id L.
        self._hook = self.model.model.norm.register_forward_pre_hook(
            lambda _m, a: self._final.append(a[0]))

    def batches(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[list[int]] = []
        cur: list[int] = []
        for i in order:  # ascending: the newest prompt is the longest of its batch
            if cur and (len(cur) + 1) * len(prompts[i]) > self.batch_tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
        return out

    @torch.inference_mode()
    def run(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        res: list[torch.Tensor | None] = [None] * len(prompts)
        for batch in self.batches(prompts):
            lens = [len(prompts[i]) for i in batch]
            T = max(lens)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            for j, i in enumerate(batch):
                ids[j, : lens[j]] = torch.tensor(prompts[i])
            mask = None
            if min(lens) < T:
                mask = (torch.arange(T)[None, :] < torch.tensor(lens)[:, None]).long()
                mask = mask.to(self.device)
            self._final.clear()
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask, use_cache=False,
                             output_hidden_states=True, logits_to_keep=1)
            hs = out.hidden_states
            states = torch.stack([hs[k] if k < self.L else self._final[-1]
                                  for k in self.layer_ids], dim=2).to("cpu")  # [B, T, n, H]
            for j, i in enumerate(batch):
                res[i] = states[j, : lens[j]]
        return res  # type: ignore[return-value]

    def close(self) -> None:
        self._hook.remove()
        del self.model
        free_memory()


# --------------------------------------------------------------------------- the run


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / f"gpu_extraction-{args.model}.json"
        self.scratch = Path(args.scratch_dir or f"/tmp/vllm-compat-bench/scratch-{args.model}")
        shutil.rmtree(self.scratch, ignore_errors=True)  # leftovers of a killed run
        self.refs: dict[str, torch.Tensor] = {}  # fixed-workload prompt 0, per mode
        self.res: dict[str, Any] = {}
        self.extractor: Any = None

    # ---- bookkeeping

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        b = self.args.time_budget_s
        return float("inf") if not b else b - self.elapsed()

    def save(self) -> None:
        self.res["elapsed_s"] = round(self.elapsed(), 1)
        self.res["summary"] = summarize(self.res)
        self.res["cross_check"] = self.cross_check()
        tmp = self.json_path.with_name(self.json_path.name + ".tmp")
        tmp.write_text(json.dumps(self.res, indent=1, default=str) + "\n")
        os.replace(tmp, self.json_path)

    def cross_check(self) -> dict[str, Any]:
        """Relative error per layer of prompt 0 (fixed workload) between modes."""
        out: dict[str, Any] = {}
        base = self.refs.get("b")
        for name, other in (("d_vs_b", "d"), ("e_vs_b", "e"), ("c_fp8_vs_b", "c_fp8"),
                            ("c_bf16_vs_b", "c_bf16"), ("c_fp8_cpu_vs_c_fp8", "c_fp8_cpu"),
                            ("d_vs_e", "d"), ("b_sync_vs_b", "b_sync"),
                            ("b_lockstep_vs_b", "b_lockstep")):
            x = self.refs.get(other)
            ref = {"d_vs_e": self.refs.get("e"),
                   "c_fp8_cpu_vs_c_fp8": self.refs.get("c_fp8")}.get(name, base)
            if x is None or ref is None or x.shape != ref.shape:
                continue
            xf, rf = x.float(), ref.float()
            out[name] = [round(float((xf[:, j] - rf[:, j]).norm() / rf[:, j].norm().clamp_min(
                1e-12)), 5) for j in range(xf.shape[1])]
        for name, x in self.refs.items():
            out.setdefault("finite", {})[name] = bool(torch.isfinite(x.float()).all())
        return out

    # ---- setup

    def setup(self) -> None:
        a = self.args
        ckpt = a.checkpoint
        build = None
        if ckpt is None:
            ckpt = a.ckpt_dir or f"/tmp/vllm-compat-bench/{a.model}"
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "bench.gpu_models", "--model", a.model, "--out", ckpt,
                 "--device", a.device], capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                raise RuntimeError(f"checkpoint build failed:\n{proc.stderr[-4000:]}")
            build = json.loads(proc.stdout.strip().splitlines()[-1])
            os.sync()  # the new checkpoint's dirty pages must not land inside a timed run
            build["wall_s"] = round(time.perf_counter() - t0, 1)
        self.ckpt = str(ckpt)
        from vllm_compat.extract.layers import (
            eagle3_default_layers,
            hidden_size_from_config,
            num_layers_from_config,
            read_model_config,
        )
        cfg = read_model_config(self.ckpt)
        self.cfg = cfg
        self.L = num_layers_from_config(cfg)
        self.H = hidden_size_from_config(cfg)
        self.layer_ids = eagle3_default_layers(self.L)
        vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
        self.workloads = make_workloads(a.num_prompts, a.prompt_len, a.mixed_prompts,
                                        a.mixed_min, a.mixed_max, vocab, a.seed)
        params = gpu_models.count_params(self.ckpt)
        new = {
            "schema": SCHEMA, "model": a.model, "checkpoint": self.ckpt, "build": build,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "env": self.env_info(),
            "config": {k: cfg.get(k) for k in (
                "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "kv_lora_rank",
                "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")},
            "layer_ids": list(self.layer_ids), "hidden_size": self.H, "num_layers": self.L,
            "params": params, "ceiling": ceiling(params, a.peak_tflops),
            "bytes_per_token": bytes_per_token(len(self.layer_ids), self.H),
            "workloads": {wl: {"prompts": len(p), "tokens": sum(map(len, p)),
                               "min_len": min(map(len, p)), "max_len": max(map(len, p)),
                               "seed": a.seed} for wl, p in self.workloads.items()},
            "settings": {k: getattr(a, k) for k in (
                "enforce_eager", "time_budget_s", "device", "warmup_prompts", "repeats",
                "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes", "max_in_flight", "hf_batch_tokens",
                "samples_per_shard", "peak_tflops", "disk_dtypes")},
            "targets": TARGETS, "descriptions": DESCRIPTION, "modes": {}, "complete": False,
        }
        if a.merge and self.json_path.is_file():
            old = json.loads(self.json_path.read_text())
            if old.get("workloads") == new["workloads"] and old.get("model") == a.model:
                new["modes"] = dict(old.get("modes") or {})
                new["merged_from"] = old.get("started")
        self.res = new
        self.save()

    def env_info(self) -> dict[str, Any]:
        from importlib.metadata import PackageNotFoundError, version
        env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                               "gpu": _gpu_name(), "host": platform.node()}
        for pkg in ("vllm", "transformers", "safetensors"):
            try:
                env[pkg] = version(pkg)
            except PackageNotFoundError:
                env[pkg] = None
        env["cuda"] = torch.version.cuda
        return env

    # ---- measurement loop

    def measure(self, mode: str, fns: dict[str, Callable[[list[list[int]]], dict[str, Any]]]
                ) -> None:
        """Warm-up then ``repeats`` timed runs of each fn on each workload (fns interleaved).

        A fn returns ``{"times": {series: seconds}, **info}``; each series gets
        ``{tokens, seconds, tok_s}`` per run, plus ``bytes``/``MB_s`` when the info has bytes.
        """
        a = self.args
        rec = self.res["modes"][mode]
        series = rec.setdefault("series", {})
        infos = rec.setdefault("run_info", {})
        last: dict[str, float] = {}
        for wl, prompts in self.workloads.items():
            warm = prompts[: a.warmup_prompts]
            ntok = sum(map(len, prompts))
            if warm:
                for key, fn in fns.items():
                    t0 = time.perf_counter()
                    fn(warm)  # scaled up: what a timed run should take
                    last[key] = (time.perf_counter() - t0) * ntok / sum(map(len, warm))
            for r in range(a.repeats):
                for key, fn in fns.items():
                    need = 1.3 * last.get(key, 0.0) + 5
                    if self.left() < need:
                        infos.setdefault(wl, []).append(
                            {"fn": key, "run": r, "skipped": f"time budget ({self.left():.0f} s "
                                                             f"left, ~{need:.0f} s needed)"})
                        continue
                    t0 = time.perf_counter()
                    info = fn(prompts)
                    last[key] = time.perf_counter() - t0
                    for name, sec in info.pop("times").items():
                        row = {"run": r, "tokens": ntok, "seconds": round(sec, 4),
                               "tok_s": round(ntok / sec, 1)}
                        nb = info.get("bytes")
                        if nb:
                            row.update(bytes=nb, MB_s=round(nb / sec / 1e6, 1))
                        series.setdefault(name, {}).setdefault(wl, []).append(row)
                    infos.setdefault(wl, []).append({"fn": key, "run": r, **info})
                    self.save()

    # ---- modes

    def mode_a(self, mode: str = "a", **extra: Any) -> None:
        llm, start = make_llm(self.ckpt, self.args, **extra)
        rec = self.res["modes"][mode]
        rec.update(startup_s=round(start, 1), engine=engine_info(llm))
        sp = _sampling()
        try:
            def run(prompts: list[list[int]]) -> dict[str, Any]:
                t0 = time.perf_counter()
                outs = llm.generate(_token_prompts(prompts), sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                if len(outs) != len(prompts) or any(
                        len(o.prompt_token_ids) != len(p) or len(o.outputs[0].token_ids) != 1
                        for o, p in zip(outs, prompts)):
                    raise RuntimeError("generate() returned unexpected prompt/output lengths")
                return {"times": {mode: dt}}
            self.measure(mode, {mode: run})
        finally:
            shutdown_llm(llm)

    def mode_a_sync(self) -> None:
        from vllm_compat.runtime.extraction import restore_env, set_env
        old = set_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
        try:
            self.mode_a("a_sync", async_scheduling=False)
        finally:
            restore_env(old)

    def mode_e(self) -> None:
        ids = sorted(self.layer_ids)
        if 0 in ids:
            raise _Skip("layer id 0 (embeddings) cannot come from vLLM's aux path")
        # Tried on every model; what vllm_compat's check (backend="native") predicts for this
        # release is recorded beside what vLLM does.
        from vllm_compat.runtime.native_probe import native_path_check
        from vllm_compat.target import read_target
        check = native_path_check(read_target(self.ckpt), ids)
        self.res["modes"]["e"]["native_check"] = {"ok": check.ok, "reason": check.reason,
                                                  "groups": list(check.groups)}
        try:
            self._mode_e(ids)
        except Exception as e:
            if check.ok is False:  # the failure the check predicted: recorded, not a bench error
                raise _Skip(f"vLLM's own path failed, as vllm_compat's check predicted "
                            f"({check.reason}): {type(e).__name__}: {e}") from e
            raise

    def _mode_e(self, ids: list[int]) -> None:
        store = self.scratch / "e-native"
        shutil.rmtree(store, ignore_errors=True)
        store.mkdir(parents=True)
        native = dict(
            speculative_config={
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
            kv_transfer_config={
                "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(store)}})
        rec = self.res["modes"]["e"]
        try:  # vLLM's defaults, as a user gets them (async scheduling: on for this method)
            llm, start = make_llm(self.ckpt, self.args, **native)
        except Exception as e:
            if "async" not in str(e).lower():
                raise
            rec["first_attempt_error"] = f"{type(e).__name__}: {e}"[:2000]
            free_memory()
            llm, start = make_llm(self.ckpt, self.args, async_scheduling=False, **native)
        rec.update(startup_s=round(start, 1), engine=engine_info(llm), layer_ids_sorted=ids)
        sp = _sampling()
        pos = [ids.index(k) for k in self.layer_ids]
        try:
            def run(prompts: list[list[int]]) -> dict[str, Any]:
                os.sync()
                t0 = time.perf_counter()
                outs = llm.generate(_token_prompts(prompts), sp, use_tqdm=False)
                t_ret = time.perf_counter() - t0
                paths = [(o.kv_transfer_params or {}).get("hidden_states_path") for o in outs]
                if any(p is None for p in paths):
                    raise RuntimeError("an output lacks kv_transfer_params['hidden_states_path']")
                from vllm_compat.runtime.extraction import wait_hidden_states_saved
                wait_hidden_states_saved(paths, llm, self.args.drain_timeout_s)
                t_drain = time.perf_counter() - t0
                for p in paths:
                    _fsync_path(p)
                _fsync_path(store)
                t_dur = time.perf_counter() - t0
                nbytes = sum(os.path.getsize(p) for p in paths)
                info: dict[str, Any] = {"times": {"e_returned": t_ret, "e_drained": t_drain,
                                                  "e_durable": t_dur},
                                        "bytes": nbytes, "files": len(paths)}
                if self._is_ref(prompts, "e"):
                    from safetensors.torch import load_file
                    hs = load_file(paths[0])["hidden_states"]
                    info["file_shape"] = list(hs.shape)
                    self.refs["e"] = hs[: len(prompts[0])][:, pos].clone()
                for p in paths:
                    for q in (p, p + ".lock"):
                        with contextlib.suppress(OSError):
                            os.remove(q)
                return info
            self.measure("e", {"e": run})
        finally:
            shutdown_llm(llm)
            shutil.rmtree(store, ignore_errors=True)

    def _extractor(self) -> Any:
        if self.extractor is None:
            from vllm_compat.extract import HiddenStatesExtractor
            a = self.args
            t0 = time.perf_counter()
            self.extractor = HiddenStatesExtractor(
                self.ckpt, layer_ids=self.layer_ids, max_model_len=a.max_model_len,
                gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
                max_in_flight=a.max_in_flight, dtype="bfloat16",
                **({} if a.kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": a.kv_cache_memory_bytes}))
            self.extractor_startup = round(time.perf_counter() - t0, 1)
            self.extractor_info = dict(self.extractor.info, engine=engine_info(self.extractor.llm))
        return self.extractor

    def close_extractor(self) -> None:
        if self.extractor is not None:
            with contextlib.suppress(Exception):
                self.extractor.close()
            self.extractor = None
            free_memory()

    def _is_ref(self, prompts: list[list[int]], key: str) -> bool:
        return key not in self.refs and len(prompts) == len(self.workloads["fixed"]) \
            and prompts[0] == self.workloads["fixed"][0]

    def mode_b(self, mode: str = "b", overlap_copy: bool = True,
               launch_ahead: bool | None = None) -> None:
        ex = self._extractor()
        engine = ex._engine
        rec = self.res["modes"][mode]
        rec.update(startup_s=self.extractor_startup if mode == "b" else 0.0,
                   extractor=self.extractor_info, overlap_copy=overlap_copy,
                   host_memory="pageable CPU tensors as the extractor yields them, "
                               + ("all kept" if self.args.keep_states == "all"
                                  else "prompt 0's kept, the others dropped once counted"))
        keep_all = self.args.keep_states == "all"

        def run(prompts: list[list[int]]) -> dict[str, Any]:
            keep: list[torch.Tensor] = []
            rows: list[int] = []
            nbytes = 0
            before = dict(engine.phase_s)
            steps0 = engine.num_steps
            t0 = time.perf_counter()
            for s in ex.extract(prompts):
                h = s.hidden_states
                rows.append(h.shape[0])
                nbytes += h.numel() * h.element_size()
                if keep_all or not keep:
                    keep.append(h)
            dt = time.perf_counter() - t0
            if self._is_ref(prompts, mode):
                self.refs[mode] = keep[0].clone()
            if rows != [len(p) for p in prompts]:
                raise RuntimeError("extracted token counts differ from the prompts")
            phases = {k: round(v - before.get(k, 0.0), 4) for k, v in engine.phase_s.items()}
            return {"times": {mode: dt}, "bytes": nbytes, "steps": engine.num_steps - steps0,
                    "phase_s": phases,  # this run's wall seconds per step() phase
                    "outside_step_s": round(dt - sum(phases.values()), 4)}

        old = engine.overlap_copy, engine.launch_ahead
        engine.overlap_copy = overlap_copy and engine._in_process_worker
        if launch_ahead is not None:  # None: the extractor's default
            engine.launch_ahead = launch_ahead
        rec["launch_ahead"] = engine.launch_ahead
        try:
            self.measure(mode, {mode: run})
        finally:
            engine.overlap_copy, engine.launch_ahead = old

    def mode_b_sync(self) -> None:
        self.mode_b("b_sync", overlap_copy=False)

    def mode_b_lockstep(self) -> None:
        self.mode_b("b_lockstep", launch_ahead=False)

    def mode_c(self, mode: str = "c") -> None:
        """To disk, interleaved with a plain write of the bytes each run wrote (same folder)."""
        from vllm_compat.eagle3.data import BackgroundShardWriter, HiddenStatesDataset, ShardWriter
        from vllm_compat.extract.fp8 import FP8_DTYPE

        shared = self.extractor is not None
        ex = self._extractor()
        a = self.args
        rec = self.res["modes"][mode]
        rec.update(startup_s=0.0 if shared else self.extractor_startup,
                   engine_shared_with_b=shared, scratch=str(self.scratch),
                   fp8_format="float8_e4m3fn hidden_states + float32 hidden_states_scale per "
                              "token and layer: x ~= q * scale[..., None]",
                   fp8_encoded_on="GPU (extractor states_dtype)" if mode == "c" else
                                  "CPU (the writer's encoding thread)")
        self.scratch.mkdir(parents=True, exist_ok=True)
        wrote: dict[tuple[str, int], int] = {}  # (dtype, tokens) -> bytes of the last c run

        def extract_to_disk(name: str, fp8: bool, gpu_encode: bool
                            ) -> Callable[[list[list[int]]], dict[str, Any]]:
            def run(prompts: list[list[int]]) -> dict[str, Any]:
                d = self.scratch / name
                shutil.rmtree(d, ignore_errors=True)
                os.sync()
                ex.states_dtype = FP8_DTYPE if fp8 and gpu_encode else None
                t0 = time.perf_counter()
                w = BackgroundShardWriter(ShardWriter(
                    d, hidden_size=self.H, aux_layer_ids=list(self.layer_ids[:-1]),
                    final_layer_id=self.layer_ids[-1], samples_per_shard=a.samples_per_shard,
                    dtype=FP8_DTYPE if fp8 else torch.bfloat16,
                    target={"benchmark": "gpu_extraction"}), max_queue=4 * a.samples_per_shard)
                try:
                    for s in ex.extract(prompts):
                        w.add({"input_ids": s.token_ids,
                               "loss_mask": torch.ones(len(s.token_ids), dtype=torch.bool),
                               **s.states()})
                    t_ext = time.perf_counter() - t0
                finally:
                    w.close()  # every shard and the manifest fsync'ed
                    ex.states_dtype = None
                dt = time.perf_counter() - t0
                nbytes = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
                wrote[("fp8" if fp8 else "bf16", sum(map(len, prompts)))] = nbytes
                if self._is_ref(prompts, name):
                    self.refs[name] = HiddenStatesDataset(d)[0]["hidden_states"]  # decoded
                shutil.rmtree(d, ignore_errors=True)
                return {"times": {name: dt, f"{name}_extract_loop": t_ext}, "bytes": nbytes,
                        "writer_busy_s": {k: round(v, 3) for k, v in w.busy.items()}}
            return run

        def plain_write(tag: str) -> Callable[[list[list[int]]], dict[str, Any]]:
            bpt = bytes_per_token(len(self.layer_ids), self.H)[tag]

            def run(prompts: list[list[int]]) -> dict[str, Any]:
                nbytes = plain_write_bytes(wrote, tag, prompts, bpt)
                os.sync()
                dt = disk_write(self.scratch / f"disk-{tag}.bin", nbytes)
                return {"times": {f"disk_{tag}": dt}, "bytes": nbytes}
            return run

        if mode == "c":
            series: dict[str, Callable[[list[list[int]]], dict[str, Any]]] = {}
            if "bf16" in a.disk_dtypes:
                series.update(c_bf16=extract_to_disk("c_bf16", False, False), disk_bf16=plain_write("bf16"))
            if "fp8" in a.disk_dtypes:
                series.update(c_fp8=extract_to_disk("c_fp8", True, True), disk_fp8=plain_write("fp8"))
            self.measure(mode, series)
        else:
            self.measure(mode, {"c_fp8_cpu": extract_to_disk("c_fp8_cpu", True, False)})

    def mode_c_cpu(self) -> None:
        self.mode_c("c_cpu")

    def mode_d(self) -> None:
        t0 = time.perf_counter()
        hf = HFForward(self.ckpt, self.layer_ids, self.args.device, self.args.hf_batch_tokens)
        rec = self.res["modes"]["d"]
        rec.update(startup_s=round(time.perf_counter() - t0, 1), device=self.args.device,
                   attn_implementation="sdpa", batch_tokens=self.args.hf_batch_tokens)
        try:
            def run(prompts: list[list[int]]) -> dict[str, Any]:
                t0 = time.perf_counter()
                states = hf.run(prompts)
                dt = time.perf_counter() - t0
                if [h.shape[0] for h in states] != [len(p) for p in prompts]:
                    raise RuntimeError("HF token counts differ from the prompts")
                if self._is_ref(prompts, "d"):
                    self.refs["d"] = states[0].clone()
                return {"times": {"d": dt}, "batches": len(hf.batches(prompts)),
                        "bytes": sum(h.numel() * h.element_size() for h in states),
                        "shape0": list(states[0].shape)}
            self.measure("d", {"d": run})
        finally:
            hf.close()

    # ---- driver

    def estimate(self, mode: str) -> float:
        """Rough seconds a mode needs (engine start + passes), from what already ran."""
        done = [m.get("wall_s", 0) for k, m in self.res["modes"].items()
                if k in ("a", "e", "a_sync", "b") and m.get("status") == "ok"]
        # min, not max: a fresh host's first engine also pays one-time JIT builds (FlashInfer;
        # on an H200 177 and 202 s against 31-54 s for the engines after it). 75 s before any
        # engine ran: with VLLM_USE_FLASHINFER_SAMPLER=0 a first engine starts in 16-35 s
        engine = 1.1 * min(done) if done else 75.0
        if mode in ("c", "c_cpu"):
            return 60.0 if self.extractor is not None else engine + 60.0
        if mode in ("b_lockstep", "b_sync") and self.extractor is not None:
            return 30.0  # b's engine, already started
        if mode == "d":
            return 90.0
        return engine

    def run(self) -> None:
        self.setup()
        # the budget is for measuring: building kimi-tp8's checkpoint alone takes minutes, and
        # counted in the budget it left (b) skipped right after (a) ran
        self.t0 = time.monotonic()
        todo = [m for m in RUN_ORDER if m in self.args.modes]
        for mode in todo:
            rec: dict[str, Any] = {"description": DESCRIPTION[mode], "status": "running",
                                   "free_gpu_gib_before": _free_gpu_gib()}
            self.res["modes"][mode] = rec
            t0 = time.monotonic()
            try:
                if self.args.device != "cuda" and mode != "d":
                    raise _Skip(f"mode {mode} needs vLLM on a CUDA device "
                                f"(--device {self.args.device})")
                need = self.estimate(mode)
                if self.left() < need:
                    raise _Skip(f"time budget: {self.left():.0f} s left, ~{need:.0f} s needed")
                getattr(self, f"mode_{mode}")()
                rec["status"] = "ok"
            except _Skip as e:
                rec.update(status="skipped", reason=str(e))
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                rec.update(status="failed", error=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc()[-4000:])
                print(f"[mode {mode}] FAILED: {type(e).__name__}: {e}", file=sys.stderr)
                self.close_extractor()  # a later b/c starts on a fresh engine
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            on_extractor = {"b", "b_lockstep", "b_sync", "c", "c_cpu"}
            if mode in on_extractor and not (on_extractor & set(todo[todo.index(mode) + 1:])):
                self.close_extractor()
            self.save()
        self.close_extractor()
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.res["env"].get("gpu") is None and torch.cuda.is_available():
            self.res["env"]["gpu"] = torch.cuda.get_device_name(0)
        self.res["complete"] = True
        self.save()


class _Skip(Exception):
    """A mode that cannot run here (recorded as skipped, with the reason)."""


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict[str, Any]) -> str:
    """A compact text table: tok/s per series and run (MB/s of the best), then the ratios."""
    wls = list(res.get("workloads") or {})
    env = res.get("env") or {}
    lines = [f"{res.get('model')} on {env.get('gpu')} | vLLM {env.get('vllm')} | torch "
             f"{env.get('torch')} | layers {res.get('layer_ids')} | ceiling "
             f"{_fmt((res.get('ceiling') or {}).get('tok_s'))} tok/s (2 x params at "
             f"{(res.get('ceiling') or {}).get('peak_tflops')} TFLOP/s)"]
    head = (f"{'series':<22}" + "".join(f"{wl + ' tok/s runs':>27}{'MB/s':>8}" for wl in wls)
            + f"{'start s':>9}")
    lines += [head, "-" * len(head)]
    for mode, rec in (res.get("modes") or {}).items():
        if rec.get("status") != "ok":
            why = rec.get("reason") or rec.get("error") or ""
            lines.append(f"{mode:<22}{rec.get('status')}: {why[:160]}")
            continue
        for name, per in (rec.get("series") or {}).items():
            cells = ""
            for wl in wls:
                runs = per.get(wl, [])
                tok = " / ".join(_fmt(r.get("tok_s")) for r in runs) or "-"
                mbs = [r["MB_s"] for r in runs if r.get("MB_s")]
                cells += f"{tok:>27}{_fmt(max(mbs) if mbs else None):>8}"
            lines.append(f"{name:<22}{cells}{_fmt(rec.get('startup_s'), '.1f'):>9}")
    s = res.get("summary") or {}
    lines.append("ratios of best runs (" + "/".join(wls) + "): " + "; ".join(
        f"{k} " + "/".join(_fmt(v.get(wl), '.2f') for wl in wls)
        for k, v in (s.get("ratios") or {}).items() if any(x is not None for x in v.values())))
    lines.append("ratios of medians: " + "; ".join(
        f"{k} " + "/".join(_fmt(v.get(wl), '.2f') for wl in wls)
        for k, v in (s.get("ratios_median") or {}).items()
        if any(x is not None for x in v.values())))
    short = s.get(f"runs_under_{MIN_RUN_S:.0f}s")
    if short:
        lines.append(f"timed runs under {MIN_RUN_S:.0f} s (noise-bound; raise --num-prompts / "
                     f"--mixed-prompts): {', '.join(short)}")
    for dt, per in (s.get("c_limits") or {}).items():
        for wl, lim in per.items():
            if lim.get("c_tok_s"):
                runs = " / ".join(_fmt(x, ".2f") for x in lim["c_over_binding_runs"])
                lines.append(f"c_{dt} {wl}: binding={lim['binding']} (in memory "
                             f"{_fmt(lim['in_memory_tok_s'])}, disk {_fmt(lim['disk_tok_s'])} "
                             f"tok/s), c/min(b, disk) {_fmt(lim['c_over_binding'], '.2f')} "
                             f"(runs {runs})")
    lines.append(f"bytes/token {res.get('bytes_per_token')} | cross-check "
                 f"{json.dumps(res.get('cross_check'))} | elapsed {res.get('elapsed_s')} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    for k, v in {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    args = parse_args(argv)
    bench = Bench(args)
    try:
        bench.run()
    finally:
        if bench.res:
            bench.save()
            print(table(bench.res))
            print(f"results: {bench.json_path}")
            if not args.no_plot:
                try:
                    from . import plot_gpu_extraction
                    png = plot_gpu_extraction.plot([bench.json_path],
                                                   bench.json_path.with_suffix(".png"))
                    print(f"chart: {png}")
                except Exception as e:  # noqa: BLE001 - e.g. no matplotlib on the GPU box
                    print(f"no chart ({type(e).__name__}: {e}); "
                          "run python -m bench.plot_gpu_extraction on the JSON")
    # a mode whose measurement failed fails the run (the others' numbers are in the JSON)
    failed = {m: r.get("error") for m, r in (bench.res.get("modes") or {}).items()
              if m in args.modes and r.get("status") == "failed"}
    for m, err in failed.items():
        print(f"mode {m} FAILED: {err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
