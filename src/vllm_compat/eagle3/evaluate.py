"""``eagle3 evaluate``: serve target + draft with vLLM speculative decoding and measure it.

For each configuration -- no speculation (baseline), EAGLE-3 with ``K`` speculative tokens,
vLLM's n-gram (prompt-lookup) speculator with ``K`` -- one engine is started, warmed up,
and run on the same held-out prompts twice: at batch 1 (the first ``batch1_prompts`` prompts,
one ``generate`` each) and at batch ``len(prompts)`` (all in one ``generate``). Greedy, or
sampled at ``temperature`` with a seed per prompt; ``ignore_eos``, ``max_tokens`` new tokens
per prompt. Measured per run:

- output tokens / wall second around ``generate`` (speedup = tok/s over the baseline's);
- from vLLM's spec-decode counters (``LLM.get_metrics()``; cumulative, so the difference
  between snapshots taken right before and after the run):
  ``acceptance_length = 1 + accepted / drafts`` (vLLM's own "mean acceptance length") and
  ``per_position[i] = accepted_per_pos[i] / drafts``;
- ``effective_acceptance_length = generated / (generated - accepted)``: output tokens per
  target forward pass. vLLM counts a draft only when the proposer proposed something, so
  for n-gram (which proposes nothing when the context has no match) its acceptance length
  is conditional on a match; the effective one counts every step and compares methods on
  equal terms. For EAGLE-3 (a draft at every decode step) the two nearly agree;
- greedy only: whether the outputs equal the baseline's (speculative decoding must not change
  greedy output; bf16 batch-shape differences can flip a near-tie).

Every configuration runs in its own process (:func:`vllm_compat.isolation.run_isolated`),
so no engine's teardown can affect the next one: an engine torn down in a process leaves
CUDA-graph, compiler and allocator state there, and the next engine of that process failed on
it (vLLM 0.26.0, one H200: the memory profiler's assertion, "CUDA graph capturing detected at
an inappropriate time", a ``CUDACachingAllocator`` assertion). A failed configuration -- an
exception, or its process killed by a signal -- is recorded (error type, message, the tail of
the child's traceback) and the others continue. The result is marked: ``status`` is ``"ok"``
(every configuration measured), ``"partial"`` (some failed or were skipped) or ``"failed"``
(none measured), and ``failed`` names the failed ones with their errors; with
``raise_on_error`` (the default) :func:`evaluate` then raises :class:`EvaluationError` once
everything is written. ``evaluate.json`` is rewritten after every configuration (a killed run
still reports), ``evaluate.md`` holds the summary table, and ``evaluate.png`` the plots when
matplotlib is installed. Nothing here imports vLLM; the engine side is
:mod:`vllm_compat.runtime.llm`, imported by :func:`run_cell` in the configuration's process.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..detect import installed_vllm_version
from ..errors import VllmCompatError, VllmNotInstalledError
from ..isolation import IsolatedCallError, run_isolated
from .ceiling import ceiling_stats
from .repetition import repetition_stats

SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
RESULT_JSON = "evaluate.json"
RESULT_MD = "evaluate.md"
RESULT_PNG = "evaluate.png"
BASELINE_OUTPUTS = "baseline-outputs.json"  # prompts and the baseline's outputs, per run, as token ids


class EvaluationError(VllmCompatError, RuntimeError):
    """Configurations whose measurement failed. ``failed``: ``[{"name", "error_type",
    "error"}]``; ``result``: everything :func:`evaluate` measured (also in ``evaluate.json``)."""

    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result
        self.failed = list(result.get("failed") or [])
        n = len(result.get("configs") or [])
        names = "; ".join(f"{f['name']} ({f['error'][:300]})" for f in self.failed)
        super().__init__(f"{len(self.failed)} of {n} evaluation configurations failed: {names}. "
                         f"Measured ones are kept in {result.get('output_dir')}/{RESULT_JSON}")


# --------------------------------------------------------------------------- counters


@dataclass
class SpecCounters:
    """The spec-decode counters of one snapshot (summed over label sets, i.e. engines)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        a = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        b = before.accepted_per_pos + [0] * (n - len(before.accepted_per_pos))
        out = SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                           self.accepted - before.accepted, [x - y for x, y in zip(a, b)])
        if min(out.drafts, out.draft_tokens, out.accepted, *out.accepted_per_pos, 0) < 0:
            raise ValueError(f"counters went down between snapshots ({before} -> {self}): "
                             "snapshots of different engines?")
        return out


