"""speculators' ``scripts/data_generation_offline.py`` flow ("data format v1") on vllm_compat.

Tokenized samples (``input_ids`` + ``loss_mask``) go through
:class:`VllmHiddenStatesGenerator` in batches; each sample is written to
``<output-dir>/data_{i}.pt`` as ``torch.save({"input_ids": LongTensor[T],
"hidden_states": [Tensor[T, H]] * K, "loss_mask": LongTensor[T]})``, plus
``sample_lengths.json`` (``{"i": T}``, 0.4.0) and ``data_config.json``. This is the layout
speculators 0.3/0.4's ``Eagle3SampleFileDataset`` trains from.

Command line (the same flags as speculators 0.4.0's script, with the same meaning, plus
``--layer-convention``, ``--max-num-batched-tokens``, ``--max-model-len`` and
``--trust-remote-code``)::

    vllm-compat-speculators-offline --target-model-path MODEL \\
        --train-data-path tokenized.jsonl --output-dir ./training_data [--batch-size 16]

``--layer-ids`` are numbered as speculators numbered them (output of decoder layer i;
default ``[2, L//2, L-3, L-1]``) unless ``--layer-convention vllm`` is given (state entering
layer k, vLLM's EAGLE-3 numbering; default ``[2, L//2, L-3, L]``).

``--train-data-path`` is one of:

* a ``.jsonl`` / ``.json`` file of records with ``input_ids`` (and optionally
  ``loss_mask``; all ones when absent);
* a directory written by ``datasets.Dataset.save_to_disk`` (needs ``datasets``);
* anything else (a dataset name or raw chat JSON): tokenized with speculators' own
  ``load_and_preprocess_dataset`` (needs the ``speculators`` extra), exactly as the
  original script does.

Differences from the original, all fixes: results are paired with their loss masks in
input order; every file is written atomically (temporary name, fsync, rename: a resumed run
never sees a truncated ``data_{i}.pt``); a resumed run restarts at the first *missing* file
(files are written in parallel, so a crash can leave gaps) and fills in
``sample_lengths.json`` for files written before the crash; the output directory is locked
(a second job on it fails at once, :mod:`vllm_compat.locking`). Reading uses
``torch.load(weights_only=True)`` only: a file holding pickled objects or code is refused
with :class:`SampleFileError`; ``iter_data_dir`` refuses ``data_{i}.pt`` symlinks that lead
outside the directory.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import re
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import VllmCompatError
from ..locking import TMP_SUFFIX, atomic_write_bytes, lock_output_dir
from .layers import CONVENTIONS, SPECULATORS, VLLM

__all__ = [
    "FILE_PATTERN", "SampleFileError", "TokenizedDataset", "batch_to_samples", "find_last_checkpoint",
    "find_resume_index",
    "generate_and_save_hidden_states", "iter_data_dir", "load_sample", "load_tokenized_dataset",
    "main", "parse_args", "save_config", "save_sample_to_disk", "save_token_frequency",
    "update_sample_lengths",
]

log = logging.getLogger(__name__)

FILE_PATTERN = "data_{idx}.pt"
MAX_IO_WORKERS = 4  # parallel file writes, as in speculators
_DATA_FILE = re.compile(r"data_(\d+)\.pt")


class SampleFileError(VllmCompatError, ValueError):
    """A ``data_{i}.pt`` that is not a plain tensor file, is unreadable, or is outside the
    output directory. The message starts with the file's path."""


def _torch_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- input


class TokenizedDataset:
    """Columns ``input_ids`` / ``loss_mask``; ``ds[i:j]`` gives a dict of column slices."""

    def __init__(self, input_ids: list[list[int]], loss_mask: list[list[int]]):
        if len(input_ids) != len(loss_mask):
            raise ValueError("input_ids and loss_mask have different lengths")
        for i, (ids, mask) in enumerate(zip(input_ids, loss_mask)):
            if len(ids) != len(mask):
                raise ValueError(f"sample {i}: {len(ids)} input_ids but {len(mask)} loss_mask")
        self.input_ids = input_ids
        self.loss_mask = loss_mask

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, key: slice) -> dict[str, list[list[int]]]:
        if not isinstance(key, slice):
            raise TypeError("index a TokenizedDataset with a slice, like datasets.Dataset")
        return {"input_ids": self.input_ids[key], "loss_mask": self.loss_mask[key]}


