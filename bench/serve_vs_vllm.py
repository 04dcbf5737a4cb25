"""speculators' ``generate-offline-data`` against ``vllm serve`` (extract_hidden_states +
ExampleHiddenStatesConnector, what speculators' ``launch_vllm.py`` starts) and against
``vllm-compat serve-hidden-states``, one after the other on the same GPU, same prompts:
samples/s of each and whether the files agree. Results go to a JSON file.

Needs a CUDA GPU, vLLM 0.17.1+ in this environment, and speculators 0.9.0 in its own
environment (``--speculators-python``)::

    python -m bench.serve_vs_vllm --model llama-1b --samples 2000 --seq-len 1024 \\
        --speculators-python /path/to/speculators-env/bin/python --out serve-vs-vllm.json

``--model`` is a local checkpoint or a shape of :mod:`vllm_compat.testing.models` (built with
random weights). The dataset is random token rows passed through speculators' own
``prepare-data`` (pre-tokenized rows: no render step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from vllm_compat.testing.server import ServerProcess


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row (uniform 50-100 %%)")
    p.add_argument("--concurrency", type=int, default=32, help="generate-offline-data's")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--speculators-python", required=True)
    p.add_argument("--layer-ids", type=int, nargs="+", help="default: launch_vllm.py's")
    p.add_argument("--compare-files", type=int, default=64, help="files compared between runs")
    p.add_argument("--work", help="scratch directory (default: a temporary one)")
    p.add_argument("--out", default="serve-vs-vllm.json")
    return p.parse_args(argv)


def _model(args: argparse.Namespace, work: Path, device: str = "cuda") -> str:
    if os.path.isdir(args.model):
        return args.model
    from vllm_compat.testing.chat_models import build_chat_tokenizer
    from vllm_compat.testing.models import build_model

    path = build_model(args.model, work / "model", device=device)
    # speculators' prepare-data loads the model's tokenizer even for pre-tokenized rows
    build_chat_tokenizer(path)
    return path


def _dataset(args: argparse.Namespace, model: str, work: Path) -> Path:
    import random

    from vllm_compat.target import read_target

    vocab = read_target(model).vocab_size
    rng = random.Random(0)
    rows = work / "rows.jsonl"
    with rows.open("w") as f:
        for _ in range(args.samples):
            n = rng.randint(args.seq_len // 2, args.seq_len)
            ids = [rng.randrange(10, vocab) for _ in range(n)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [1] * n}) + "\n")
    out = work / "prep"
    subprocess.run([args.speculators_python, "-m", "speculators", "prepare-data", "--model",
                    model, "--data", str(rows), "--output", str(out), "--seq-length",
                    str(args.seq_len)], check=True)
    return out


def _generate(args: argparse.Namespace, srv: ServerProcess, model: str, prep: Path,
              out: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = subprocess.run([args.speculators_python, "-m", "speculators", "generate-offline-data",
                        "--model", model, "--endpoint", srv.openai_base, "--preprocessed-data",
                        str(prep), "--output", str(out), "--concurrency", str(args.concurrency),
                        "--fail-on-error"], capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"generate-offline-data failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    files = list(out.glob("hs_*.safetensors"))
    n = len(files)
    return {"seconds": round(dt, 2), "files": n, "samples_s": round(n / dt, 2),
            "bytes": sum(f.stat().st_size for f in files)}


def compared_names(out: Path, n: int) -> list[str]:
    """The names of the ``n`` files :func:`compare_files` reads from ``out``."""
    return sorted(p.name for p in out.glob("hs_*.safetensors"))[:n]


def keep_for_comparison(out: Path, n: int) -> int:
    """Delete all but the files :func:`compare_files` reads; returns the files deleted.

    Each run's files fill the disk (2,000 samples of the 1.1B target: about 25 GB at 768
    tokens of 4 states of 2,048 bf16 values), so the first run's must go before the second
    writes its own."""
    keep = set(compared_names(out, n))
    gone = [p for p in out.glob("hs_*.safetensors") if p.name not in keep]
    for p in gone:
        p.unlink()
    return len(gone)


def _layer_ids(args: argparse.Namespace, model: str) -> list[int]:
    from vllm_compat.serve.cli import layer_ids_like_launch_vllm
    from vllm_compat.target import read_target

    return layer_ids_like_launch_vllm(read_target(model).num_hidden_layers, args.layer_ids)


def _vllm_serve(args: argparse.Namespace, model: str, store: Path, log: Path) -> ServerProcess:
    ids = _layer_ids(args, model)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(store)}}
    return ServerProcess([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
                          "--speculative_config", json.dumps(spec), "--kv_transfer_config",
                          json.dumps(kv), "--max-model-len", str(args.max_model_len),
                          "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                          "--host", "127.0.0.1", "--port", "{port}"], log_path=log)


def _ours(args: argparse.Namespace, model: str, store: Path, log: Path) -> ServerProcess:
    extra = ["--target-layer-ids", *map(str, args.layer_ids)] if args.layer_ids else []
    return ServerProcess.hidden_states(
        model, "--hidden-states-path", str(store), "--max-model-len", str(args.max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization), *extra, log_path=log)


def compare_files(a: Path, b: Path, n: int) -> dict[str, Any]:
    """Token ids equal; states: the share of bit-equal values and the worst relative error."""
    import torch
    from safetensors.torch import load_file

    names = compared_names(a, n)
    exact = total = 0
    worst = 0.0
    for name in names:
        x, y = load_file(a / name), load_file(b / name)
        assert torch.equal(x["token_ids"], y["token_ids"]), name
        assert x["hidden_states"].shape == y["hidden_states"].shape, name
        hx, hy = x["hidden_states"].float(), y["hidden_states"].float()
        exact += int((hx == hy).sum())
        total += hx.numel()
        worst = max(worst, float((hx - hy).norm() / hx.norm().clamp_min(1e-12)))
    return {"files": len(names), "bit_equal_share": exact / max(1, total),
            "worst_rel_err": worst}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="serve-vs-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch
    import vllm

    model = _model(args, work)
    prep = _dataset(args, model, work)
    res: dict[str, Any] = {
        "model": args.model, "samples": args.samples, "seq_len": args.seq_len,
        "concurrency": args.concurrency, "layer_ids": _layer_ids(args, model),
        "env": {"vllm": vllm.__version__, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    runs = {"vllm_serve": _vllm_serve, "serve_hidden_states": _ours}
    for name, make in runs.items():
        with make(args, model, work / f"{name}-store", work / f"{name}.log") as srv:
            res[name] = _generate(args, srv, model, prep, work / f"{name}-out")
        keep_for_comparison(work / f"{name}-out", args.compare_files)
        shutil.rmtree(work / f"{name}-store", ignore_errors=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    res["speed_ratio"] = round(res["serve_hidden_states"]["samples_s"]
                               / res["vllm_serve"]["samples_s"], 3)
    res["files_agree"] = compare_files(work / "vllm_serve-out", work / "serve_hidden_states-out",
                                       args.compare_files)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