def _base_name(name: str) -> str:
    # prometheus_client names a counter family without "_total"; its samples carry it
    return name.removesuffix("_total")


def spec_counters(metrics: Iterable[Any]) -> SpecCounters:
    """Reduce a ``LLM.get_metrics()`` snapshot (``vllm.v1.metrics.reader`` objects: ``.name``,
    ``.labels`` and ``.value`` for a ``Counter``, ``.values`` for a ``Vector``) to the
    spec-decode counters. Absent counters (no speculation configured) read as zero."""
    c = SpecCounters()
    for m in metrics:
        name = _base_name(getattr(m, "name", ""))
        if name == SPEC_ACCEPTED_PER_POS:
            values = [int(v) for v in getattr(m, "values", [])]
            if len(values) > len(c.accepted_per_pos):
                c.accepted_per_pos += [0] * (len(values) - len(c.accepted_per_pos))
            for i, v in enumerate(values):
                c.accepted_per_pos[i] += v
        elif name == SPEC_DRAFTS:
            c.drafts += int(m.value)
        elif name == SPEC_DRAFT_TOKENS:
            c.draft_tokens += int(m.value)
        elif name == SPEC_ACCEPTED:
            c.accepted += int(m.value)
    return c


def acceptance(delta: SpecCounters, generated_tokens: int, num_requests: int) -> dict[str, Any]:
    """Acceptance statistics of one run from its counter delta and its output token count."""
    d = delta.drafts
    steps = max(generated_tokens - delta.accepted, 1)  # target forward passes that emitted tokens
    return {
        "num_drafts": d, "num_draft_tokens": delta.draft_tokens, "num_accepted_tokens": delta.accepted,
        "accepted_per_pos": list(delta.accepted_per_pos),
        "acceptance_length": (1.0 + delta.accepted / d) if d else None,
        "per_position": [a / d for a in delta.accepted_per_pos] if d else [],
        "draft_acceptance_rate": (delta.accepted / delta.draft_tokens) if delta.draft_tokens else None,
        "effective_acceptance_length": generated_tokens / steps if generated_tokens else None,
        # decode steps that had a draft (the first token of each request comes from prefill)
        "draft_coverage": d / max(steps - num_requests, 1) if generated_tokens else None,
    }


def match_baseline(outputs: Sequence[Sequence[int]], baseline: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How many greedy outputs equal the baseline's, and the mean matching-prefix fraction."""
    if len(outputs) != len(baseline):
        raise ValueError(f"{len(outputs)} outputs vs {len(baseline)} baseline outputs")
    exact, prefix = 0, []
    for o, b in zip(outputs, baseline):
        exact += list(o) == list(b)
        n = 0
        for x, y in zip(o, b):
            if x != y:
                break
            n += 1
        prefix.append(n / max(len(b), 1))
    k = max(len(outputs), 1)
    return {"exact": exact, "total": len(outputs), "exact_fraction": exact / k,
            "mean_prefix_fraction": sum(prefix) / k}


# --------------------------------------------------------------------------- prompts


def _encoder(tokenizer: str | os.PathLike[str], trust_remote_code: bool
             ) -> tuple[Any, Any]:
    """``(encode texts -> ids with the tokenizer's special tokens, decode ids -> text)`` for a
    ``tokenizer.json`` file, or a checkpoint directory (with ``tokenizer.json``, or a tokenizer
    shipped as code: run only with ``trust_remote_code``)."""
    p = Path(tokenizer)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if p.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(p))
        return (lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=True)],
                tok.decode)
    from ..tokenizer import load_tokenizer

    hf = load_tokenizer(p, trust_remote_code=trust_remote_code)
    bos = [hf.bos_token_id] if hf.bos_token_id is not None else []
    # Kimi's tokenizer adds no BOS itself; the targets are trained on <bos> doc <eos>
    return (lambda texts: [bos + hf.encode(t, add_special_tokens=False) for t in texts],
            hf.decode)


