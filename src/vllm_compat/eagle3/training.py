"""Train the EAGLE-3 draft on a hidden-state dataset with training-time test (TTT).

Single process, or several with ``torchrun --nproc_per_node=N -m vllm_compat.eagle3.cli train ...``
(DDP; NCCL on GPUs, gloo on CPU). Each rank reads every ``world_size``-th sample of the
epoch's shuffled order; rank 0 writes checkpoints and logs.

Resume is exact: a checkpoint holds the model, AdamW, the LR schedule, the torch RNG state
and the step; the data order is a pure function of ``(seed, epoch)``, so a run stopped at
step ``s`` (even by SIGKILL) and resumed produces the same parameters, loss curve and data
order as one that never stopped. Checkpoints are written atomically (temporary file, fsync,
rename, directory fsync), so a kill while saving leaves the previous checkpoint intact;
rows logged after the checkpoint resumed from are dropped and redone.
Logs: ``metrics.csv`` (loss and accuracy per TTT position), ``data_order.csv`` (the sample
indices of each step), TensorBoard when installed, and ``metrics.png`` at the end.
"""

from __future__ import annotations

import csv
import json
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import TargetMismatchError
from .checkpoints import (  # noqa: F401 - kept importable from here
    CHECKPOINTS,
    _atomic_write,
    _checkpoints,
    _fsync_dir,
    check_resumable,
    load_checkpoint,
    prepare_resume,
    save_checkpoint,
)
from .data import HiddenStatesDataset
from .model import DraftConfig, Eagle3Draft, TargetHead, ttt_forward
from .sources import (  # noqa: F401 - DeviceSamples and prefetched kept importable from here
    _END,
    DescribedStates,
    DeviceSamples,
    ShardSource,
    TrainingSource,
    _device_of,
    prefetched,
)
from .target import load_target_tensors, read_target
from .vocab import VocabMapping

METRICS_CSV = "metrics.csv"
DATA_ORDER_CSV = "data_order.csv"  # step, epoch, the sample indices each step trained on
METRICS_PNG = "metrics.png"
TRAIN_CONFIG = "train_config.json"
FINAL = "final"


@dataclass
class TrainConfig:
    dataset: str
    target: str
    vocab: str
    output_dir: str
    epochs: int = 1
    max_steps: int | None = None  # stop early (the schedule still spans all epochs)
    # the learning-rate schedule's length in steps (default: all epochs'); a run of max_steps
    # steps ends its cosine at min_lr_ratio with schedule_steps = max_steps
    schedule_steps: int | None = None
    batch_size: int = 1  # samples per rank per step
    ttt_steps: int = 3
    ttt_decay: float = 1.0
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    dtype: str = "bf16"  # "bf16" (autocast, fp32 master weights) or "fp32"
    seed: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    norm_before_residual: bool = True
    draft_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. intermediate_size
    progress: bool = True
    tensorboard: bool = True
    # batches built ahead by one background thread (the batches and their order are the same
    # for any value). None: 3 on CUDA, where reading and padding the hidden states inside the
    # loop left the GPU waiting (H200: 7 steps/s for a 1-layer draft); 0 (CPU): in the loop.
    prefetch: int | None = None
    # every sample moved to the training device once, and batches padded there: no host work
    # is left in the step (H200, 1-layer draft: 114 samples/s with host-side batches of 16,
    # 283 with these at batch 32). None: on CUDA, for a single process, when the dataset's
    # files take at most a quarter of the free device memory; True: always; False: never.
    device_cache: bool | None = None


@dataclass
class TrainResult:
    step: int
    output_dir: str
    last_metrics: dict[str, float]
    rank: int = 0


