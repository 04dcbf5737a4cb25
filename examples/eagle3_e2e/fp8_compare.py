"""FP8 against bf16 storage of the draft's training states: the same data, the same seed, two
drafts, vLLM's acceptance length for each.

    python -m examples.eagle3_e2e.fp8_compare --work W --out O [--draft-steps 600]

Runs after the end-to-end demo's ``pipeline`` phase on the same work directory (it reads
``W/llama/{target,ds,vocab}`` and ``W/corpus/eval.jsonl``):

1. ``W/llama/ds`` (bf16) is stored again as FP8 (``W/llama/ds_fp8``: float8_e4m3fn with a
   float32 scale per token and layer, written by ``ShardWriter``; the bytes the extractor
   writes with ``dtype=torch.float8_e4m3fn``, as the encoding is exact arithmetic). Only
   the storage differs between the two datasets.
2. One draft is trained on each, from the same seed, in the same sample order, for
   ``--draft-steps`` steps (the demo's other training settings).
3. Each is exported and served by vLLM beside the target (EAGLE-3, K = ``--k``); the
   acceptance length is vLLM's (1 + accepted / drafted) at batch 1 and batch 32.

Writes ``O/fp8_compare.json`` and ``O/fp8_compare.md``: both acceptance lengths, their
ratio, whether FP8 is within ``--tolerance`` (2 %) of bf16, the training metrics, and the
FP8 dataset's decoding error.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch


def convert(src: Path, dst: Path, samples_per_shard: int = 256) -> dict[str, Any]:
    """``src`` stored again as FP8 in ``dst``; returns sizes, time and the decoded states'
    relative error per layer (norm of the difference over the norm, all tokens)."""
    from vllm_compat.eagle3.data import BackgroundShardWriter, HiddenStatesDataset, ShardWriter
    from vllm_compat.extract import fp8

    t0 = time.perf_counter()
    ds = HiddenStatesDataset(src, decode_dtype=None)
    m = ds.manifest
    if m.is_fp8:
        raise ValueError(f"{src} is already FP8")
    shutil.rmtree(dst, ignore_errors=True)
    w = BackgroundShardWriter(ShardWriter(
        dst, hidden_size=m.hidden_size, aux_layer_ids=m.aux_layer_ids, final_layer_id=m.final_layer_id,
        dtype=fp8.FP8_DTYPE, samples_per_shard=samples_per_shard, target=m.target))
    err = torch.zeros(len(m.layer_ids), dtype=torch.float64)
    ref = torch.zeros(len(m.layer_ids), dtype=torch.float64)
    for s in ds:
        x = s["hidden_states"]
        q, scale = fp8.encode(x)
        d = fp8.decode(q, scale, torch.float32) - x.float()
        err += d.pow(2).sum(dim=(0, 2)).double()
        ref += x.float().pow(2).sum(dim=(0, 2)).double()
        w.add({**s, "hidden_states": q, fp8.SCALE_KEY: scale})
    out = w.close()
    size = {p: sum(f.stat().st_size for f in Path(p).rglob("*.safetensors")) for p in (src, dst)}
    return {"samples": out.num_samples, "tokens": out.num_tokens, "bf16_bytes": size[src],
            "fp8_bytes": size[dst], "seconds": round(time.perf_counter() - t0, 2),
            "rel_error_per_layer": [round(float(v), 5) for v in (err / ref).sqrt()],
            "layer_ids": m.layer_ids}


def train_one(dataset: Path, target: Path, vocab: Path, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    from vllm_compat.eagle3.data import HiddenStatesDataset
    from vllm_compat.eagle3.export import export
    from vllm_compat.eagle3.training import TrainConfig, train

    n = len(HiddenStatesDataset(dataset))
    per_epoch = n // a.draft_batch
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig(dataset=str(dataset), target=str(target), vocab=str(vocab), output_dir=str(out / "run"),
                      batch_size=a.draft_batch, ttt_steps=a.ttt_steps, lr=a.draft_lr, warmup_steps=a.draft_warmup,
                      min_lr_ratio=0.1, dtype="bf16" if torch.cuda.is_available() else "fp32", seed=a.seed,
                      epochs=max(1, math.ceil(a.draft_steps / per_epoch)), max_steps=a.draft_steps,
                      schedule_steps=a.draft_steps, checkpoint_every=10 ** 9, progress=False, tensorboard=False)
    t0 = time.perf_counter()
    res = train(cfg, resume=False)
    train_s = time.perf_counter() - t0
    export(out / "run", target, out / "draft", speculative_tokens=a.k)
    return {"steps": res.step, "train_s": round(train_s, 1), "last": res.last_metrics,
            "draft": str(out / "draft")}


def evaluate_one(draft: Path, target: Path, eval_prompts: Path, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    from vllm_compat.eagle3.evaluate import EvalConfig, evaluate

    res = evaluate(EvalConfig(target=str(target), draft=str(draft), prompts_file=str(eval_prompts),
                              output_dir=str(out), ks=[a.k], ngram_ks=[], baseline=False,
                              enforce_eager=a.enforce_eager, label="fp8 vs bf16",
                              engine_kwargs=json.loads(a.engine_kwargs) if a.engine_kwargs else {}),
                   log=print)
    [entry] = res["configs"]
    if entry.get("status") != "ok":
        raise RuntimeError(f"evaluating {draft}: {entry.get('error')}")
    return {run: (r.get("spec") or {}).get("acceptance_length") for run, r in entry["runs"].items()}


def compare(al: dict[str, dict[str, float | None]], tolerance: float) -> dict[str, Any]:
    """FP8's acceptance length over bf16's per run; ``within`` when every ratio is at least
    ``1 - tolerance``."""
    ratio = {run: (al["fp8"][run] / v if v and al["fp8"].get(run) else None)
             for run, v in al["bf16"].items()}
    ok = [r is not None and r >= 1 - tolerance for r in ratio.values()]
    return {"ratio": ratio, "tolerance": tolerance, "within": bool(ok) and all(ok)}


def report_md(res: dict[str, Any]) -> str:
    c = res["comparison"]
    lines = ["| storage | " + " | ".join(f"AL {run}" for run in res["acceptance_length"]["bf16"]) +
             " | last loss | train s |", "|---|" + "---|" * (len(c["ratio"]) + 2)]
    for dt in ("bf16", "fp8"):
        al = res["acceptance_length"][dt]
        tr = res["train"][dt]
        lines.append(f"| {dt} | " + " | ".join(f"{v:.3f}" if v else "-" for v in al.values()) +
                     f" | {tr['last'].get('loss', float('nan')):.4f} | {tr['train_s']} |")
    lines.append("| fp8 / bf16 | " + " | ".join(f"{v:.4f}" if v else "-" for v in c["ratio"].values()) +
                 " | | |")
    conv = res["conversion"]
    lines += ["", f"FP8 within {c['tolerance']:.0%} of bf16: **{c['within']}**. FP8 dataset "
                  f"{conv['fp8_bytes'] / 1e9:.2f} GB against {conv['bf16_bytes'] / 1e9:.2f} GB; decoded "
                  f"states' relative error per layer {conv['rel_error_per_layer']} (layers "
                  f"{conv['layer_ids']})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.eagle3_e2e.fp8_compare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="the demo's work directory, after its pipeline phase")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-steps", type=int, default=600)
    ap.add_argument("--draft-batch", type=int, default=32)
    ap.add_argument("--draft-lr", type=float, default=7e-4)
    ap.add_argument("--draft-warmup", type=int, default=100)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--k", type=int, default=3, help="speculative tokens served")
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--enforce-eager", action="store_true", help="serve without CUDA graphs (faster start)")
    ap.add_argument("--engine-kwargs", help="JSON: more vllm.LLM keywords, e.g. a fixed kv_cache_memory_bytes "
                                            "where other processes share the GPU")
    a = ap.parse_args(argv)
    work, out = Path(a.work), Path(a.out)
    mdir = work / a.model
    target = (work / "llama" / "target") if a.model == "llama" else (mdir / "target")
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"settings": vars(a), "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def save() -> None:
        (out / "fp8_compare.json").write_text(json.dumps(res, indent=1, default=str) + "\n")

    res["conversion"] = convert(mdir / "ds", mdir / "ds_fp8")
    save()
    res["train"], res["acceptance_length"] = {}, {}
    for dt, ds in (("bf16", mdir / "ds"), ("fp8", mdir / "ds_fp8")):
        res["train"][dt] = train_one(ds, target, mdir / "vocab", mdir / f"compare_{dt}", a)
        save()
    for dt in ("bf16", "fp8"):
        res["acceptance_length"][dt] = evaluate_one(Path(res["train"][dt]["draft"]), target,
                                                    work / "corpus" / "eval.jsonl",
                                                    mdir / f"compare_{dt}" / "eval", a)
        save()
    res["comparison"] = compare(res["acceptance_length"], a.tolerance)
    save()
    (out / "fp8_compare.md").write_text(report_md(res))
    print(report_md(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
