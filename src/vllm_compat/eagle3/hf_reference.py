"""Hidden states from a transformers forward: a CPU reference for small targets and tests.

The production path captures states with vLLM (the extraction step); this one runs the
target in transformers, which is slow but needs no vLLM, and follows the same layer
convention: id ``k`` is the state entering decoder layer ``k`` (``output_hidden_states[k]``)
and ``L`` the final state *before* the final norm (captured from the norm's input, because
transformers' last ``hidden_states`` entry is after the norm).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..extract import fp8
from ..extract.extractor import ExtractedSample
from .data import ShardWriter
from .prepare import iter_token_records


class TransformersExtractor:
    """``extract(prompts)`` as :class:`~vllm_compat.extract.HiddenStatesExtractor` has it, one
    prompt per forward, float32 on the CPU (or ``device``). ``layer_ids``: aux ids, then
    ``L`` (the final state). ``states_dtype=torch.float8_e4m3fn`` hands out FP8 states with
    scales (:mod:`vllm_compat.extract.fp8`). One prompt at a time, so a prompt's states do
    not depend on which prompts run beside it."""

    def __init__(self, target_dir: str | os.PathLike[str], layer_ids: Sequence[int], *,
                 device: str = "cpu", states_dtype: torch.dtype | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model: Any = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=torch.float32, trust_remote_code=False).eval()
        self.model.to(device)
        self.device = device
        self.num_layers = self.model.config.num_hidden_layers
        self.layer_ids = tuple(layer_ids)
        if self.layer_ids[-1] != self.num_layers or self.num_layers in self.layer_ids[:-1]:
            raise ValueError(f"layer_ids {self.layer_ids} must end with the final state "
                             f"{self.num_layers}, and only there")
        self.states_dtype = states_dtype
        self._captured: list[torch.Tensor] = []
        # transformers' last hidden_states entry is after the final norm: take the norm's input
        self._hook = self.model.model.norm.register_forward_pre_hook(
            lambda _m, args: self._captured.append(args[0]))

    @torch.no_grad()
    def states(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T, len(layer_ids), H]`` float32 on the CPU for one prompt."""
        self._captured.clear()
        out = self.model(input_ids=ids[None].to(self.device), output_hidden_states=True)
        layers = [out.hidden_states[k][0] for k in self.layer_ids[:-1]] + [self._captured[-1][0]]
        return torch.stack(layers, dim=1).cpu()

    def extract(self, prompts: Iterable[Sequence[int]]) -> Iterator[ExtractedSample]:
        for i, p in enumerate(prompts):
            ids = torch.as_tensor(list(p), dtype=torch.int64)
            hs = self.states(ids)
            scale = None
            if self.states_dtype is not None and fp8.is_fp8(self.states_dtype):
                hs, scale = fp8.encode(hs)
            yield ExtractedSample(i, ids, hs, self.layer_ids, scale)

    def close(self) -> None:
        self._hook.remove()

    def __enter__(self) -> TransformersExtractor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@torch.no_grad()
def extract_with_transformers(
    target_dir: str | os.PathLike[str],
    records_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    aux_layer_ids: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    samples_per_shard: int = 64,
) -> int:
    """Write a hidden-state dataset for the ``prepare`` output in ``records_dir``; resumable.

    Returns the number of samples in the dataset.
    """
    ex = TransformersExtractor(target_dir, [*aux_layer_ids, _num_layers(target_dir)])
    cfg = ex.model.config
    writer = ShardWriter(
        output_dir, hidden_size=cfg.hidden_size, aux_layer_ids=list(aux_layer_ids),
        final_layer_id=ex.num_layers, dtype=dtype, samples_per_shard=samples_per_shard,
        target={"name_or_path": str(Path(target_dir).resolve()), "vocab_size": cfg.vocab_size,
                "num_hidden_layers": ex.num_layers},
    )
    try:
        done = writer.num_samples
        for i, (ids, mask) in enumerate(iter_token_records(records_dir)):
            if i < done:
                continue
            writer.add({"input_ids": ids, "loss_mask": mask, "hidden_states": ex.states(ids)})
    finally:
        ex.close()
        manifest = writer.close()
    return manifest.num_samples


def _num_layers(target_dir: str | os.PathLike[str]) -> int:
    from ..target import read_target
    return read_target(target_dir).num_hidden_layers