def _rope_theta(cfg: dict[str, Any]) -> float:
    # transformers 5 moved rope_theta into rope_parameters
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def draft_config_for(target_dir: str, dataset: DescribedStates,
                     vocab: VocabMapping, **overrides: Any) -> DraftConfig:
    """The draft mirrors the target's attention shape (as speculators' default drafts do)."""
    t = read_target(target_dir)
    tc = t.text_config
    m = dataset.manifest
    made_from = m.target.get("name_or_path")
    made = f" (it was extracted from {made_from})" if made_from else ""
    fix = "train with the target the dataset was extracted from, or re-extract the dataset from this one"
    if m.hidden_size != t.hidden_size:
        raise TargetMismatchError(
            f"dataset {dataset.dir} holds hidden states of size {m.hidden_size}{made}, but the target "
            f"{target_dir} has hidden size {t.hidden_size}: {fix}")
    if m.final_layer_id != t.num_hidden_layers:
        raise TargetMismatchError(
            f"dataset {dataset.dir} was extracted from a target with {m.final_layer_id} decoder "
            f"layers{made}, but the target {target_dir} has {t.num_hidden_layers}: {fix}")
    ds_vocab = m.target.get("vocab_size")
    if ds_vocab is not None and int(ds_vocab) != t.vocab_size:
        raise TargetMismatchError(
            f"dataset {dataset.dir} was extracted from a target with a vocabulary of {ds_vocab}{made}, "
            f"but the target {target_dir} has {t.vocab_size}: {fix}")
    if vocab.target_vocab_size != t.vocab_size:
        raise TargetMismatchError(
            f"vocab mapping is over {vocab.target_vocab_size} ids, the target {target_dir} has "
            f"{t.vocab_size}: build the mapping for this target (build_vocab(..., {t.vocab_size}, ...))")
    kw = dict(
        hidden_size=t.hidden_size, num_attention_heads=tc["num_attention_heads"],
        num_key_value_heads=tc.get("num_key_value_heads") or tc["num_attention_heads"],
        intermediate_size=tc["intermediate_size"], head_dim=tc.get("head_dim"),
        target_vocab_size=t.vocab_size, draft_vocab_size=vocab.draft_vocab_size,
        aux_layer_ids=list(m.aux_layer_ids), final_layer_id=m.final_layer_id,
        rms_norm_eps=t.rms_norm_eps, rope_theta=_rope_theta(tc),
        max_position_embeddings=tc.get("max_position_embeddings", 4096),
    )
    kw.update(overrides)
    return DraftConfig(**kw)


def build_models(cfg: TrainConfig, dataset: DescribedStates,
                 ) -> tuple[Eagle3Draft, TargetHead, DraftConfig]:
    vocab = VocabMapping.load(cfg.vocab)
    dcfg = draft_config_for(cfg.target, dataset, vocab, norm_before_residual=cfg.norm_before_residual,
                            **cfg.draft_overrides)
    weights = load_target_tensors(read_target(cfg.target))
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    draft.embed_tokens.weight.data.copy_(weights["embed_tokens"])
    draft.set_vocab(vocab.d2t, vocab.t2d)
    # Start the draft head from the target head's rows for the draft vocabulary.
    draft.lm_head.weight.data.copy_(weights["lm_head"][draft.d2t + torch.arange(dcfg.draft_vocab_size)])
    target = TargetHead(weights["norm"], weights["lm_head"], read_target(cfg.target).rms_norm_eps)
    return draft, target, dcfg


class TTTModule(nn.Module):
    """Draft + frozen target head behind one ``forward`` so DDP can wrap it."""

    def __init__(self, draft: Eagle3Draft, target: TargetHead, steps: int, decay: float) -> None:
        super().__init__()
        self.draft, self.target, self.steps, self.decay = draft, target, steps, decay

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = ttt_forward(self.draft, self.target, batch, self.steps, self.decay)
        stats = torch.stack([torch.stack(out.step_loss), torch.stack(out.correct), torch.stack(out.counted),
                             torch.stack(out.chained)])
        return out.loss, stats


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; ``valid`` marks real tokens (causal attention keeps
    padding invisible to them). Hidden states keep their stored dtype (one common dtype,
    else float32): the model casts them on the device, and bf16 -> fp32 is exact, so the
    result is the same as padding in float32 at half the bytes to pad and copy. The batch is
    built on the samples' device (:class:`DeviceSamples`: on the GPU)."""
    t = max(s["input_ids"].shape[0] for s in samples)
    b = len(samples)
    hs0 = samples[0]["hidden_states"]
    dev = hs0.device
    dtypes = {s["hidden_states"].dtype for s in samples}
    hs_dtype = hs0.dtype if len(dtypes) == 1 and hs0.dtype.is_floating_point else torch.float32
    out = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64, device=dev),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool, device=dev),
        "valid": torch.zeros(b, t, dtype=torch.bool, device=dev),
        "hidden_states": torch.zeros(b, t, *hs0.shape[1:], dtype=hs_dtype, device=dev),
    }
    for i, s in enumerate(samples):
        n = s["input_ids"].shape[0]
        out["input_ids"][i, :n] = s["input_ids"]
        out["loss_mask"][i, :n] = s["loss_mask"].bool()
        out["valid"][i, :n] = True
        out["hidden_states"][i, :n] = s["hidden_states"]
    return out


