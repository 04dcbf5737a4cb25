"""Hidden states from a transformers forward: a CPU reference for small targets and tests.

The production path captures states with vLLM (the extraction step); this one runs the
target in transformers, which is slow but needs no vLLM, and follows the same layer
convention: id ``k`` is the state entering decoder layer ``k`` (``output_hidden_states[k]``)
and ``L`` the final state *before* the final norm (captured from the norm's input, because
transformers' last ``hidden_states`` entry is after the norm).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .data import ShardWriter
from .prepare import iter_token_records


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
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), dtype=torch.float32, trust_remote_code=False).eval()
    n_layers = model.config.num_hidden_layers
    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    writer = ShardWriter(
        output_dir, hidden_size=model.config.hidden_size, aux_layer_ids=list(aux_layer_ids),
        final_layer_id=n_layers, dtype=dtype, samples_per_shard=samples_per_shard,
        target={"name_or_path": str(Path(target_dir).resolve()), "vocab_size": model.config.vocab_size,
                "num_hidden_layers": n_layers},
    )
    try:
        done = writer.num_samples
        for i, (ids, mask) in enumerate(iter_token_records(records_dir)):
            if i < done:
                continue
            captured.clear()
            out = model(input_ids=ids[None], output_hidden_states=True)
            layers = [out.hidden_states[k][0] for k in aux_layer_ids] + [captured[-1][0]]
            writer.add({"input_ids": ids, "loss_mask": mask, "hidden_states": torch.stack(layers, dim=1)})
    finally:
        hook.remove()
        manifest = writer.close()
    return manifest.num_samples