def _ints(v: Any) -> list[int]:
    return [int(x) for x in (v.tolist() if hasattr(v, "tolist") else v)]


def _read_records(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_tokenized_dataset(path: str, *, max_samples: int | None = None, seed: int = 0,
                           shuffle: bool = False) -> TokenizedDataset | Any:
    """Tokenized samples from a JSON(L) file or a ``save_to_disk`` directory.

    Raises ``FileNotFoundError`` when ``path`` is neither (the caller then falls back to
    speculators' preprocessing). ``shuffle`` uses ``seed``; ``max_samples`` keeps the first N.
    """
    p = Path(path)
    if p.is_file() and p.suffix in {".jsonl", ".json"}:
        records = _read_records(p)
        if records and "input_ids" not in records[0]:
            raise FileNotFoundError(f"{path} holds no 'input_ids': not tokenized")
        if shuffle:
            random.Random(seed).shuffle(records)
        if max_samples is not None:
            records = records[:max_samples]
        ids = [_ints(r["input_ids"]) for r in records]
        masks = [_ints(r["loss_mask"]) if r.get("loss_mask") is not None else [1] * len(i)
                 for r, i in zip(records, ids)]
        return TokenizedDataset(ids, masks)
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
        import datasets

        ds = datasets.load_from_disk(str(p))
        if shuffle:
            ds = ds.shuffle(seed=seed)
        if max_samples is not None and len(ds) > max_samples:
            ds = ds.select(range(max_samples))
        if "loss_mask" not in ds.column_names:
            ds = ds.map(lambda r: {"loss_mask": [1] * len(r["input_ids"])})
        return TokenizedDataset([_ints(x) for x in ds["input_ids"]],
                                [_ints(x) for x in ds["loss_mask"]])
    raise FileNotFoundError(f"{path} is not a tokenized JSON(L) file or save_to_disk directory")


def save_token_frequency(dataset: TokenizedDataset, output_path: str) -> str:
    """``{token_id: count}`` over loss-masked tokens, ``torch.save``d (kept if it exists),
    the input of speculators' ``build_vocab_mapping``."""

    path = Path(output_path)
    if path.exists():
        return output_path
    freq: dict[int, int] = {}
    for ids, mask in zip(dataset.input_ids, dataset.loss_mask):
        for t, m in zip(ids, mask):
            if m:
                freq[t] = freq.get(t, 0) + 1
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, _torch_bytes(freq))
    return output_path


# --------------------------------------------------------------------------- output


def find_last_checkpoint(output_dir: str) -> int:
    """One past the highest ``data_{i}.pt`` index in ``output_dir`` (0 when none)."""
    out = Path(output_dir)
    if not out.exists():
        return 0
    top = -1
    for f in out.iterdir():
        if f.name.startswith("data_") and f.suffix == ".pt":
            try:
                top = max(top, int(f.stem[5:]))
            except ValueError:
                continue
    return top + 1


def _check_tensors(data: dict) -> None:
    import torch

    for k, v in data.items():
        vals = v if isinstance(v, list) else [v]
        if not vals or not all(isinstance(t, torch.Tensor) for t in vals):
            raise TypeError(f"{k!r} must be a tensor or a non-empty list of tensors")


def save_sample_to_disk(data_dict: dict, output_path: str | os.PathLike) -> str | os.PathLike:
    """``torch.save`` one sample (tensors only) atomically: temp file, fsync, rename."""
    _check_tensors(data_dict)
    atomic_write_bytes(output_path, _torch_bytes(data_dict))
    return output_path