def build_prompts(tokenizer: str | os.PathLike[str], chunks_jsonl: str | os.PathLike[str],
                  prompt_len: int, n: int, *, trust_remote_code: bool = False
                  ) -> tuple[list[list[int]], list[str]]:
    """``n`` prompts: the first ``prompt_len`` token ids (``<|bos|>`` included, as the tokenizer's
    post-processor adds it) of held-out chunks with at least that many tokens, taken at evenly
    spaced indices of the (file-ordered) chunk list so they span many files. Returns
    ``(prompts, source paths)``. ``tokenizer``: a ``tokenizer.json`` or a checkpoint directory."""
    encode, _ = _encoder(tokenizer, trust_remote_code)
    rows = [json.loads(line) for line in Path(chunks_jsonl).read_text().splitlines() if line.strip()]
    encs = encode([r["prompt"] + r["completion"] for r in rows])
    ok = [(r.get("path", ""), e[:prompt_len]) for r, e in zip(rows, encs) if len(e) >= prompt_len]
    if len(ok) < n:
        raise ValueError(f"{chunks_jsonl}: {len(ok)} chunks with >= {prompt_len} tokens, {n} prompts wanted")
    idx = [round(i * (len(ok) - 1) / max(n - 1, 1)) for i in range(n)] if n > 1 else [0]
    return [list(ok[i][1]) for i in idx], [ok[i][0] for i in idx]


# --------------------------------------------------------------------------- configuration


@dataclass
class EvalConfig:
    target: str
    draft: str | None
    prompts_file: str  # held-out chunks (corpus eval.jsonl)
    output_dir: str
    ks: list[int] = field(default_factory=lambda: [3, 1, 5])  # run order: the first K's configs run first
    ngram_ks: list[int] = field(default_factory=lambda: [3, 1, 5])
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    prompt_len: int = 128
    max_tokens: int = 256
    batch_prompts: int = 32  # the batched run: all at once
    batch1_prompts: int = 8  # the batch-1 run: the first of them, one at a time
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.25
    max_model_len: int | None = 1024
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    budget_s: float | None = None  # skip configurations that would not finish in time
    baseline: bool = True
    warmup_tokens: int = 16
    label: str = ""
    # the target's tokenizer / processor shipped as code (Kimi-K2.5): run it (also in vLLM)
    trust_remote_code: bool = False
    # 0: greedy. Above 0: sampled, prompt i with seed + i in every configuration; vLLM's
    # speculative decoding keeps the target's distribution, not its samples, so outputs are
    # not compared with the baseline's
    temperature: float = 0.0
    seed: int = 0
    # sampled runs only: the nucleus (Kimi-K2.5 is served at temperature 1.0, top_p 0.95)
    top_p: float = 1.0
    # sampled runs only: the target's logprobs along the baseline's outputs (one more engine),
    # the most vLLM can accept of any draft's tokens (:mod:`vllm_compat.eagle3.ceiling`)
    acceptance_ceiling: bool = False
    ceiling_top_k: int = 20


def planned_configs(cfg: EvalConfig) -> list[dict[str, Any]]:
    """Run order: baseline; then for each K of ``ks``: eagle3-K and ngram-K (if listed); then the
    n-gram Ks not in ``ks``."""
    out: list[dict[str, Any]] = []
    if cfg.baseline:
        out.append({"name": "baseline", "method": None, "k": None, "speculative_config": None})
    ng = {"prompt_lookup_min": cfg.prompt_lookup_min, "prompt_lookup_max": cfg.prompt_lookup_max}

    def ngram(k: int) -> dict[str, Any]:
        return {"name": f"ngram-k{k}", "method": "ngram", "k": k,
                "speculative_config": {"method": "ngram", "num_speculative_tokens": k, **ng}}

    for k in cfg.ks:
        if cfg.draft is not None:
            out.append({"name": f"eagle3-k{k}", "method": "eagle3", "k": k, "speculative_config": {
                "method": "eagle3", "model": str(Path(cfg.draft).resolve()), "num_speculative_tokens": k}})
        if k in cfg.ngram_ks:
            out.append(ngram(k))
    out += [ngram(k) for k in cfg.ngram_ks if k not in cfg.ks]
    return out


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _run(serve: Any, llm: Any, prompts: list[list[int]], max_tokens: int, batched: bool,
         temperature: float = 0.0, seed: int = 0, top_p: float = 1.0) -> tuple[dict[str, Any], list[list[int]]]:
    def sampling(seeds: list[int]) -> dict[str, Any]:  # prompt i keeps seed + i at any batch size
        return {"temperature": temperature, "seeds": seeds, "top_p": top_p} if temperature > 0 else {}

    before = spec_counters(serve.metrics(llm))
    if batched:
        outs, wall = serve.timed_generate(llm, prompts, max_tokens=max_tokens,
                                          **sampling([seed + i for i in range(len(prompts))]))
    else:
        outs, wall = [], 0.0
        for i, p in enumerate(prompts):
            o, w = serve.timed_generate(llm, [p], max_tokens=max_tokens, **sampling([seed + i]))
            outs += o
            wall += w
    delta = spec_counters(serve.metrics(llm)) - before
    gen = sum(len(o) for o in outs)
    run = {"requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": gen,
           "wall_s": round(wall, 4), "output_tok_s": gen / wall if wall > 0 else None,
           "spec": acceptance(delta, gen, len(prompts)) if delta.drafts or delta.draft_tokens else None}
    return run, outs


