"""``eagle3 extract --format speculators``: speculators 0.5-0.9's hidden-state files, offline.

Reads speculators' ``prepare-data`` output (a ``datasets`` directory with ``input_ids`` and
``loss_mask`` columns) and writes ``hs_{row}.safetensors`` for each row, exactly as
``generate-offline-data`` leaves them after a vLLM server with the extract_hidden_states
connector: ``token_ids`` int64 ``[T]`` (the row's ``input_ids``) and ``hidden_states``
``[T, K, H]`` in the model's dtype, or hs-connectors' FP8 form. So ``speculators train
--on-missing raise`` (or ``warn``/``skip``) reads them as they are, with no server.

Layer ids as ``launch_vllm.py`` builds them: ``--aux-layer-ids`` (default ``[2, L//2, L-3]``)
then ``L``. Resumable: rows whose file exists and opens (safetensors' header check, as
speculators' own resume does) are skipped; files are written under a temporary name and
renamed, so an interrupted run never leaves a truncated file under a final name.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..locking import lock_output_dir
from ..target import read_target

__all__ = ["extract_speculators_dataset", "readable_indices"]


def readable_indices(output: Path, n: int) -> set[int]:
    """Rows ``< n`` whose ``hs_{i}.safetensors`` exists and has a valid header."""
    from safetensors import safe_open

    done = set()
    for i in range(n):
        p = output / f"hs_{i}.safetensors"
        if not p.exists():
            continue
        try:
            with safe_open(str(p), framework="pt"):
                done.add(i)
        except Exception:  # truncated or not safetensors: written again
            p.unlink()
    return done


def _rows(prepared: str | os.PathLike[str]) -> Any:
    try:
        from datasets import load_from_disk
    except ImportError as exc:  # pragma: no cover - the serve extra brings it
        raise ImportError("reading speculators' prepare-data output needs the datasets "
                          "package: pip install 'vllm-compat[serve]'") from exc
    ds = load_from_disk(str(prepared))
    if "input_ids" not in ds.column_names:
        raise ValueError(f"{prepared}: no input_ids column (expected speculators' "
                         f"prepare-data output, found columns {ds.column_names})")
    return ds.with_format(None)


def extract_speculators_dataset(
    target_dir: str | os.PathLike[str],
    prepared: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    aux_layer_ids: Sequence[int] | None = None,
    *,
    backend: str = "vllm",
    dtype: torch.dtype | None = None,
    max_samples: int | None = None,
    write_threads: int = 4,
    progress: bool = True,
    **extractor_kwargs: Any,
) -> dict[str, Any]:
    """Write the files; returns ``{"written", "skipped", "rows", "layer_ids", "output"}``.

    ``backend``: ``"vllm"`` (the extractor's default vLLM path) or ``"transformers"`` (CPU).
    ``dtype``: None or the model's dtype: vLLM's connector's files; ``torch.float8_e4m3fn``:
    hs-connectors' FP8 files; another float dtype: states cast to it."""
    from tqdm import tqdm

    from ..extract import HiddenStatesExtractor
    from ..serve.cli import layer_ids_like_launch_vllm
    from ..serve.hs_files import save_hidden_states

    target = read_target(target_dir)
    layer_ids = layer_ids_like_launch_vllm(target.num_hidden_layers, aux_layer_ids)
    fmt = "fp8" if dtype == torch.float8_e4m3fn else "model"
    cast = None if fmt == "fp8" or dtype is None else dtype
    out = Path(output_dir)
    ds = _rows(prepared)
    n = len(ds) if max_samples is None else min(max_samples, len(ds))
    with lock_output_dir(out, "eagle3 extract --format speculators"):
        done = readable_indices(out, n)
        todo = [i for i in range(n) if i not in done]
        if todo:
            kw = dict(extractor_kwargs)
            kw["backend"] = "transformers" if backend == "transformers" else kw.get("backend", "auto")
            with HiddenStatesExtractor(target, layer_ids=layer_ids, **kw) as ex, \
                    concurrent.futures.ThreadPoolExecutor(write_threads) as pool:
                pending: list[concurrent.futures.Future[None]] = []
                stream = ex.extract(ds[i]["input_ids"] for i in todo)
                for s in tqdm(stream, total=len(todo), disable=not progress, desc="extract"):
                    hs = s.hidden_states if cast is None else s.hidden_states.to(cast)
                    path = out / f"hs_{todo[s.index]}.safetensors"
                    pending.append(pool.submit(save_hidden_states, path, s.token_ids, hs, fmt,
                                               atomic=True))
                    if len(pending) > 4 * write_threads:  # bounded: the writes keep up
                        pending.pop(0).result()
                for f in pending:
                    f.result()
    return {"written": len(todo), "skipped": len(done), "rows": n, "layer_ids": layer_ids,
            "output": str(out)}
