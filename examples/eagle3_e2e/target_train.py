"""Train a small Llama target from scratch on the stdlib corpus, for a wall-clock budget.

Data: every training file framed as ``<|bos|> file <|eos|>`` and concatenated into one token
stream; each step draws ``batch_size`` random windows of ``seq_len + 1`` tokens from it
(next-token loss on all ``seq_len`` positions).

Held-out loss: mean token cross-entropy over non-overlapping ``seq_len`` windows of the
held-out files' stream (same framing). The windows alternate between two disjoint sets: the
even ones (up to ``eval_tokens`` predicted tokens) give the reported held-out loss, before
and after training; the odd ones are evaluated every ``select_every_s`` seconds during
training, and the parameters with the lowest loss there are the ones saved (early stopping
against over-fitting a small corpus, without selecting on the reported windows).

Optimiser: AdamW (fused on CUDA), linear warm-up, then a cosine to ``min_lr_ratio * lr``
whose progress is ``max(step / max_steps, elapsed / budget)`` -- so a run stopped by the
clock still ends at the bottom of the schedule. bf16 autocast on CUDA (fp32 master
weights), SDPA attention, optional ``torch.compile``. Runs on CPU with tiny sizes (tests).

Output (``output_dir``): ``config.json`` + ``model.safetensors`` (bf16 by default),
``generation_config.json``, the tokenizer files, and ``train_report.json``.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .corpus import EVAL_DOCS, TRAIN_DOCS, read_jsonl
from vllm_compat.testing.models import copy_tokenizer

REPORT = "train_report.json"


@dataclass
class TargetTrainConfig:
    corpus_dir: str
    tokenizer_dir: str
    output_dir: str
    # model (LlamaForCausalLM)
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1536
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # optimisation
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    minutes: float = 3.0  # wall-clock budget of the optimisation loop
    max_steps: int | None = None
    # evaluation
    eval_tokens: int = 262_144
    eval_batch_size: int = 32
    initial_eval: bool = True
    select_every_s: float | None = 20.0  # None: no selection, the last parameters are saved
    # runtime
    device: str = "auto"  # "auto": cuda when available
    compile: bool = False
    seed: int = 0
    log_every: int = 50
    save_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)  # more LlamaConfig keywords


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class Family:
    """What differs between the target families the example trains: how text becomes ids, which
    transformers model is trained, how the checkpoint is written."""

    name: str
    # tokenizer directory -> (encode: texts -> ids without specials, special ids, vocab size)
    tokenizer: Callable[[str], tuple[Callable[[list[str]], list[list[int]]], dict[str, int], int]]
    build: Callable[[TargetTrainConfig, int, dict[str, int]], Any]  # (cfg, vocab, special) -> model
    save: Callable[[Any, TargetTrainConfig, Path, dict[str, int]], None]  # writes the checkpoint


def _llama_tokenizer(tokenizer_dir: str) -> tuple[Callable[[list[str]], list[list[int]]], dict[str, int], int]:
    from tokenizers import Tokenizer

    from .tokenizer_train import special_ids

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return encode, special_ids(tok), tok.get_vocab_size()


def _llama_save(model: Any, cfg: TargetTrainConfig, out: Path, special: dict[str, int]) -> None:
    from transformers import GenerationConfig

    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    copy_tokenizer(cfg.tokenizer_dir, out)
    GenerationConfig(bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"],
                     pad_token_id=special["pad_token_id"], do_sample=False).save_pretrained(str(out))
    cfg_path = out / "config.json"
    saved = json.loads(cfg_path.read_text())
    saved.setdefault("torch_dtype", cfg.save_dtype)  # transformers 5 writes "dtype"; older readers want this
    cfg_path.write_text(json.dumps(saved, indent=1))


def token_stream(encode: Callable[[list[str]], list[list[int]]], special: dict[str, int],
                 docs_jsonl: str | os.PathLike[str]) -> tuple[torch.Tensor, int]:
    """All documents of ``docs_jsonl`` as one int64 stream ``<bos> doc <eos> <bos> ...``;
    returns ``(stream, number of documents)``."""
    bos, eos = special["bos_token_id"], special["eos_token_id"]
    docs = [d["text"] for d in read_jsonl(docs_jsonl)]
    parts = []
    for ids in encode(docs):
        parts.append(torch.tensor([bos, *ids, eos], dtype=torch.int64))
    if not parts:
        raise ValueError(f"{docs_jsonl}: no documents")
    return torch.cat(parts), len(docs)


def llama_config(cfg: TargetTrainConfig, vocab_size: int, special: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", use_cache=False, **special, **cfg.extra,
    )


def _llama_build(cfg: TargetTrainConfig, vocab_size: int, special: dict[str, int]) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(cfg, vocab_size, special))


LLAMA = Family("llama", _llama_tokenizer, _llama_build, _llama_save)


def lr_factor(step: int, progress: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 to ``min_ratio`` over ``progress`` in [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, max(0.0, progress))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def eval_windows(stream: torch.Tensor, seq_len: int, eval_tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(report, selection)``: the even and odd non-overlapping ``seq_len + 1`` windows of the
    held-out stream, each capped at ``eval_tokens`` predicted tokens. A stream shorter than two
    windows gives one window to both (then selection is on the reported tokens)."""
    n = (stream.numel() - 1) // seq_len
    if n < 2:
        return [stream], [stream]
    windows = [stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]
    cap = max(1, math.ceil(eval_tokens / seq_len))
    return windows[0::2][:cap], windows[1::2][:cap]