def run_cell(job: dict[str, Any]) -> dict[str, Any]:
    """One configuration on its own engine: start it, warm it up, measure every run, shut it
    down. :func:`evaluate` runs this in a process of its own. ``job``: ``target``,
    ``speculative_config``, ``engine`` (``open_llm`` keywords), ``warmup`` (prompts),
    ``warmup_tokens``, ``max_tokens``, ``runs`` (run name -> prompts; ``batch1`` one request at a time).
    Returns ``engine_start_s``, ``engine`` (what vLLM built for speculation), ``runs`` (per
    run: counts, wall time, tok/s, acceptance) and ``outputs`` (per run: the outputs)."""
    from ..runtime import llm as serve  # imports vLLM

    t0 = time.perf_counter()
    llm = serve.open_llm(job["target"], speculative_config=job["speculative_config"], **job["engine"])
    try:
        out: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 2),
                               "engine": serve.speculative_summary(llm), "runs": {}, "outputs": {}}
        if job["warmup_tokens"] and job["warmup"]:
            serve.generate(llm, job["warmup"], max_tokens=job["warmup_tokens"])
        for run_name, ps in job["runs"].items():
            run, outs = _run(serve, llm, ps, job["max_tokens"], batched=run_name != "batch1",
                             temperature=job.get("temperature", 0.0), seed=job.get("seed", 0),
                             top_p=job.get("top_p", 1.0))
            out["runs"][run_name] = run
            out["outputs"][run_name] = outs
        return out
    finally:
        serve.close_llm(llm)


