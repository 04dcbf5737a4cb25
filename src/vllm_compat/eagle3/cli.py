"""``vllm-compat eagle3 <step>``: prepare, vocab, train, export, validate, evaluate.

Every step is resumable (rerun the same command) and shows a progress bar. Register it on
an existing parser with :func:`add_parser`, or run ``python -m vllm_compat.eagle3.cli``.
Errors, Ctrl-C and outputs follow :mod:`vllm_compat.cli_errors`: arguments are checked when
parsed, each step writes ``<output>.partial`` and renames it when done.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..cli_args import (
    check_layer_ids,
    existing_dir,
    json_object,
    jsonl_file,
    model_dir,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    require_any,
    tokenizer_dir,
    unit_interval,
)
from ..cli_errors import ContractParser, UsageError, print_commands, run_command
from ..cli_output import describe_progress, partial_output

if TYPE_CHECKING:
    from .online_args import OnlineConfig

PREPARE_OUTPUT = ("prepared.jsonl",)
DATASET = ("manifest.json",)
# what `datasets.Dataset.save_to_disk` writes (speculators' prepare-data output)
HF_DATASET = ("state.json", "dataset_dict.json")
TRAIN_OUTPUT = ("final", "checkpoints", "model.safetensors")


def _prepare(a: argparse.Namespace) -> int:
    from .prepare import prepare

    with partial_output(a.output) as out:
        rep = prepare(a.input, a.tokenizer, out, max_length=a.max_length,
                      chat_template=a.chat_template, trust_remote_code=a.trust_remote_code,
                      progress=not a.no_progress)
        if not rep.kept:
            raise UsageError(f"{a.input}: none of its records was kept (skipped: "
                             f"{json.dumps(rep.to_json().get('skipped', {}))})",
                             "records are chats ({\"messages\": [...]}, {\"conversations\": "
                             "[...]}) or {\"prompt\", \"completion\"}; template_error: give "
                             "--chat-template (docs/eagle3.md, prepare)")
    print(json.dumps(rep.to_json(), indent=1))
    return 0


def vllm_can_run() -> tuple[bool, str]:
    """Whether vLLM can extract here, and why not: it needs to be installed and a CUDA GPU
    (or vLLM's CPU build, whose version carries ``+cpu``)."""
    if importlib.util.find_spec("vllm") is None:
        return False, "vLLM is not installed"
    import torch

    if torch.cuda.is_available():
        return True, ""
    try:
        if "cpu" in importlib.metadata.version("vllm"):
            return True, ""
    except importlib.metadata.PackageNotFoundError:
        pass
    return False, "no CUDA GPU is visible"


VLLM_ONLY = ("max_num_batched_tokens", "engine_kwargs")


def _extract_backend(a: argparse.Namespace) -> str:
    """``--backend auto``: vLLM where it can run, transformers (CPU) elsewhere."""
    vllm_flags = [f"--{k.replace('_', '-')}" for k in VLLM_ONLY if getattr(a, k)]
    if a.tensor_parallel_size != 1:
        vllm_flags.append("--tensor-parallel-size")
    if a.backend == "transformers":
        if vllm_flags:
            raise UsageError(f"{' '.join(vllm_flags)} configure vLLM, which --backend "
                             "transformers does not use", "drop them, or use --backend vllm")
        return "transformers"
    ok, why = vllm_can_run()
    if ok:
        return "vllm"
    if a.backend == "vllm" or vllm_flags:
        asked = "--backend vllm" if a.backend == "vllm" else " ".join(vllm_flags)
        raise UsageError(f"{asked} needs vLLM on a GPU, and {why}",
                         "run on a machine with a CUDA GPU, or use --backend transformers (CPU)")
    print(f"vllm-compat eagle3 extract: {why}; using --backend transformers (CPU)",
          file=sys.stderr)
    return "transformers"


def _check_extract(a: argparse.Namespace) -> None:
    speculators = a.format == "speculators"
    if speculators:
        require_any(a.prepared, HF_DATASET, "speculators' prepare-data output (a datasets "
                    "directory)", "run speculators' prepare-data first, or use --format shards "
                    "with `vllm-compat eagle3 prepare` output")
        if a.replicas:
            raise UsageError("--format speculators runs on one replica; --replicas is for "
                             "--format shards", "start one extract per node, each on its own "
                             "--max-samples range, or use serve-hidden-states")
    else:
        require_any(a.prepared, PREPARE_OUTPUT, "an `eagle3 prepare` output directory",
                    "run `vllm-compat eagle3 prepare` first (or pass --format speculators for "
                    "speculators' prepare-data output)")
        if a.max_samples is not None:
            raise UsageError("--max-samples applies to --format speculators only")
    ray_only = [f for f, v in (("--gpus-per-replica", a.gpus_per_replica),
                               ("--samples-per-unit", a.samples_per_unit),
                               ("--ray-address", a.ray_address)) if v is not None]
    if ray_only and not a.replicas:
        raise UsageError(f"{' '.join(ray_only)} need --replicas N (extraction over Ray)")
    check_layer_ids(a.aux_layer_ids, "--aux-layer-ids", a.target, final_allowed=speculators)


def _extract(a: argparse.Namespace) -> int:
    import torch

    from .extract_step import extract_dataset

    _check_extract(a)
    backend = _extract_backend(a)
    kw = {}
    if backend == "vllm":
        kw = dict(max_num_batched_tokens=a.max_num_batched_tokens, tensor_parallel_size=a.tensor_parallel_size)
        if a.trust_remote_code:
            kw["trust_remote_code"] = True
        if a.engine_kwargs:
            kw.update(a.engine_kwargs)
    with partial_output(a.output) as out:
        if a.format == "speculators":
            from .extract_speculators import extract_speculators_dataset

            rep = extract_speculators_dataset(
                a.target, a.prepared, out, a.aux_layer_ids, backend=backend,
                dtype=getattr(torch, a.dtype), max_samples=a.max_samples,
                progress=not a.no_progress, **kw)
            result = dict(rep, output=a.output)
        elif a.replicas:
            from .distributed import extract_distributed

            m = extract_distributed(a.target, a.prepared, str(out), a.aux_layer_ids,
                                    replicas=a.replicas, gpus_per_replica=a.gpus_per_replica,
                                    dtype=getattr(torch, a.dtype),
                                    samples_per_shard=a.samples_per_shard,
                                    samples_per_unit=a.samples_per_unit, backend=backend,
                                    ray_address=a.ray_address, **kw)
            result = {"samples": m.num_samples, "shards": len(m.shards), "output": a.output}
        else:
            n = extract_dataset(a.target, a.prepared, out, a.aux_layer_ids, backend=backend,
                                dtype=getattr(torch, a.dtype), samples_per_shard=a.samples_per_shard,
                                progress=not a.no_progress, **kw)
            result = {"samples": n, "output": a.output}
    print(json.dumps(result))
    return 0


def _vocab(a: argparse.Namespace) -> int:
    from .target import read_target
    from .vocab import build_vocab

    require_any(a.dataset, DATASET + PREPARE_OUTPUT, "a hidden-state dataset or an `eagle3 "
                "prepare` output directory", "pass the output of `eagle3 extract` (or prepare)")
    size = a.target_vocab_size or read_target(a.target).vocab_size
    with partial_output(a.output) as out:
        m = build_vocab(a.dataset, size, draft_vocab_size=a.draft_vocab_size, output_dir=out,
                        progress=not a.no_progress)
    print(json.dumps({"draft_vocab_size": m.draft_vocab_size, "target_vocab_size": m.target_vocab_size,
                      "coverage": round(m.coverage, 6), "output": a.output}))
    return 0


def _train(a: argparse.Namespace) -> int:
    from .online_args import online_config

    try:  # checked before anything loads
        online = online_config(a)
    except ValueError as exc:  # contradictory or out-of-range online options
        raise UsageError(str(exc), "see `vllm-compat eagle3 train --help` (online training)") from exc
    if online is None:  # online training reads a `prepare` output and extracts as it goes
        require_any(a.dataset, DATASET, "a hidden-state dataset", "pass the output of "
                    "`vllm-compat eagle3 extract`, or add --online to extract while training")
    require_any(a.vocab, ("vocab.safetensors",), "an `eagle3 vocab` output directory")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: every rank writes one directory
        return _train_into(a, a.output, online)
    with partial_output(a.output) as out:
        return _train_into(a, str(out), online)


def _train_into(a: argparse.Namespace, output_dir: str, online: OnlineConfig | None) -> int:
    from .training import TrainConfig, train

    cfg = TrainConfig(
        dataset=a.dataset, target=a.target, vocab=a.vocab, output_dir=output_dir, epochs=a.epochs,
        max_steps=a.max_steps, schedule_steps=a.schedule_steps, batch_size=a.batch_size,
        ttt_steps=a.ttt_steps, ttt_decay=a.ttt_decay,
        lr=a.lr, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps, grad_clip=a.grad_clip,
        dtype=a.dtype, seed=a.seed, checkpoint_every=a.checkpoint_every, progress=not a.no_progress,
    )
    if online is not None:  # the states extracted while training, not read from shards
        from .online import train_online

        res = train_online(cfg, online, resume=not a.no_resume)
    else:
        res = train(cfg, resume=not a.no_resume)
    if res.rank == 0:
        print(json.dumps({"step": res.step, "output": a.output, **res.last_metrics}))
    return 0


def _export(a: argparse.Namespace) -> int:
    from .export import export

    require_any(a.trained, TRAIN_OUTPUT, "an `eagle3 train` output directory")
    with partial_output(a.output) as out:
        export(a.trained, a.target, out, verifier=a.verifier,
               speculative_tokens=a.speculative_tokens, dtype=a.dtype)
    print(os.path.normpath(a.output))
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
    if a.top_p < 1.0 and a.temperature == 0:  # greedy decoding has no nucleus to narrow
        raise UsageError(f"--top-p {a.top_p:g} only applies to sampled runs",
                         "add --temperature T (above 0), or drop --top-p")
    if a.acceptance_ceiling and a.temperature == 0:  # greedy verification accepts exact matches only
        raise UsageError("--acceptance-ceiling measures sampled runs",
                         "add --temperature T (above 0), or drop --acceptance-ceiling")
    ok, why = vllm_can_run()
    if not ok:
        raise UsageError(f"evaluate serves the target with vLLM, and {why}",
                         "run it on a machine with a CUDA GPU and vLLM installed")
    with partial_output(a.output) as out:
        return _evaluate_into(a, str(out))


def _evaluate_into(a: argparse.Namespace, output_dir: str) -> int:
    from .evaluate import EvalConfig, evaluate

    cfg = EvalConfig(
        target=a.target, draft=a.draft, prompts_file=a.prompts, output_dir=output_dir, ks=a.k,
        ngram_ks=a.ngram_k, prompt_lookup_min=a.prompt_lookup_min, prompt_lookup_max=a.prompt_lookup_max,
        prompt_len=a.prompt_len, max_tokens=a.max_tokens, batch_prompts=a.batch_prompts,
        batch1_prompts=a.batch1_prompts, enforce_eager=a.enforce_eager,
        gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=a.max_model_len,
        engine_kwargs=a.engine_kwargs or {}, budget_s=a.budget_s,
        baseline=not a.no_baseline, trust_remote_code=a.trust_remote_code,
        temperature=a.temperature, seed=a.seed, top_p=a.top_p, acceptance_ceiling=a.acceptance_ceiling,
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


def _add_train_parser(steps: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``eagle3 train``; its own function so that training modes add their flags here."""
    s = steps.add_parser("train", help="train the draft with training-time test (torchrun for DDP)")
    s.add_argument("dataset", type=existing_dir,
                   help="hidden-state dataset (`eagle3 extract` output); with --online, a `prepare` output")
    s.add_argument("--target", required=True, type=model_dir)
    s.add_argument("--vocab", required=True, type=existing_dir, help="vocab output directory")
    s.add_argument("--output", "-o", required=True)
    s.add_argument("--epochs", type=positive_int, default=1)
    s.add_argument("--max-steps", type=positive_int, help="stop after this many steps (the schedule keeps its length)")
    s.add_argument("--schedule-steps", type=positive_int,
                   help="the learning-rate schedule's length (default: all epochs); "
                        "equal to --max-steps, the cosine ends where the run stops")
    s.add_argument("--batch-size", type=positive_int, default=1)
    s.add_argument("--ttt-steps", type=positive_int, default=3)
    s.add_argument("--ttt-decay", type=float, default=1.0)
    s.add_argument("--lr", type=float, default=1e-4)
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--warmup-steps", type=non_negative_int, default=0)
    s.add_argument("--grad-clip", type=float, default=1.0)
    s.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    s.add_argument("--seed", type=non_negative_int, default=0)
    s.add_argument("--checkpoint-every", type=positive_int, default=100)
    s.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    from .online_args import add_online_arguments

    add_online_arguments(s)
    s.set_defaults(func=_train)
    return s


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``eagle3`` and its steps on ``subparsers``."""
    p = subparsers.add_parser("eagle3", help="EAGLE-3 draft pipeline: prepare, extract, vocab, train, export, validate")
    p.set_defaults(func=lambda _a: print_commands(p))  # `vllm-compat eagle3` alone
    steps = p.add_subparsers(dest="eagle3_step", metavar="<step>")

    s = steps.add_parser("prepare", help="chat/completion JSONL -> token ids + assistant loss mask")
    s.add_argument("input", type=jsonl_file, help="JSONL file")
    s.add_argument("--tokenizer", required=True, type=tokenizer_dir, help="local tokenizer directory")
    s.add_argument("--chat-template", help="template text or file (default: the tokenizer's)")
    s.add_argument("--max-length", type=positive_int, default=4096)
    s.add_argument("--output", "-o", required=True)
    s.add_argument("--trust-remote-code", action="store_true",
                   help="run a tokenizer the checkpoint ships as code (Kimi-K2.5's)")
    s.set_defaults(func=_prepare)

    s = steps.add_parser("extract", help="hidden states of the prepare output -> shard dataset, or "
                                         "speculators 0.5-0.9's hs_{i}.safetensors (resumable)")
    s.add_argument("prepared", type=existing_dir, help="prepare output directory (--format speculators: speculators' "
                                    "prepare-data output)")
    s.add_argument("--format", choices=("shards", "speculators"), default="shards",
                   help="speculators: one hs_{row}.safetensors per row of speculators' prepare-data "
                        "output, as generate-offline-data writes them (default: shards)")
    s.add_argument("--max-samples", type=positive_int, help="--format speculators: the first N rows only")
    s.add_argument("--target", required=True, type=model_dir, help="target model directory")
    s.add_argument("--output", "-o", required=True)
    s.add_argument("--aux-layer-ids", type=non_negative_int, nargs="+",
                   help="increasing, below the target's layer count (default: EAGLE-3's 2, L//2, L-3)")
    s.add_argument("--backend", choices=("auto", "vllm", "transformers"), default="auto",
                   help="auto (default): vLLM where it can run (a CUDA GPU), else transformers on "
                        "the CPU")
    s.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float8_e4m3fn"), default="bfloat16",
                   help="float8_e4m3fn: FP8 with a float32 scale per token and layer (half the bytes)")
    s.add_argument("--samples-per-shard", type=positive_int, default=256)
    s.add_argument("--max-num-batched-tokens", type=positive_int)
    s.add_argument("--tensor-parallel-size", type=positive_int, default=1)
    s.add_argument("--trust-remote-code", action="store_true",
                   help="let vLLM run the tokenizer / processor code the checkpoint ships (Kimi-K2.5 "
                        "before vLLM 0.21 loads them at engine start)")
    s.add_argument("--engine-kwargs", type=json_object,
                   help="JSON of more vllm.LLM keywords, e.g. '{\"kv_cache_memory_bytes\": 8000000000}'")
    g = s.add_argument_group("over many replicas with Ray (pip install 'vllm-compat[ray]')")
    g.add_argument("--replicas", type=positive_int, help="extract over this many Ray actors, each writing whole units")
    g.add_argument("--gpus-per-replica", type=positive_float, help="Ray num_gpus per replica (default: --tensor-parallel-size)")
    g.add_argument("--samples-per-unit", type=positive_int, help="records per work unit (default: 4 shards)")
    g.add_argument("--ray-address", help="ray.init address ('auto': the running cluster; default: start one here)")
    s.set_defaults(func=_extract)

    s = steps.add_parser("vocab", help="draft vocabulary (d2t/t2d) from loss-masked token counts")
    s.add_argument("dataset", type=existing_dir, help="hidden-state dataset or prepare output directory")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--target", type=model_dir, help="target checkpoint directory (its vocab_size)")
    g.add_argument("--target-vocab-size", type=positive_int)
    s.add_argument("--draft-vocab-size", type=positive_int, default=32000)
    s.add_argument("--output", "-o", required=True)
    s.set_defaults(func=_vocab)

    _add_train_parser(steps)

    s = steps.add_parser("export", help="write a speculators-format checkpoint for vllm serve")
    s.add_argument("trained", type=existing_dir, help="train output directory")
    s.add_argument("--target", required=True, type=model_dir)
    s.add_argument("--verifier", help="verifier.name_or_path (default: the target directory)")
    s.add_argument("--speculative-tokens", type=positive_int, default=3)
    s.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    s.add_argument("--output", "-o", required=True)
    s.set_defaults(func=_export)

    s = steps.add_parser("validate", help="check a checkpoint against its target and the installed vLLM")
    s.add_argument("checkpoint", type=model_dir)
    s.add_argument("--target", type=model_dir, help="target directory (default: verifier.name_or_path if local)")
    s.add_argument("--no-vllm", action="store_true", help="rule checks only, even if vLLM is installed")
    s.set_defaults(func=_validate)

    s = steps.add_parser("evaluate", help="serve target + draft with vLLM spec decoding: acceptance, tok/s vs n-gram")
    s.add_argument("target", type=model_dir, help="target model directory (with its tokenizer)")
    s.add_argument("--draft", type=model_dir, help="exported EAGLE-3 draft directory (omit: baseline and n-gram only)")
    s.add_argument("--prompts", required=True, type=jsonl_file, help="held-out chunks JSONL ({prompt, completion}), e.g. corpus eval.jsonl")
    s.add_argument("--output", "-o", required=True)
    s.add_argument("--k", type=positive_int, nargs="+", default=[3, 1, 5], help="EAGLE-3 K's, in run order")
    s.add_argument("--ngram-k", type=positive_int, nargs="*", default=[3, 1, 5], help="n-gram K's")
    s.add_argument("--prompt-lookup-min", type=positive_int, default=2)
    s.add_argument("--prompt-lookup-max", type=positive_int, default=5)
    s.add_argument("--prompt-len", type=positive_int, default=128)
    s.add_argument("--max-tokens", type=positive_int, default=256)
    s.add_argument("--batch-prompts", type=positive_int, default=32, help="the batched run: this many prompts at once")
    s.add_argument("--batch1-prompts", type=positive_int, default=8, help="the batch-1 run: this many, one at a time")
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--gpu-memory-utilization", type=positive_float, default=0.25)
    s.add_argument("--max-model-len", type=positive_int, default=1024)
    s.add_argument("--engine-kwargs", type=json_object, help="JSON: more vllm.LLM keywords")
    s.add_argument("--budget-s", type=positive_float, help="skip configurations that would not finish within this many seconds")
    s.add_argument("--no-baseline", action="store_true")
    s.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0: greedy; above 0: sampled, prompt i with seed --seed + i in every configuration")
    s.add_argument("--seed", type=non_negative_int, default=0)
    s.add_argument("--top-p", type=unit_interval, default=1.0,
                   help="sampled runs: keep the smallest set of tokens whose probability reaches this (Kimi-K2.5: 0.95)")
    s.add_argument("--acceptance-ceiling", action="store_true",
                   help="sampled runs: also measure the target's top-20 logprobs along the baseline's outputs "
                        "(one more engine): the most vLLM can accept of any draft's tokens")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="run the tokenizer / processor code the target ships (Kimi-K2.5), here and in vLLM")
    s.set_defaults(func=_evaluate)

    for name, sp in steps.choices.items():
        if name not in ("validate", "evaluate"):
            sp.add_argument("--no-progress", action="store_true", help="no progress bar")
        sp.add_argument("--debug", action="store_true",
                        help="show the traceback of a failure (also VLLM_COMPAT_DEBUG=1)")
        sp.set_defaults(on_interrupt=_interrupt_report)
    return p


def _interrupt_report(a: argparse.Namespace) -> str:
    """What a step stopped by Ctrl-C leaves (in ``<output>.partial``)."""
    out = getattr(a, "output", None)
    return describe_progress(out) if out else "nothing was written"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vllm_compat.eagle3.cli eagle3 <step> ...`` (what ``vllm-compat eagle3`` runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ContractParser(prog="vllm-compat")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    add_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:
        return print_commands(parser)
    return run_step(args, argv)


def run_step(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """An ``eagle3`` step under the error contract (:mod:`vllm_compat.cli_errors`)."""
    step = getattr(args, "eagle3_step", None)
    prog = f"vllm-compat eagle3 {step}" if step else "vllm-compat eagle3"
    report = getattr(args, "on_interrupt", None)
    return run_command(args.func, args, prog=prog, argv=argv,
                       on_interrupt=(lambda: report(args)) if report else None)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