def dataset_file_bytes(dataset: HiddenStatesDataset) -> int:
    """The bytes of the dataset's shard files: what :class:`DeviceSamples` will hold, give or
    take the headers."""
    return sum(path.stat().st_size for path, _ in dataset._shards)


def device_cache_fits(dataset: HiddenStatesDataset, device: torch.device, share: float = 0.25) -> bool:
    """Whether the dataset fits in ``share`` of the free memory of CUDA ``device``."""
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return dataset_file_bytes(dataset) <= share * free


class StepBatches(torch.utils.data.Sampler[list[int]]):
    """The sample indices of steps ``start .. stop-1`` of a run, as a DataLoader batch sampler:
    step ``s`` is batch ``s % steps_per_epoch`` of ``epoch_order(n, seed, s // steps_per_epoch,
    rank, world)``, the same pure function the loop logs in ``data_order.csv``."""

    def __init__(self, n: int, batch_size: int, steps_per_epoch: int, seed: int, start: int, stop: int,
                 rank: int = 0, world: int = 1) -> None:
        self.n, self.batch_size, self.steps_per_epoch, self.seed = n, batch_size, steps_per_epoch, seed
        self.start, self.stop, self.rank, self.world = start, stop, rank, world

    def indices(self, step: int) -> list[int]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = epoch_order(self.n, self.seed, epoch, self.rank, self.world)
        return order[offset * self.batch_size: (offset + 1) * self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        return (self.indices(s) for s in range(self.start, self.stop))

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


def epoch_order(n: int, seed: int, epoch: int, rank: int = 0, world: int = 1) -> list[int]:
    """This rank's share of the epoch's shuffled sample order. Every rank gets the same count
    (the ``n % world`` left over are dropped this epoch) or DDP would wait on a missing rank."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    return order[: n - n % world][rank::world]


def lr_lambda(warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _dist() -> tuple[int, int, torch.device, bool]:
    """``(rank, world, device, whether we started the process group)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:  # one process: the first GPU when there is one (CUDA_VISIBLE_DEVICES picks it)
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"), False
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device, started


ORDER_NAMES = ["step", "epoch", "samples"]


def _metric_names(steps: int) -> list[str]:
    return (["step", "epoch", "lr", "loss", "grad_norm"]
            + [f"loss_{k}" for k in range(steps)] + [f"acc_{k}" for k in range(steps)]
            # chain_k: steps 0..k all right, comparable to vLLM's per-position acceptance
            + [f"chain_{k}" for k in range(steps)])


def _complete(row: dict[str, Any], names: list[str]) -> bool:
    """A whole row of this header (a kill mid-append can leave a torn last line)."""
    if None in row or any(row.get(n) in (None, "") for n in names):
        return False
    try:
        int(row["step"])
    except ValueError:
        return False
    return True


def _reset_csv(path: Path, names: list[str], upto_step: int) -> None:
    """Keep the header and the rows up to ``upto_step`` (rows after a checkpoint are redone)."""
    rows = []
    if path.exists():
        with path.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if _complete(r, names) and int(r["step"]) <= upto_step]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        w.writerows(rows)


def train(cfg: TrainConfig, *, resume: bool = True,
          samples: DeviceSamples | None = None) -> TrainResult:
    """Offline training: the states read from ``cfg.dataset``'s shards.

    ``samples``: the dataset already on the training device (read once for several runs);
    it must be ``cfg.dataset``'s."""
    rank, world, device, started_pg = _dist()
    out = Path(cfg.output_dir)
    from ..locking import lock_output_dir  # one job per run dir; released when train returns

    _lock = lock_output_dir(out, "eagle3 train") if rank == 0 else None  # noqa: F841
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / TRAIN_CONFIG).write_text(json.dumps(asdict(cfg), indent=1))
    dataset: HiddenStatesDataset | DeviceSamples
    if samples is not None:
        if Path(samples.dir).resolve() != Path(cfg.dataset).resolve() or samples.device != _device_of(device):
            raise ValueError(f"samples hold {samples.dir} on {samples.device}; this run trains on "
                             f"{cfg.dataset} on {device}")
        dataset = samples
    else:
        dataset = HiddenStatesDataset(cfg.dataset)
        if cfg.device_cache or (cfg.device_cache is None and world == 1 and device_cache_fits(dataset, device)):
            dataset = DeviceSamples(dataset, device)
    source = ShardSource(dataset)
    # on-device samples: padding is a few device copies, launched asynchronously, so no thread
    depth = cfg.prefetch if cfg.prefetch is not None else (
        3 if device.type == "cuda" and not source.on_device else 0)
    return run_training(cfg, source, resume=resume, dist=(rank, world, device, started_pg),
                        prefetch=depth, pin=device.type == "cuda" and not source.on_device)


