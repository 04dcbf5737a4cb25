"""``eagle3 extract``: hidden states of a ``prepare`` output into a shard dataset.

Drives :class:`vllm_compat.extract.HiddenStatesExtractor` (vLLM, GPU) or, for CPU runs
and as a reference, HF transformers. Restarting continues after the last sample already
written: samples come back in input order, so the dataset's sample count is the resume
point, and shards are written atomically by :class:`ShardWriter`. The output directory is
locked for the whole run (:mod:`vllm_compat.locking`): a second job on it fails at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..extract import fp8
from ..extract.layers import eagle3_default_layers, validate_layer_ids
from ..locking import lock_output_dir
from ..target import TargetInfo, read_target
from .data import BackgroundShardWriter, ShardWriter
from .prepare import iter_token_records

BACKENDS = ("vllm", "transformers")


def aux_layer_ids_for(target: str | os.PathLike[str] | TargetInfo,
                      aux_layer_ids: Sequence[int] | None) -> tuple[int, ...]:
    """The aux ids to capture (EAGLE-3 default when None); the final layer L is added separately."""
    n = read_target(target).num_hidden_layers
    ids = eagle3_default_layers(n, include_final=False) if aux_layer_ids is None else tuple(aux_layer_ids)
    ids = validate_layer_ids(ids, n)
    if n in ids:
        raise ValueError(f"aux layer ids must not contain the final layer {n}: it is stored separately")
    return ids


def extract_dataset(
    target_dir: str | os.PathLike[str],
    records_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    aux_layer_ids: Sequence[int] | None = None,
    *,
    backend: str = "vllm",
    dtype: torch.dtype = torch.bfloat16,
    samples_per_shard: int = 256,
    progress: bool = True,
    **extractor_kwargs: Any,
) -> int:
    """Write ``input_ids`` / ``loss_mask`` / ``hidden_states [T, n_aux + 1, H]`` shards; resumable.

    Returns the number of samples in the dataset. ``extractor_kwargs`` go to
    ``HiddenStatesExtractor`` (``max_num_batched_tokens``, ``tensor_parallel_size``, ...).
    ``dtype=torch.float8_e4m3fn`` stores FP8 states with a scale per token and layer
    (:mod:`vllm_compat.extract.fp8`); with vLLM they are encoded on the GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    target = read_target(target_dir)  # read once, passed along
    aux = aux_layer_ids_for(target, aux_layer_ids)
    # one job per output directory, checked before a model is loaded (OutputDirLockedError)
    with lock_output_dir(output_dir, f"eagle3 extract --backend {backend}"):
        if backend == "transformers":
            from .hf_reference import extract_with_transformers

            return extract_with_transformers(target_dir, records_dir, output_dir, aux, dtype=dtype,
                                             samples_per_shard=samples_per_shard)
        return _extract_with_vllm(target, records_dir, output_dir, aux, dtype=dtype,
                                  samples_per_shard=samples_per_shard, progress=progress,
                                  **extractor_kwargs)


def _extract_with_vllm(
    target: TargetInfo,
    records_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    aux: tuple[int, ...],
    *,
    dtype: torch.dtype,
    samples_per_shard: int,
    progress: bool,
    **extractor_kwargs: Any,
) -> int:
    from tqdm import tqdm

    from ..extract import HiddenStatesExtractor

    n = target.num_hidden_layers
    if fp8.is_fp8(dtype):  # encoded on the GPU, before the copy to the host
        extractor_kwargs.setdefault("states_dtype", dtype)
    writer = ShardWriter(
        output_dir, hidden_size=target.hidden_size, aux_layer_ids=list(aux),
        final_layer_id=n, dtype=dtype, samples_per_shard=samples_per_shard,
        target=target.manifest_entry(),
    )
    done = writer.num_samples
    records = list(_records_from(records_dir, done))
    # shards are encoded, hashed and written in a thread while the engine extracts the next ones
    out = BackgroundShardWriter(writer)
    try:
        if records:
            with HiddenStatesExtractor(target, layer_ids=[*aux, n], **extractor_kwargs) as ex:
                stream = ex.extract(ids.tolist() for ids, _ in records)
                for sample in tqdm(stream, total=len(records), initial=0, disable=not progress,
                                   desc="extract"):
                    ids, mask = records[sample.index]
                    out.add({"input_ids": ids, "loss_mask": mask, **sample.states()})
    finally:
        manifest = out.close()
    return manifest.num_samples


def _records_from(records_dir: str | os.PathLike[str], start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i, rec in enumerate(iter_token_records(records_dir)):
        if i >= start:
            yield rec