def load_sample(path: str | os.PathLike, *, mmap: bool = False) -> dict:
    """Read a ``data_{i}.pt`` sample with ``torch.load(weights_only=True)``; never unpickles
    objects: a file that needs them raises :class:`SampleFileError` without running anything."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL [\w.]+", str(e))
        what = f"unsupported {found.group(0)}" if found else str(e).split(". ")[0]
        raise SampleFileError(
            f"{path}: refused by the weights only loader: {what} (the file holds pickled objects "
            "or code; sample files are never unpickled)") from None
    except (RuntimeError, EOFError) as e:
        raise SampleFileError(f"{path}: not a readable torch file ({str(e).split('. ')[0]})") from None


def _data_files(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    out = Path(output_dir)
    if not out.exists():
        return []
    root = out.resolve()
    found = []
    for f in out.iterdir():
        m = _DATA_FILE.fullmatch(f.name)
        if m is None:
            continue
        real = f.resolve()
        if real.parent != root:
            raise SampleFileError(f"{f}: a link to {real}, outside the directory {root}")
        found.append((int(m.group(1)), f))
    return sorted(found)


def iter_data_dir(output_dir: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """``(i, sample)`` for every ``data_{i}.pt`` in index order (weights-only loads)."""
    for i, f in _data_files(output_dir):
        yield i, load_sample(f)


def find_resume_index(output_dir: str | os.PathLike, start_idx: int = 0) -> int:
    """The first index ``>= start_idx`` without a ``data_{i}.pt`` (where a resumed run restarts:
    parallel writes can leave gaps below :func:`find_last_checkpoint`)."""
    have = {i for i, _ in _data_files(output_dir)}
    i = start_idx
    while i in have:
        i += 1
    return i


def _remove_stale_tmp(out: Path) -> None:
    """Temporary files of writes a crash interrupted (ours and the pre-fsync ``.data_i.pt.tmp``)."""
    for f in out.iterdir():
        name = f.name
        if name.endswith(TMP_SUFFIX) and (
                _DATA_FILE.fullmatch(name.removeprefix(".")[:-len(TMP_SUFFIX)])
                or name[:-len(TMP_SUFFIX)] in ("sample_lengths.json", "data_config.json")):
            f.unlink()


def _repair_sample_lengths(out: Path, first: int, stop: int) -> None:
    """Lengths of files written before a crash (``sample_lengths.json`` is written at the end)."""
    path = out / "sample_lengths.json"
    have = json.loads(path.read_text()) if path.exists() else {}
    missing = {i: int(load_sample(out / FILE_PATTERN.format(idx=i), mmap=True)["input_ids"].shape[0])
               for i in range(first, stop) if str(i) not in have}
    if missing:
        update_sample_lengths(out, missing)


def batch_to_samples(results: Sequence[dict], batch_loss_mask: Sequence[Any]) -> list[dict]:
    """Pair ``generate`` result j with loss mask j (cut to the possibly truncated length)."""
    import torch

    if len(results) != len(batch_loss_mask):
        raise ValueError(f"{len(results)} results for {len(batch_loss_mask)} loss masks")
    samples = []
    for result, mask in zip(results, batch_loss_mask):
        input_ids = torch.as_tensor(result["input_ids"], dtype=torch.long)
        n = int(input_ids.shape[0])
        mask_t = torch.as_tensor(_ints(mask)[:n], dtype=torch.long)
        if mask_t.shape[0] != n:
            raise ValueError(f"loss mask has {mask_t.shape[0]} entries for {n} tokens")
        hs = [h.contiguous() for h in result["hidden_states"]]
        if any(h.shape[0] != n for h in hs):
            raise ValueError("hidden states and input_ids disagree on the sequence length")
        samples.append({"input_ids": input_ids, "hidden_states": hs, "loss_mask": mask_t})
    return samples


def update_sample_lengths(output_dir: str | os.PathLike, lengths: dict[int, int]) -> Path:
    """Merge ``{file_idx: T}`` into ``sample_lengths.json`` (keys are strings, as json writes)."""
    path = Path(output_dir) / "sample_lengths.json"
    merged: dict[str, int] = {}
    if path.exists():
        merged.update(json.loads(path.read_text()))
    merged.update({str(k): int(v) for k, v in lengths.items()})
    ordered = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
    atomic_write_bytes(path, json.dumps(ordered, indent=2).encode())
    return path


def save_config(args: argparse.Namespace, generator: Any, num_samples: int,
                output_dir: str, hidden_dtype: str = "torch.bfloat16") -> Path:
    """Write ``data_config.json`` (see :mod:`vllm_compat.speculators.config_generator`)."""
    from .config_generator import DataGenerationConfig

    cache_dir = args.hf_cache_dir or os.environ.get("HF_DATASETS_CACHE", "")
    config = DataGenerationConfig.from_generator(
        generator=generator, train_data_path=args.train_data_path, seq_length=args.seq_length,
        cache_dir=str(cache_dir), num_samples=num_samples, max_samples=args.max_samples,
        seed=args.seed, hidden_dtype=hidden_dtype)
    path = Path(output_dir) / "data_config.json"
    atomic_write_bytes(path, json.dumps(config.to_dict(), indent=2).encode())
    return path


# --------------------------------------------------------------------------- flow


def make_generator(args: argparse.Namespace) -> Any:
    from .vllm_hidden_states_generator import VllmHiddenStatesGenerator

    trust = getattr(args, "trust_remote_code", False)  # Namespaces built by hand may lack it
    return VllmHiddenStatesGenerator(
        model_path=args.target_model_path, layer_ids=args.layer_ids,
        max_model_len=args.max_model_len or args.seq_length,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        layer_convention=getattr(args, "layer_convention", None),
        legacy_layer_indices=getattr(args, "legacy_layer_indices", None),
        trust_remote_code=trust,
        extractor_kwargs=({"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
                          if getattr(args, "kv_cache_memory_bytes", None) else None),
    )


def generate_and_save_hidden_states(args: argparse.Namespace, dataset: Any,
                                    generator: Any = None) -> int:
    """Run the generator over ``dataset`` in batches and write the v1 files. Returns the count.

    Resumes at the first missing ``data_{i}.pt`` from ``--start-idx`` (which offsets file
    names). ``generator`` may be passed to reuse a running engine; otherwise one is built from
    args and shut down at the end. Holds the output directory's lock throughout
    (:class:`vllm_compat.locking.OutputDirLockedError` if another job has it).
    """
    with lock_output_dir(args.output_dir, "speculators offline data generation"):
        return _generate_locked(args, dataset, generator)


def _generate_locked(args: argparse.Namespace, dataset: Any, generator: Any) -> int:
    out = Path(args.output_dir)
    _remove_stale_tmp(out)
    start_file_idx = find_resume_index(out, args.start_idx)
    _repair_sample_lengths(out, args.start_idx, start_file_idx)
    num_samples = len(dataset)
    start_sample_idx = start_file_idx - args.start_idx
    if start_sample_idx >= num_samples:
        log.info("All samples already processed")
        return 0
    if start_sample_idx > 0:
        log.info("Resuming: %d samples already written", start_sample_idx)
    owned = generator is None
    if owned:
        generator = make_generator(args)
    try:
        return _generate_and_save(args, dataset, generator, out, start_file_idx,
                                  start_sample_idx, num_samples)
    finally:
        if owned:
            generator.shutdown()


def _generate_and_save(args: argparse.Namespace, dataset: Any, generator: Any, out: Path,
                       start_file_idx: int, start_sample_idx: int, num_samples: int) -> int:
    file_idx = start_file_idx
    lengths: dict[int, int] = {}
    hidden_dtype = "torch.bfloat16"
    with ThreadPoolExecutor(max_workers=MAX_IO_WORKERS) as pool:
        futures = []
        for i in range(start_sample_idx, num_samples, args.batch_size):
            batch = dataset[i:min(i + args.batch_size, num_samples)]
            results = generator.generate(batch["input_ids"])
            for sample in batch_to_samples(results, batch["loss_mask"]):
                lengths[file_idx] = int(sample["input_ids"].shape[0])
                hidden_dtype = str(sample["hidden_states"][0].dtype)
                futures.append(pool.submit(save_sample_to_disk, sample,
                                           out / FILE_PATTERN.format(idx=file_idx)))
                file_idx += 1
            log.info("generated %d/%d", min(i + args.batch_size, num_samples), num_samples)
        for f in futures:
            f.result()
    update_sample_lengths(out, lengths)
    save_config(args, generator, num_samples, args.output_dir, hidden_dtype)
    return file_idx - start_file_idx


def _default_tp() -> int:
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from ..cli_errors import ContractParser

    p = ContractParser(
        prog="vllm-compat-speculators-offline",
        description="Generate EAGLE-3 training data offline (speculators 0.3/0.4 data format v1)")
    p.add_argument("--target-model-path", required=True)
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="default: number of visible GPUs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--train-data-path", required=True,
                   help="tokenized .jsonl/.json, a save_to_disk dir, or raw data for speculators' "
                        "preprocessing")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--token-freq-path", default="./token_freq.pt")
    p.add_argument("--hf-cache-dir", default=None)
    p.add_argument("--assistant-pattern", default=None)
    p.add_argument("--turn-dropout", action="store_true")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--layer-ids", type=int, nargs="+", default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-idx", type=int, default=0)
    p.add_argument("--num-preprocessing-workers", type=int, default=8)
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of a failure (also VLLM_COMPAT_DEBUG=1)")
    # vllm_compat additions
    p.add_argument("--layer-convention", choices=CONVENTIONS, default=None,
                   help="numbering of --layer-ids: 'speculators' (the default, as speculators "
                        "0.3/0.4: output of decoder layer i) or 'vllm' (vLLM's EAGLE-3 "
                        "numbering: state entering layer k, what the draft is fed when served)")
    p.add_argument("--legacy-layer-indices", action=argparse.BooleanOptionalAction, default=None,
                   help="earlier spelling: --legacy-layer-indices = --layer-convention "
                        "speculators, --no-legacy-layer-indices = --layer-convention vllm")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="a fixed KV cache instead of --gpu-memory-utilization's share (vLLM then "
                        "skips its memory profiling, which fails while other processes share the GPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: --seq-length (as speculators)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run code shipped with the checkpoint (speculators always did; off here)")
    args = p.parse_args(argv)
    if args.tensor_parallel_size is None:
        args.tensor_parallel_size = _default_tp()
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    legacy = args.legacy_layer_indices
    implied = None if legacy is None else SPECULATORS if legacy else VLLM
    if None not in (implied, args.layer_convention) and implied != args.layer_convention:
        flag = "--legacy-layer-indices" if legacy else "--no-legacy-layer-indices"
        p.error(f"--layer-convention {args.layer_convention} contradicts {flag}; "
                "pass only --layer-convention")
    return args


def load_dataset_for(args: argparse.Namespace) -> Any:
    """Tokenized input when the path holds it; otherwise speculators' own preprocessing."""
    try:
        ds = load_tokenized_dataset(args.train_data_path, max_samples=args.max_samples,
                                    seed=args.seed)
    except FileNotFoundError:
        try:
            from speculators.data_generation.preprocessing import load_and_preprocess_dataset
        except ImportError as exc:
            from ..cli_errors import UsageError

            raise UsageError(
                f"{args.train_data_path} is not tokenized input (.jsonl/.json with input_ids, or "
                f"a save_to_disk dir) ({exc})", "raw data needs speculators' preprocessing: "
                "pip install 'vllm-compat[speculators]'") from None
        ds, _ = load_and_preprocess_dataset(
            target_model_path=args.target_model_path, train_data_path=args.train_data_path,
            seq_length=args.seq_length, build_dataset_num_proc=args.num_preprocessing_workers,
            seed=args.seed, max_samples=args.max_samples, token_freq_path=args.token_freq_path,
            cache_dir=args.hf_cache_dir, assistant_pattern=args.assistant_pattern,
            turn_dropout=args.turn_dropout)
        return ds
    save_token_frequency(ds, args.token_freq_path)
    return ds


def _run(args: argparse.Namespace) -> int:
    dataset = load_dataset_for(args)
    n = generate_and_save_hidden_states(args, dataset)
    log.info("Saved %d files to %s", n, args.output_dir)
    return 0


def _written(args: argparse.Namespace) -> str:
    n = len(list(Path(args.output_dir).glob("data_*.pt"))) if Path(args.output_dir).is_dir() else 0
    return f"{n} data_*.pt files are complete in {args.output_dir}"


def main(argv: Sequence[str] | None = None) -> int:
    """The drop-in for speculators' ``data_generation_offline.py``, under the error contract
    of :mod:`vllm_compat.cli_errors`. Files go straight into ``--output-dir`` as speculators'
    script writes them (forks read them there while it runs); a rerun resumes."""
    from ..cli_errors import run_command

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    # vLLM workers must not fork a process that has touched CUDA (speculators #223).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return run_command(_run, args, prog="vllm-compat-speculators-offline", argv=argv,
                       on_interrupt=lambda: _written(args))


if __name__ == "__main__":
    sys.exit(main())