@dataclass
class TrainState:
    """What one step changes, and what a checkpoint holds."""

    module: TTTModule
    model: nn.Module  # ``module``, or the DDP wrapper around it
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    step: int = 0


def train_step(state: TrainState, batch: dict[str, torch.Tensor], cfg: TrainConfig, autocast: Any,
               world: int) -> dict[str, Any]:
    """One optimizer step on ``batch`` (already on the device); returns the step's metrics
    (all-reduced over ranks), without ``step`` and ``epoch``."""
    with autocast:
        loss, stats = state.model(batch)
    state.opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(state.params, cfg.grad_clip)
    lr = state.sched.get_last_lr()[0]
    state.opt.step()
    state.sched.step()
    state.step += 1
    stats = stats.detach().float()
    if world > 1:
        import torch.distributed as dist

        stats[0] *= stats[2]  # loss sums, so ranks are weighted by their token counts
        dist.all_reduce(stats)
        stats[0] /= stats[2].clamp_min(1)
    acc = (stats[1] / stats[2].clamp_min(1)).tolist()
    chained = (stats[3] / stats[2].clamp_min(1)).tolist()
    # the logged loss is recomposed from the (all-reduced) per-position losses
    total_loss = sum(cfg.ttt_decay ** k * float(v) for k, v in enumerate(stats[0]))
    return {"lr": lr, "loss": total_loss, "grad_norm": float(grad_norm),
            **{f"loss_{k}": float(v) for k, v in enumerate(stats[0])},
            **{f"acc_{k}": a for k, a in enumerate(acc)},
            **{f"chain_{k}": c for k, c in enumerate(chained)}}


def run_training(cfg: TrainConfig, source: TrainingSource, *, resume: bool = True,
                 dist: tuple[int, int, torch.device, bool] | None = None, prefetch: int = 0,
                 pin: bool = False, scalar_prefix: str = "train") -> TrainResult:
    """The training loop over any :mod:`source <vllm_compat.eagle3.sources>`: models,
    optimizer, resume from the newest checkpoint, the steps, logs, checkpoints, ``final/``.
    The caller holds the output directory's lock and has written ``train_config.json``.
    ``prefetch``: steps the source may build ahead; ``pin``: pin each batch (CUDA)."""
    rank, world, device, started_pg = dist if dist is not None else _dist()
    out = Path(cfg.output_dir)
    try:
        return _run(cfg, source, resume, rank, world, device, started_pg, out, prefetch, pin, scalar_prefix)
    finally:
        source.close()


