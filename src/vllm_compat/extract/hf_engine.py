"""Hidden states from HF transformers: the extractor's engine where vLLM cannot run the model.

vLLM's CPU wheel is not what users install, and its CUDA wheel cannot run a model without a
GPU. ``HiddenStatesExtractor(backend="transformers")`` runs the target in transformers
instead, one prompt per forward (so a prompt's states do not depend on which prompts run
beside it), float32 by default. It follows the same layer convention as the vLLM backends:
id ``k < L`` is the state entering decoder layer ``k`` (``output_hidden_states[k]``) and
``L`` the last layer's output *before* the final norm, taken from the norm's input because
transformers' last ``hidden_states`` entry is after it.

The engine answers the calls :class:`~vllm_compat.extract.HiddenStatesExtractor` makes of
vLLM's (``add``, ``step``, ``cancel``, ``abort``, ``has_unfinished``); states come back in
the checkpoint's dtype (``torch_dtype`` of ``config.json``, bf16 when absent), as vLLM hands
them out.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Sequence

import torch

from . import fp8

__all__ = ["TransformersEngine", "checkpoint_dtype"]


def checkpoint_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype vLLM's ``dtype="auto"`` serves a checkpoint in on a GPU: float16 for float16
    checkpoints, bfloat16 otherwise (float32 ones are downcast, unset means bf16)."""
    tc: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else {}
    name = config.get("torch_dtype") or config.get("dtype") or tc.get("torch_dtype") or tc.get("dtype")
    return torch.float16 if str(name).removeprefix("torch.") == "float16" else torch.bfloat16


class _Plan:
    mode = "transformers"


class TransformersEngine:
    """The target in transformers; ``step()`` runs one queued prompt."""

    def __init__(self, model_path: str, layer_ids: Sequence[int], *, device: str = "cpu",
                 compute_dtype: torch.dtype = torch.float32,
                 states_dtype: torch.dtype | None = None,
                 trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        self.model: Any = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=compute_dtype, trust_remote_code=trust_remote_code).eval()
        self.model.to(device)
        self.device = device
        self.layer_ids = tuple(layer_ids)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.out_dtype = checkpoint_dtype(self.model.config.to_dict())
        self.plan = _Plan()
        self.info: dict[str, Any] = {"mode": "transformers", "device": device,
                                     "compute_dtype": str(compute_dtype),
                                     "model_cls": type(self.model).__name__}
        self._encode = "fp8" if states_dtype is not None and fp8.is_fp8(states_dtype) else None
        self._queue: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._captured: list[torch.Tensor] = []
        # transformers' last hidden_states entry is after the final norm: take the norm's input
        self._hook = self._final_norm().register_forward_pre_hook(
            lambda _m, args: self._captured.append(args[0]))

    def _final_norm(self) -> Any:
        base = getattr(self.model, "model", None)
        norm = getattr(base, "norm", None)
        if norm is None:
            raise ValueError(f"{type(self.model).__name__}: no model.norm to take the final "
                             "pre-norm state from; the transformers backend supports decoder "
                             "LMs laid out as model.layers + model.norm")
        return norm

    @property
    def states_dtype(self) -> torch.dtype | None:
        return fp8.FP8_DTYPE if self._encode == "fp8" else None

    @states_dtype.setter
    def states_dtype(self, dtype: torch.dtype | None) -> None:
        if dtype is not None and not fp8.is_fp8(dtype):
            raise ValueError(f"states_dtype must be None (the model's dtype) or "
                             f"torch.float8_e4m3fn, got {dtype}")
        self._encode = "fp8" if dtype is not None else None

    @torch.no_grad()
    def states(self, ids: Sequence[int]) -> torch.Tensor:
        """``[T, len(layer_ids), H]`` in the compute dtype, on the CPU, for one prompt."""
        self._captured.clear()
        x = torch.as_tensor(list(ids), dtype=torch.int64, device=self.device)[None]
        out = self.model(input_ids=x, output_hidden_states=True)
        rows = [self._captured[-1][0] if k == self.num_layers else out.hidden_states[k][0]
                for k in self.layer_ids]
        return torch.stack(rows, dim=1).cpu()

    # ---- what HiddenStatesExtractor calls of an engine

    def add(self, req_id: str, token_ids: Sequence[int]) -> None:
        if req_id in self._queue:
            raise ValueError(f"request {req_id!r} is already queued")
        self._queue[req_id] = list(token_ids)

    def step(self) -> dict[str, Any]:
        """The states of the oldest queued prompt, ``{req_id: states}`` (empty when idle)."""
        if not self._queue:
            return {}
        req_id, ids = self._queue.popitem(last=False)
        hs = self.states(ids).to(self.out_dtype)
        return {req_id: fp8.encode(hs) if self._encode == "fp8" else hs}

    def cancel(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self._queue.pop(r, None)

    abort = cancel

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def close(self) -> None:
        self._queue.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.model = None