@torch.no_grad()
def heldout_loss(model: Any, windows: list[torch.Tensor], batch_size: int, device: torch.device) -> dict[str, Any]:
    """Mean next-token CE over ``windows`` (each ``[seq_len + 1]``: ``seq_len`` predictions)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    for i in range(0, len(windows), batch_size):
        batch = torch.stack(windows[i: i + batch_size]).to(device)
        with amp:
            logits = model(input_ids=batch[:, :-1]).logits
        ce = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += float(ce)
        count += batch[:, 1:].numel()
    model.train(was_training)
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count}


def count_params(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    return {"total": total, "embedding": emb, "lm_head": head, "non_embedding": total - emb - head}


def train_target(cfg: TargetTrainConfig, *, log: Any = print, return_model: bool = False,
                 family: Family | None = None) -> Any:
    """Train, evaluate, save; returns the report (also written to ``train_report.json``), or
    ``(report, model)`` with ``return_model`` (the model as saved: on the CPU, in ``save_dtype``).
    ``family``: the Llama of this example by default."""
    family = family or LLAMA
    t_start = time.perf_counter()
    device = resolve_device(cfg.device)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    encode, special, vocab_size = family.tokenizer(cfg.tokenizer_dir)
    t0 = time.perf_counter()
    train_stream, n_train_docs = token_stream(encode, special, Path(cfg.corpus_dir) / TRAIN_DOCS)
    eval_stream, n_eval_docs = token_stream(encode, special, Path(cfg.corpus_dir) / EVAL_DOCS)
    tokenize_s = time.perf_counter() - t0
    if train_stream.numel() < cfg.seq_len + 2:
        raise ValueError(f"the training stream has {train_stream.numel()} tokens, fewer than seq_len + 2")
    log(f"[target] tokens: train {train_stream.numel():,} ({n_train_docs} files), "
        f"held-out {eval_stream.numel():,} ({n_eval_docs} files), tokenised in {tokenize_s:.1f} s")

    model = family.build(cfg, vocab_size, special).to(device)
    model.config.use_cache = False
    params = count_params(model)
    log(f"[target] {params['total'] / 1e6:.1f} M parameters ({params['non_embedding'] / 1e6:.1f} M non-embedding) on {device}")
    step_model = torch.compile(model) if cfg.compile else model

    report_windows, select_windows = eval_windows(eval_stream, cfg.seq_len, cfg.eval_tokens)
    initial = None
    if cfg.initial_eval:
        initial = heldout_loss(model, report_windows, cfg.eval_batch_size, device)
        log(f"[target] held-out loss before training: {initial['loss']:.4f}")

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.dim() < 2 else decay).append(p)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, **fused)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    stream_dev = train_stream.to(device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    span = torch.arange(cfg.seq_len + 1, device=device)
    budget = cfg.minutes * 60.0
    curve: list[dict[str, float]] = []
    selection: list[dict[str, float]] = []
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    select_s = 0.0
    step, tokens = 0, 0
    first_loss = None
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t_train = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - t_train
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
        if cfg.max_steps is None and elapsed >= budget:
            break
        progress = max(step / cfg.max_steps if cfg.max_steps else 0.0, elapsed / budget if budget > 0 else 1.0)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * lr_factor(step, progress, cfg.warmup_steps, cfg.min_lr_ratio)
        starts = torch.randint(0, stream_dev.numel() - cfg.seq_len - 1, (cfg.batch_size, 1),
                               device=device, generator=gen)
        batch = stream_dev[starts + span]
        with amp:
            logits = step_model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        tokens += batch[:, 1:].numel()
        if cfg.select_every_s is not None and \
                time.perf_counter() - t_train - select_s >= cfg.select_every_s * (len(selection) + 1):
            t_sel = time.perf_counter()
            sel = heldout_loss(model, select_windows, cfg.eval_batch_size, device)["loss"]
            selection.append({"step": step, "tokens": tokens, "loss": round(sel, 4)})
            if best is None or sel < best[0]:
                best = (sel, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            select_s += time.perf_counter() - t_sel
        if step == 1 or step % cfg.log_every == 0:
            lv = float(loss.detach())  # syncs: only at log points
            if first_loss is None:
                first_loss = lv
            curve.append({"step": step, "tokens": tokens, "elapsed_s": round(time.perf_counter() - t_train, 2),
                          "loss": round(lv, 4), "lr": opt.param_groups[0]["lr"]})
            if step % (cfg.log_every * 10) == 0 or step == 1:
                log(f"[target] step {step} tokens {tokens:,} loss {lv:.4f} "
                    f"({tokens / max(1e-9, time.perf_counter() - t_train):,.0f} tok/s)")
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t_train
    final_train_loss = float(loss.detach()) if step else None

    selected_step = step
    if cfg.select_every_s is not None and step:
        last_sel = heldout_loss(model, select_windows, cfg.eval_batch_size, device)["loss"]
        selection.append({"step": step, "tokens": tokens, "loss": round(last_sel, 4)})
        if best is not None and best[0] < last_sel:
            model.load_state_dict(best[2])
            selected_step = best[1]
        log(f"[target] selection losses {[s['loss'] for s in selection]}: keeping step {selected_step}")
    best = None
    final = heldout_loss(model, report_windows, cfg.eval_batch_size, device)
    log(f"[target] {step} steps, {tokens:,} tokens in {train_s:.1f} s; held-out loss {final['loss']:.4f} "
        f"(ppl {final['ppl']:.2f})")

    save_dtype = getattr(torch, cfg.save_dtype)
    model = model.to("cpu")
    for p in model.parameters():  # parameters only: rotary inv_freq stays fp32, as from_pretrained builds it
        p.data = p.data.to(save_dtype)
    family.save(model, cfg, out, special)

    report = {
        "config": asdict(cfg), "family": family.name, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": params, "vocab_size": vocab_size, **special,
        "train_tokens_available": train_stream.numel(), "train_files": n_train_docs,
        "eval_tokens_available": eval_stream.numel(), "eval_files": n_eval_docs,
        "steps": step, "tokens_seen": tokens, "epochs_seen": tokens / max(1, train_stream.numel()),
        "train_s": round(train_s, 2), "tokens_per_s": round(tokens / max(train_s - select_s, 1e-9), 1),
        "selection": selection, "selected_step": selected_step, "selection_s": round(select_s, 2),
        "report_windows": len(report_windows), "selection_windows": len(select_windows),
        "tokenize_s": round(tokenize_s, 2),
        "train_loss_first": first_loss, "train_loss_last": final_train_loss,
        "train_loss_min_logged": min((c["loss"] for c in curve), default=None),
        "curve": _downsample(curve, 60),
        "heldout_initial": initial, "heldout": final,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    (out / REPORT).write_text(json.dumps(report, indent=1))
    return (report, model) if return_model else report


def _downsample(rows: list[dict[str, float]], n: int) -> list[dict[str, float]]:
    if len(rows) <= n:
        return rows
    idx = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in idx]