def _run(cfg: TrainConfig, source: TrainingSource, resume: bool, rank: int, world: int,
         device: torch.device, started_pg: bool, out: Path, prefetch: int, pin: bool,
         scalar_prefix: str) -> TrainResult:
    n = len(source)
    draft, target, dcfg = build_models(cfg, source)
    module = TTTModule(draft, target, cfg.ttt_steps, cfg.ttt_decay).to(device)
    model: nn.Module = module
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in module.draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(epoch_order(n, cfg.seed, 0, rank, world)) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{n} samples are fewer than batch_size x world_size = {cfg.batch_size * world}")
    total = steps_per_epoch * cfg.epochs
    span = cfg.schedule_steps or total  # what a checkpoint's "total_steps" records: the schedule
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.warmup_steps, span, cfg.min_lr_ratio))
    state = TrainState(module, model, params, opt, sched)

    found = prepare_resume(out, resume, rank)
    if found:
        saved = load_checkpoint(found[-1])
        check_resumable(found[-1], saved, num_samples=n, world_size=world, batch_size=cfg.batch_size,
                        seed=cfg.seed, total_steps=span, epochs=cfg.epochs)
        module.draft.load_state_dict(saved["draft"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        state.step = int(saved["step"])
    step = state.step
    stop = total if cfg.max_steps is None else min(total, cfg.max_steps)

    names = _metric_names(cfg.ttt_steps)
    sampler = StepBatches(n, cfg.batch_size, steps_per_epoch, cfg.seed, step, stop, rank, world)

    def make_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        # collate looked up at call time: tests slow it down to kill mid-step
        b = collate(samples)
        return {k: v.pin_memory() for k, v in b.items()} if pin else b

    batches = source.batches(sampler, make_batch, prefetch)
    tb = None
    if rank == 0:
        _reset_csv(out / METRICS_CSV, names, step)
        _reset_csv(out / DATA_ORDER_CSV, ORDER_NAMES, step)
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                tb = SummaryWriter(str(out / "tensorboard"), purge_step=step)
            except ImportError:  # tensorboard is optional
                tb = None
    bar = None
    if cfg.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=stop, initial=step, desc="train", unit="step")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16" else nullcontext())
    last: dict[str, Any] = {}
    model.train()
    while step < stop:
        epoch, offset = divmod(step, steps_per_epoch)
        idx = sampler.indices(step)
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        metrics = train_step(state, batch, cfg, autocast, world)
        step = state.step
        last = {"step": step, "epoch": epoch, **metrics}
        if rank == 0:
            with (out / METRICS_CSV).open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=names).writerow(last)
            # every rank's samples of this step (rank-major), from the same pure function
            shown = [i for r in range(world) for i in (idx if r == rank else epoch_order(
                n, cfg.seed, epoch, r, world)[offset * cfg.batch_size:(offset + 1) * cfg.batch_size])]
            with (out / DATA_ORDER_CSV).open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=ORDER_NAMES).writerow(
                    {"step": step, "epoch": epoch, "samples": " ".join(map(str, shown))})
            extra = source.scalars()
            if tb is not None:
                for k, v in last.items():
                    if k not in ("step", "epoch"):
                        tb.add_scalar(f"{scalar_prefix}/{k}", v, step)
                for k, v in extra.items():
                    tb.add_scalar(k, v, step)
            if step % cfg.checkpoint_every == 0 or step == stop:
                save_checkpoint(out, {
                    "step": step, "draft": module.draft.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "rng": torch.get_rng_state(),
                    "draft_config": dcfg.to_json(), "num_samples": n, "world_size": world,
                    "batch_size": cfg.batch_size, "seed": cfg.seed, "total_steps": span,
                }, cfg.keep_checkpoints)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{last['acc_0']:.2f}", **source.progress())
    if bar is not None:
        bar.close()
    if rank == 0:
        if tb is not None:
            tb.close()
        save_final(out / FINAL, module.draft)
        plot_metrics(out / METRICS_CSV, out / METRICS_PNG)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # rank 0 has written final/ before anyone returns
        if started_pg:
            dist.destroy_process_group()
    return TrainResult(step, str(out), last, rank)


def save_final(directory: Path, draft: Eagle3Draft) -> None:
    """The trained draft as safetensors plus its config (the input of ``export``)."""
    from safetensors.torch import save as save_bytes

    directory.mkdir(parents=True, exist_ok=True)
    # each file atomically: a kill leaves the previous file or the complete new one
    data = save_bytes(draft.exported_state_dict())
    _atomic_write(directory / "draft.safetensors", lambda f: f.write(data))
    text = json.dumps(draft.config.to_json(), indent=1).encode()
    _atomic_write(directory / "draft_config.json", lambda f: f.write(text))


def load_final(directory: str | os.PathLike[str]) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    d = Path(directory)
    if (d / FINAL).is_dir():
        d = d / FINAL
    cfg = DraftConfig(**json.loads((d / "draft_config.json").read_text()))
    return cfg, load_file(str(d / "draft.safetensors"))


def plot_metrics(csv_path: Path, png_path: Path) -> Path | None:
    """Loss and accuracy per TTT position against the step (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    steps = [int(r["step"]) for r in rows]
    k = sum(1 for n in rows[0] if n.startswith("loss_"))
    chain = f"chain_{k - 1}" in rows[0]  # CSVs written before chain_k have no third panel
    fig, axes = plt.subplots(1, 3 if chain else 2, figsize=(15 if chain else 10, 4))
    a, b = axes[0], axes[1]
    for i in range(k):
        a.plot(steps, [float(r[f"loss_{i}"]) for r in rows], label=f"position {i}")
        b.plot(steps, [float(r[f"acc_{i}"]) for r in rows], label=f"position {i}")
        if chain:  # 50-step running mean: one batch is noisy
            v = [float(r[f"chain_{i}"]) for r in rows]
            axes[2].plot(steps, [sum(v[max(0, j - 49): j + 1]) / len(v[max(0, j - 49): j + 1])
                                 for j in range(len(v))], label=f"position {i}")
    a.set(title="loss per TTT position", xlabel="step")
    b.set(title="accuracy per TTT position", xlabel="step", ylim=(0, 1))
    a.legend()
    b.legend()
    if chain:
        axes[2].set(title="positions 0..k all right (50-step mean)", xlabel="step", ylim=(0, 1))
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
    return png_path