def evaluate(cfg: EvalConfig, *, log: Any = print, raise_on_error: bool = True,
             cell_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
             ceiling_fn: Callable[[dict[str, Any]], list[Any]] | None = None) -> dict[str, Any]:
    """Run every planned configuration, each in its own process; returns the result dict (also
    ``evaluate.json``). A failed configuration is recorded and the others run; then, with
    ``raise_on_error``, :class:`EvaluationError` names the failed ones. ``cell_fn``: what
    measures one configuration in its process (default :func:`run_cell`; any module-level
    function with its signature); ``ceiling_fn``: what measures the target's logprobs for
    ``acceptance_ceiling`` (default :func:`ceiling_cell`)."""
    cell_fn = cell_fn or run_cell
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = str(Path(cfg.target).resolve())
    n = max(cfg.batch_prompts, cfg.batch1_prompts)
    prompts, paths = build_prompts(target, cfg.prompts_file, cfg.prompt_len, n,
                                   trust_remote_code=cfg.trust_remote_code)
    runs = {"batch1": prompts[: cfg.batch1_prompts], f"batch{cfg.batch_prompts}": prompts[: cfg.batch_prompts]}
    result: dict[str, Any] = {
        "label": cfg.label, "config": asdict(cfg), "target": target, "output_dir": str(out),
        "draft": str(Path(cfg.draft).resolve()) if cfg.draft else None,
        "vllm_version": _vllm_version(),
        "prompts": {"count": n, "prompt_len": cfg.prompt_len, "max_tokens": cfg.max_tokens,
                    "source_files": sorted(set(paths)), "runs": {k: len(v) for k, v in runs.items()}},
        "status": "running", "failed": [], "skipped": [], "configs": [],
    }
    baseline_outputs: dict[str, list[list[int]]] = {}
    longest = 0.0
    # no more requests than the batched run sends at once: fewer CUDA-graph sizes to capture
    engine = {"enforce_eager": cfg.enforce_eager, "gpu_memory_utilization": cfg.gpu_memory_utilization,
              "max_model_len": cfg.max_model_len,
              "max_num_seqs": max(cfg.batch_prompts, cfg.batch1_prompts), **cfg.engine_kwargs}
    if cfg.trust_remote_code:
        engine["trust_remote_code"] = True
    for plan in planned_configs(cfg):
        entry: dict[str, Any] = {k: plan[k] for k in ("name", "method", "k", "speculative_config")}
        elapsed = time.perf_counter() - t_start
        if cfg.budget_s is not None and elapsed + max(longest, 30.0) > cfg.budget_s:
            entry.update(status="skipped", reason=f"time budget: {elapsed:.0f} s used of {cfg.budget_s:.0f} s, "
                                                  f"a configuration took up to {longest:.0f} s")
            result["configs"].append(entry)
            result["skipped"].append(plan["name"])
            log(f"[evaluate] {plan['name']}: skipped (time budget)")
            _write(result, out)
            continue
        log(f"[evaluate] {plan['name']}: starting the engine in its own process")
        t0 = time.perf_counter()
        job = {"target": target, "speculative_config": plan["speculative_config"], "engine": engine,
               "warmup": prompts[:2], "warmup_tokens": cfg.warmup_tokens, "max_tokens": cfg.max_tokens,
               "runs": runs, "temperature": cfg.temperature, "seed": cfg.seed, "top_p": cfg.top_p}
        try:
            cell = run_isolated(cell_fn, args=(job,), name=f"evaluate {plan['name']}")
            _record_cell(entry, cell, plan, baseline_outputs, log, compare=cfg.temperature == 0)
            if plan["method"] is None:
                result["samples"] = _samples(target, prompts[:2], baseline_outputs.get("batch1", [])[:2],
                                             cfg.trust_remote_code)
                result["baseline_repetition"] = _repetition(runs, baseline_outputs, cfg)
                (out / BASELINE_OUTPUTS).write_text(json.dumps({"prompts": runs, "outputs": baseline_outputs}))
                if cfg.acceptance_ceiling and cfg.temperature > 0:
                    _measure_ceiling(result, ceiling_fn or ceiling_cell, target, engine, runs,
                                     baseline_outputs, cfg, log)
        except Exception as exc:  # recorded; one failing configuration must not hide the others
            _record_error(entry, exc)
            result["failed"].append({"name": plan["name"], "error_type": entry["error_type"],
                                     "error": entry["error"]})
            log(f"[evaluate] {plan['name']}: FAILED {entry['error'][:500]}")
        entry["wall_s"] = round(time.perf_counter() - t0, 2)
        longest = max(longest, entry["wall_s"])
        result["configs"].append(entry)
        result["summary"] = summarize(result)
        _write(result, out)
    result["wall_s"] = round(time.perf_counter() - t_start, 2)
    result["status"] = run_status(result)
    result["summary"] = summarize(result)
    _write(result, out)
    result["plot"] = str(plot(result, out / RESULT_PNG) or "") or None
    _write(result, out)
    if raise_on_error and result["failed"]:
        raise EvaluationError(result)
    return result


def _vllm_version() -> str | None:
    try:
        return installed_vllm_version()
    except VllmNotInstalledError:
        return None


def run_status(result: dict[str, Any]) -> str:
    """``ok``: every configuration measured; ``failed``: none; ``partial``: some failed or were
    skipped (their rows say which and why)."""
    configs = result.get("configs") or []
    ok = sum(c.get("status") == "ok" for c in configs)
    if configs and ok == len(configs):
        return "ok"
    return "partial" if ok else "failed"


def _record_cell(entry: dict[str, Any], cell: dict[str, Any], plan: dict[str, Any],
                 baseline_outputs: dict[str, list[list[int]]], log: Any, compare: bool = True) -> None:
    outputs = cell.get("outputs") or {}
    entry.update(engine_start_s=cell.get("engine_start_s"), engine=cell.get("engine"), runs=cell["runs"])
    for run_name, run in entry["runs"].items():
        outs = outputs.get(run_name, [])
        if plan["method"] is None:
            baseline_outputs[run_name] = outs
        elif compare and run_name in baseline_outputs:  # greedy only: sampled outputs may differ
            run["match_baseline"] = match_baseline(outs, baseline_outputs[run_name])
        spec = run.get("spec") or {}
        log(f"[evaluate] {plan['name']} {run_name}: {run.get('output_tok_s') or 0:.0f} tok/s, "
            f"acceptance length {spec.get('acceptance_length')}, "
            f"effective {spec.get('effective_acceptance_length')}")
    entry["status"] = "ok"


def _record_error(entry: dict[str, Any], exc: Exception) -> None:
    if isinstance(exc, IsolatedCallError):  # raised in the configuration's process, or it died
        kind, message, tb = exc.exc_type, exc.message, exc.traceback or ""
    else:
        kind, message, tb = type(exc).__name__, str(exc), traceback.format_exc()
    entry.update(status="error", error_type=kind, error=f"{kind}: {message}"[:2000], traceback=_tail(tb))


