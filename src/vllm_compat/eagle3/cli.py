"""``vllm-compat eagle3 <step>``: prepare, vocab, train, export, validate, evaluate.

Every step is resumable (rerun the same command) and shows a progress bar. Register it on
an existing parser with :func:`add_parser`, or run ``python -m vllm_compat.eagle3.cli``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _prepare(a: argparse.Namespace) -> int:
    from .prepare import prepare

    rep = prepare(a.input, a.tokenizer, a.output, max_length=a.max_length, chat_template=a.chat_template,
                  trust_remote_code=a.trust_remote_code, progress=not a.no_progress)
    print(json.dumps(rep.to_json(), indent=1))
    return 0 if rep.kept else 1


def _extract(a: argparse.Namespace) -> int:
    import torch

    from .extract_step import extract_dataset

    kw = {}
    if a.backend == "vllm":
        kw = dict(max_num_batched_tokens=a.max_num_batched_tokens, tensor_parallel_size=a.tensor_parallel_size)
        if a.trust_remote_code:
            kw["trust_remote_code"] = True
        if a.engine_kwargs:
            kw.update(json.loads(a.engine_kwargs))
    if a.format == "speculators":
        from .extract_speculators import extract_speculators_dataset

        if a.replicas:
            raise ValueError("--format speculators runs on one replica (start one per node, "
                             "each on its own --max-samples range, or use serve-hidden-states)")
        rep = extract_speculators_dataset(
            a.target, a.prepared, a.output, a.aux_layer_ids, backend=a.backend,
            dtype=getattr(torch, a.dtype), max_samples=a.max_samples,
            progress=not a.no_progress, **kw)
        print(json.dumps(rep))
        return 0
    if a.replicas:
        from .distributed import extract_distributed

        m = extract_distributed(a.target, a.prepared, a.output, a.aux_layer_ids, replicas=a.replicas,
                                gpus_per_replica=a.gpus_per_replica, dtype=getattr(torch, a.dtype),
                                samples_per_shard=a.samples_per_shard, samples_per_unit=a.samples_per_unit,
                                backend=a.backend, ray_address=a.ray_address, **kw)
        print(json.dumps({"samples": m.num_samples, "shards": len(m.shards), "output": a.output}))
        return 0
    n = extract_dataset(a.target, a.prepared, a.output, a.aux_layer_ids, backend=a.backend,
                        dtype=getattr(torch, a.dtype), samples_per_shard=a.samples_per_shard,
                        progress=not a.no_progress, **kw)
    print(json.dumps({"samples": n, "output": a.output}))
    return 0


def _vocab(a: argparse.Namespace) -> int:
    from .target import read_target
    from .vocab import build_vocab

    size = a.target_vocab_size or read_target(a.target).vocab_size
    m = build_vocab(a.dataset, size, draft_vocab_size=a.draft_vocab_size, output_dir=a.output,
                    progress=not a.no_progress)
    print(json.dumps({"draft_vocab_size": m.draft_vocab_size, "target_vocab_size": m.target_vocab_size,
                      "coverage": round(m.coverage, 6), "output": a.output}))
    return 0


def _train(a: argparse.Namespace) -> int:
    from .online_args import online_config
    from .training import TrainConfig, train

    online = online_config(a)  # checked before anything loads

    cfg = TrainConfig(
        dataset=a.dataset, target=a.target, vocab=a.vocab, output_dir=a.output, epochs=a.epochs,
        max_steps=a.max_steps, batch_size=a.batch_size, ttt_steps=a.ttt_steps, ttt_decay=a.ttt_decay,
        lr=a.lr, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps, grad_clip=a.grad_clip,
        dtype=a.dtype, seed=a.seed, checkpoint_every=a.checkpoint_every, progress=not a.no_progress,
    )
    if online is not None:  # the states extracted while training, not read from shards
        from .online import train_online

        res = train_online(cfg, online, resume=not a.no_resume)
    else:
        res = train(cfg, resume=not a.no_resume)
    if res.rank == 0:
        print(json.dumps({"step": res.step, "output": res.output_dir, **res.last_metrics}))
    return 0


def _export(a: argparse.Namespace) -> int:
    from .export import export

    out = export(a.trained, a.target, a.output, verifier=a.verifier, speculative_tokens=a.speculative_tokens,
                 dtype=a.dtype)
    print(out)
    return 0


def _validate(a: argparse.Namespace) -> int:
    from .validate import validate

    with_vllm = False if a.no_vllm else None
    rep = validate(a.checkpoint, a.target, with_vllm=with_vllm, raise_on_error=False)
    for p in rep.problems:
        print(f"{'error' if p.error else 'warning'} [{p.code}] {p.message}", file=sys.stderr)
    where = f"vLLM {rep.serving.vllm_version}" if rep.serving else "rules only (vLLM not used)"
    print(f"{'OK' if rep.ok else 'FAILED'}: {rep.checkpoint} ({where})")
    return 0 if rep.ok else 1


def _evaluate(a: argparse.Namespace) -> int:
    from .evaluate import EvalConfig, evaluate

    cfg = EvalConfig(
        target=a.target, draft=a.draft, prompts_file=a.prompts, output_dir=a.output, ks=a.k,
        ngram_ks=a.ngram_k, prompt_lookup_min=a.prompt_lookup_min, prompt_lookup_max=a.prompt_lookup_max,
        prompt_len=a.prompt_len, max_tokens=a.max_tokens, batch_prompts=a.batch_prompts,
        batch1_prompts=a.batch1_prompts, enforce_eager=a.enforce_eager,
        gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=a.max_model_len,
        engine_kwargs=json.loads(a.engine_kwargs) if a.engine_kwargs else {}, budget_s=a.budget_s,
        baseline=not a.no_baseline, trust_remote_code=a.trust_remote_code,
    )
    res = evaluate(cfg, raise_on_error=False)
    print(json.dumps(res["summary"]["eagle3_vs_ngram"], indent=1))
    for name in res["skipped"]:
        print(f"evaluate: {name} skipped (time budget)", file=sys.stderr)
    if not res["failed"]:
        return 0
    for f in res["failed"]:
        print(f"evaluate: {f['name']} FAILED: {f['error']}", file=sys.stderr)
    print(f"evaluate: {len(res['failed'])} of {len(res['configs'])} configurations failed "
          f"({res['status']}); measured ones are in {a.output}", file=sys.stderr)
    return 1


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``eagle3`` and its steps on ``subparsers``."""
    p = subparsers.add_parser("eagle3", help="EAGLE-3 draft pipeline: prepare, extract, vocab, train, export, validate")
    steps = p.add_subparsers(dest="eagle3_step", required=True)

    s = steps.add_parser("prepare", help="chat/completion JSONL -> token ids + assistant loss mask")
    s.add_argument("input", help="JSONL file")
    s.add_argument("--tokenizer", required=True, help="local tokenizer directory")
    s.add_argument("--chat-template", help="template text or file (default: the tokenizer's)")
    s.add_argument("--max-length", type=int, default=4096)
    s.add_argument("--output", "-o", required=True)
    s.add_argument("--trust-remote-code", action="store_true",
                   help="run a tokenizer the checkpoint ships as code (Kimi-K2.5's)")
    s.set_defaults(func=_prepare)

    s = steps.add_parser("extract", help="hidden states of the prepare output -> shard dataset, or "
                                         "speculators 0.5-0.9's hs_{i}.safetensors (resumable)")
    s.add_argument("prepared", help="prepare output directory (--format speculators: speculators' "
                                    "prepare-data output)")
    s.add_argument("--format", choices=("shards", "speculators"), default="shards",
                   help="speculators: one hs_{row}.safetensors per row of speculators' prepare-data "
                        "output, as generate-offline-data writes them (default: shards)")
    s.add_argument("--max-samples", type=int, help="--format speculators: the first N rows only")
    s.add_argument("--target", required=True, help="target model directory")
    s.add_argument("--output", "-o", required=True)
    s.add_argument("--aux-layer-ids", type=int, nargs="+", help="default: EAGLE-3's (2, L//2, L-3)")
    s.add_argument("--backend", choices=("vllm", "transformers"), default="vllm")
    s.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float8_e4m3fn"), default="bfloat16",
                   help="float8_e4m3fn: FP8 with a float32 scale per token and layer (half the bytes)")
    s.add_argument("--samples-per-shard", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int)
    s.add_argument("--tensor-parallel-size", type=int, default=1)
    s.add_argument("--trust-remote-code", action="store_true",
                   help="let vLLM run the tokenizer / processor code the checkpoint ships (Kimi-K2.5 "
                        "before vLLM 0.21 loads them at engine start)")
    s.add_argument("--engine-kwargs", help="JSON of more vllm.LLM keywords, e.g. '{\"kv_cache_memory_bytes\": 8000000000}'")
    g = s.add_argument_group("over many replicas with Ray (pip install 'vllm-compat[ray]')")
    g.add_argument("--replicas", type=int, help="extract over this many Ray actors, each writing whole units")
    g.add_argument("--gpus-per-replica", type=float, help="Ray num_gpus per replica (default: --tensor-parallel-size)")
    g.add_argument("--samples-per-unit", type=int, help="records per work unit (default: 4 shards)")
    g.add_argument("--ray-address", help="ray.init address ('auto': the running cluster; default: start one here)")
    s.set_defaults(func=_extract)

    s = steps.add_parser("vocab", help="draft vocabulary (d2t/t2d) from loss-masked token counts")
    s.add_argument("dataset", help="hidden-state dataset or prepare output directory")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--target", help="target checkpoint directory (its vocab_size)")
    g.add_argument("--target-vocab-size", type=int)
    s.add_argument("--draft-vocab-size", type=int, default=32000)
    s.add_argument("--output", "-o", required=True)
    s.set_defaults(func=_vocab)

    s = steps.add_parser("train", help="train the draft with training-time test (torchrun for DDP)")
    s.add_argument("dataset")
    s.add_argument("--target", required=True)
    s.add_argument("--vocab", required=True, help="vocab output directory")
    s.add_argument("--output", "-o", required=True)
    s.add_argument("--epochs", type=int, default=1)
    s.add_argument("--max-steps", type=int)
    s.add_argument("--batch-size", type=int, default=1)
    s.add_argument("--ttt-steps", type=int, default=3)
    s.add_argument("--ttt-decay", type=float, default=1.0)
    s.add_argument("--lr", type=float, default=1e-4)
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--warmup-steps", type=int, default=0)
    s.add_argument("--grad-clip", type=float, default=1.0)
    s.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--checkpoint-every", type=int, default=100)
    s.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    from .online_args import add_online_arguments

    add_online_arguments(s)
    s.set_defaults(func=_train)

    s = steps.add_parser("export", help="write a speculators-format checkpoint for vllm serve")
    s.add_argument("trained", help="train output directory")
    s.add_argument("--target", required=True)
    s.add_argument("--verifier", help="verifier.name_or_path (default: the target directory)")
    s.add_argument("--speculative-tokens", type=int, default=3)
    s.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    s.add_argument("--output", "-o", required=True)
    s.set_defaults(func=_export)

    s = steps.add_parser("validate", help="check a checkpoint against its target and the installed vLLM")
    s.add_argument("checkpoint")
    s.add_argument("--target", help="target directory (default: verifier.name_or_path if local)")
    s.add_argument("--no-vllm", action="store_true", help="rule checks only, even if vLLM is installed")
    s.set_defaults(func=_validate)

    s = steps.add_parser("evaluate", help="serve target + draft with vLLM spec decoding: acceptance, tok/s vs n-gram")
    s.add_argument("target", help="target model directory (with its tokenizer)")
    s.add_argument("--draft", help="exported EAGLE-3 draft directory (omit: baseline and n-gram only)")
    s.add_argument("--prompts", required=True, help="held-out chunks JSONL ({prompt, completion}), e.g. corpus eval.jsonl")
    s.add_argument("--output", "-o", required=True)
    s.add_argument("--k", type=int, nargs="+", default=[3, 1, 5], help="EAGLE-3 K's, in run order")
    s.add_argument("--ngram-k", type=int, nargs="*", default=[3, 1, 5], help="n-gram K's")
    s.add_argument("--prompt-lookup-min", type=int, default=2)
    s.add_argument("--prompt-lookup-max", type=int, default=5)
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--batch-prompts", type=int, default=32, help="the batched run: this many prompts at once")
    s.add_argument("--batch1-prompts", type=int, default=8, help="the batch-1 run: this many, one at a time")
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    s.add_argument("--max-model-len", type=int, default=1024)
    s.add_argument("--engine-kwargs", help="JSON: more vllm.LLM keywords")
    s.add_argument("--budget-s", type=float, help="skip configurations that would not finish within this many seconds")
    s.add_argument("--no-baseline", action="store_true")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="run the tokenizer / processor code the target ships (Kimi-K2.5), here and in vLLM")
    s.set_defaults(func=_evaluate)

    for name, sp in steps.choices.items():
        if name not in ("validate", "evaluate"):
            sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-compat")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