def _repetition(runs: dict[str, list[list[int]]], baseline_outputs: dict[str, list[list[int]]],
                cfg: EvalConfig) -> dict[str, Any]:
    # what prompt lookup can exploit in the target's own outputs, with the n-gram runs' n range
    return {name: repetition_stats(runs[name], outs, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            for name, outs in baseline_outputs.items() if name in runs}


def ceiling_cell(job: dict[str, Any]) -> list[list[dict[int, float] | None]]:
    """The target's top-``k`` logprobs at every position of ``job["sequences"]`` (prompt +
    output), on an engine without speculation; :func:`evaluate` runs this in a process of its own."""
    from ..runtime import llm as serve  # imports vLLM

    llm = serve.open_llm(job["target"], **job["engine"], max_logprobs=job["k"])
    try:
        return serve.prompt_logprobs(llm, job["sequences"], k=job["k"])
    finally:
        serve.close_llm(llm)


def _measure_ceiling(result: dict[str, Any], fn: Callable[[dict[str, Any]], list[Any]], target: str,
                     engine: dict[str, Any], runs: dict[str, list[list[int]]],
                     baseline_outputs: dict[str, list[list[int]]], cfg: EvalConfig, log: Any) -> None:
    # a failure here is the ceiling's alone: the baseline's measurements stand
    log("[evaluate] acceptance ceiling: the target's logprobs along the baseline's outputs")
    try:
        result["acceptance_ceiling"] = _ceiling(fn, target, engine, runs, baseline_outputs, cfg)
    except Exception as exc:  # noqa: BLE001 - recorded, the configurations go on
        result["acceptance_ceiling_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"[evaluate] acceptance ceiling: FAILED {result['acceptance_ceiling_error'][:500]}")


def _ceiling(fn: Callable[[dict[str, Any]], list[Any]], target: str, engine: dict[str, Any],
             runs: dict[str, list[list[int]]], baseline_outputs: dict[str, list[list[int]]],
             cfg: EvalConfig) -> dict[str, Any]:
    names = [n for n in baseline_outputs if n in runs]
    seqs = [list(p) + list(o) for n in names for p, o in zip(runs[n], baseline_outputs[n])]
    job = {"target": target, "engine": engine, "sequences": seqs, "k": cfg.ceiling_top_k}
    rows = run_isolated(fn, args=(job,), name="evaluate acceptance ceiling")
    out, i = {}, 0
    for n in names:
        prompts, outs = runs[n], baseline_outputs[n]
        per = [rows[i + j][len(p):len(p) + len(o)] for j, (p, o) in enumerate(zip(prompts, outs))]
        i += len(prompts)
        out[n] = ceiling_stats(prompts, outs, per, top_p=cfg.top_p, ks=sorted(set(cfg.ks) | set(cfg.ngram_ks)),
                               min_n=cfg.prompt_lookup_min, max_n=cfg.prompt_lookup_max)
    return out


def _samples(target: str, prompts: list[list[int]], outputs: list[list[int]],
             trust_remote_code: bool = False) -> list[dict[str, str]]:
    try:
        _, decode = _encoder(target, trust_remote_code)
        return [{"prompt": decode(p)[-400:], "baseline_output": decode(o)[:800]}
                for p, o in zip(prompts, outputs)]
    except Exception as exc:  # samples are decoration
        return [{"error": f"{type(exc).__name__}: {exc}"}]


def _write(result: dict[str, Any], out: Path) -> None:
    tmp = out / (RESULT_JSON + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, out / RESULT_JSON)
    (out / RESULT_MD).write_text(markdown_table(result))


# --------------------------------------------------------------------------- summary


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """One row per configuration and run: tok/s, speedup over the baseline, acceptance lengths,
    per-position rates, baseline match; plus EAGLE-3 vs n-gram at each K both ran."""
    base = next((c for c in result["configs"] if c.get("method") is None and c.get("status") == "ok"), None)
    rows = []
    for c in result["configs"]:
        if c.get("status") != "ok":
            rows.append({"config": c["name"], "method": c.get("method"), "k": c.get("k"), "status": c.get("status"),
                         "error": c.get("error") or c.get("reason")})
            continue
        for run_name, r in c.get("runs", {}).items():
            b = (base or {}).get("runs", {}).get(run_name)
            spec = r.get("spec") or {}
            rows.append({
                "config": c["name"], "method": c.get("method"), "k": c.get("k"), "run": run_name, "status": "ok",
                "output_tok_s": r.get("output_tok_s"),
                "speedup": (r["output_tok_s"] / b["output_tok_s"]) if b and b.get("output_tok_s") and r.get("output_tok_s") else None,
                "acceptance_length": spec.get("acceptance_length"),
                "effective_acceptance_length": spec.get("effective_acceptance_length"),
                "per_position": spec.get("per_position"),
                "draft_coverage": spec.get("draft_coverage"),
                "match_exact_fraction": (r.get("match_baseline") or {}).get("exact_fraction"),
            })
    compare = []
    ok = {(r["method"], r["k"], r.get("run")): r for r in rows if r.get("status") == "ok"}
    for (method, k, run), r in sorted(ok.items(), key=lambda x: (str(x[0][2]), x[0][1] or 0)):
        if method != "eagle3" or ("ngram", k, run) not in ok:
            continue
        g = ok[("ngram", k, run)]
        compare.append({
            "k": k, "run": run,
            "eagle3_acceptance_length": r["acceptance_length"], "ngram_acceptance_length": g["acceptance_length"],
            "eagle3_effective": r["effective_acceptance_length"], "ngram_effective": g["effective_acceptance_length"],
            "eagle3_beats_ngram": _gt(r["acceptance_length"], g["acceptance_length"]),
            "eagle3_beats_ngram_effective": _gt(r["effective_acceptance_length"], g["effective_acceptance_length"]),
        })
    return {"rows": rows, "eagle3_vs_ngram": compare}


def _gt(a: float | None, b: float | None) -> bool | None:
    if a is None:
        return None
    return a > (b if b is not None else 1.0)  # no n-gram draft at all: its acceptance length is 1


def _decoding(result: dict[str, Any]) -> str:
    c = result.get("config") or {}
    t, top_p = c.get("temperature") or 0.0, c.get("top_p", 1.0)
    if t <= 0:
        return "greedy"
    nucleus = f", top_p {top_p:g}" if top_p < 1.0 else ""
    return f"sampled at temperature {t:g}{nucleus}, seed {c.get('seed', 0)} + prompt index"


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    if isinstance(x, list):
        return " / ".join(f"{v:.2f}" for v in x)
    return str(x)


def markdown_table(result: dict[str, Any]) -> str:
    s = result.get("summary") or summarize(result)
    head = (f"vLLM {result.get('vllm_version')}; target `{result.get('target')}`; draft `{result.get('draft')}`; "
            f"{result['prompts']['count']} held-out prompts of {result['prompts']['prompt_len']} tokens, "
            f"{result['prompts']['max_tokens']} new tokens each ({_decoding(result)}, ignore_eos)")
    columns = ("| config | run | tok/s | speedup | acceptance length | effective AL | per-position acceptance | "
               "draft coverage | = baseline |")
    lines = [head, ""]
    status = result.get("status")
    if status not in (None, "ok", "running"):
        failed = ", ".join(f"{f['name']} ({f['error_type']})" for f in result.get("failed") or [])
        skipped = ", ".join(result.get("skipped") or [])
        lines += [f"**{status}**: " + "; ".join(x for x in (f"failed: {failed}" if failed else "",
                                                             f"skipped: {skipped}" if skipped else "") if x), ""]
    lines += [columns, "|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['config']} | – | {r['status']}: {_fmt(r.get('error'))[:120]} | | | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['run']} | {_fmt(r['output_tok_s'], 0)} | {_fmt(r['speedup'])} | "
                     f"{_fmt(r['acceptance_length'])} | {_fmt(r['effective_acceptance_length'])} | "
                     f"{_fmt(r['per_position'])} | {_fmt(r['draft_coverage'])} | {_fmt(r['match_exact_fraction'])} |")
    if s["eagle3_vs_ngram"]:
        lines += ["", "| K | run | EAGLE-3 AL | n-gram AL | EAGLE-3 effective | n-gram effective | EAGLE-3 better (AL / effective) |",
                  "|---|---|---|---|---|---|---|"]
        for c in s["eagle3_vs_ngram"]:
            lines.append(f"| {c['k']} | {c['run']} | {_fmt(c['eagle3_acceptance_length'])} | "
                         f"{_fmt(c['ngram_acceptance_length'])} | {_fmt(c['eagle3_effective'])} | "
                         f"{_fmt(c['ngram_effective'])} | {c['eagle3_beats_ngram']} / {c['eagle3_beats_ngram_effective']} |")
    rep = result.get("baseline_repetition") or {}
    if rep:
        lines += ["", "What prompt lookup can exploit in the baseline's outputs (the n-gram runs' n range):", "",
                  "| run | tokens | lookup proposes | lookup right | distinct 4-grams | looping outputs |",
                  "|---|---|---|---|---|---|"]
        for run, r in rep.items():
            lines.append(f"| {run} | {r['tokens']} | {_fmt(r['lookup_match_fraction'])} | "
                         f"{_fmt(r['lookup_hit_fraction'])} | {_fmt(r['distinct_4gram_fraction'])} | "
                         f"{r['looping_outputs']} of {r['outputs']} |")
    ceil = result.get("acceptance_ceiling") or {}
    if ceil:
        lines += ["", "What the target lets through along its own sampled outputs (vLLM accepts a proposed "
                  "token with the target's probability of it):", "",
                  "| run | tokens | target top-1 prob | draft AL ceiling per K | lookup proposes | "
                  "lookup accepted with |", "|---|---|---|---|---|---|"]
    if result.get("acceptance_ceiling_error"):
        lines += ["", f"Acceptance ceiling not measured: {_fmt(result['acceptance_ceiling_error'])[:300]}"]
    for run, c in ceil.items():
        al = ", ".join(f"K={k}: {_fmt(v)}" for k, v in c["draft_al_ceiling"].items())
        acc = "–" if c["lookup_accept_prob"] is None else "–".join(_fmt(x) for x in c["lookup_accept_prob"])
        lines.append(f"| {run} | {c['tokens']} | {_fmt(c['top1_prob_mean'])} | {al} | "
                     f"{_fmt(c['lookup_proposal_fraction'])} | {acc} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], png_path: str | os.PathLike[str]) -> Path | None:
    """Acceptance length vs K (EAGLE-3 and n-gram, vLLM's and effective), per-position acceptance,
    and the tok/s speedup per configuration at each batch size. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in (result.get("summary") or summarize(result))["rows"] if r.get("status") == "ok"]
    if not rows:
        return None
    run_names = sorted({r["run"] for r in rows}, key=lambda x: int(x.removeprefix("batch")))
    big = run_names[-1]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    for method, color in (("eagle3", "tab:blue"), ("ngram", "tab:orange")):
        for run, style in ((big, "-"), ("batch1", ":")):
            pts = sorted((r["k"], r["acceptance_length"], r["effective_acceptance_length"])
                         for r in rows if r["method"] == method and r["run"] == run and r["acceptance_length"])
            if pts:
                a.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=color,
                       label=f"{method} {run}")
                if run == big:
                    a.plot([p[0] for p in pts], [p[2] for p in pts], "--", marker="x", color=color,
                           label=f"{method} {run} (effective)")
    a.set(title="acceptance length vs K", xlabel="K (num_speculative_tokens)", ylabel="tokens per step")
    a.xaxis.get_major_locator().set_params(integer=True)
    a.legend(fontsize=7)
    for r in rows:
        if r["run"] == big and r.get("per_position"):
            b.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="o",
                   linestyle="-" if r["method"] == "eagle3" else "--", label=r["config"])
    b.set(title=f"per-position acceptance ({big})", xlabel="draft position", ylabel="accepted / drafts", ylim=(0, 1))
    b.legend(fontsize=7)
    spec_rows = [r for r in rows if r["method"] is not None and r.get("speedup")]
    names = sorted({r["config"] for r in spec_rows}, key=lambda x: (x.split("-")[0], int(x.split("k")[-1])))
    width = 0.8 / max(len(run_names), 1)
    for i, run in enumerate(run_names):
        vals = [next((r["speedup"] for r in spec_rows if r["config"] == n and r["run"] == run), 0.0) for n in names]
        c.bar([j + i * width for j in range(len(names))], vals, width=width, label=run)
    c.axhline(1.0, color="gray", linewidth=0.8)
    c.set_xticks([j + width * (len(run_names) - 1) / 2 for j in range(len(names))], names, rotation=30, fontsize=8)
    c.set(title="output tok/s speedup over no speculation", ylabel="speedup")
    c.legend(fontsize=7)
    fig.suptitle(result.get("label") or "EAGLE-3 evaluation")
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return Path(png_path)
