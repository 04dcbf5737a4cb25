"""The final pre-norm state (layer id L) under torch.compile and CUDA graphs, where vLLM's
own aux path cannot return it (DeepSeek-V2/V3 and Kimi-K2.5 before 0.25.0).

The decoder backbone ends in ``hidden_states, _ = self.norm(hidden_states, residual)``; the
norm's second output (the bf16 sum ``hidden_states + residual``) is L, and vLLM discards it.
:func:`install` swaps the class of that norm instance for a subclass that calls vLLM's norm
unchanged, then passes its output through the custom op ``vllm_compat::tap_final``, which
copies the residual into a buffer allocated here before compilation and returns a clone of
the output. Because the model's output is the op's output, the compiler keeps the op
(an op whose result is dropped is removed as pure); because the buffer's address never
changes, a captured CUDA graph replays the copy. vLLM's own KV-cache update ops reach
tensors the same way (looked up inside the op, no declared mutation). The worker reads the
first ``num_tokens`` rows after ``execute_model`` and copies them before the next forward.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

_SINKS: dict[int, torch.Tensor] = {}  # one per tapped norm in this process
_IDS = itertools.count()


@torch.library.custom_op("vllm_compat::tap_final", mutates_args=())
def tap_final(out: torch.Tensor, residual: torch.Tensor, sink_id: int) -> torch.Tensor:
    sink = _SINKS[sink_id]
    n = residual.shape[0]
    if n > sink.shape[0]:
        raise RuntimeError(f"final-state buffer holds {sink.shape[0]} tokens, the step has {n}")
    sink[:n].copy_(residual)
    return out.clone()


@tap_final.register_fake
def _(out: torch.Tensor, residual: torch.Tensor, sink_id: int) -> torch.Tensor:
    return torch.empty_like(out)


def _tapped(cls: type) -> type:
    def forward(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        got = cls.forward(self, x, residual)  # vLLM's norm, unchanged
        if residual is None:  # not the final fused add-norm: nothing to tap
            return got
        out, res = got
        return tap_final(out, res, self._vllm_compat_sink), res

    tapped = type(f"FinalStateTapped{cls.__name__}", (cls,), {"forward": forward})
    return tapped


def install(norm: torch.nn.Module, rows: int, hidden_size: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """Tap ``norm`` (the backbone's final norm); returns the buffer L is copied into. Call
    once per engine, after the model is loaded and before it is compiled or captured."""
    sink = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
    sink_id = next(_IDS)
    _SINKS[sink_id] = sink
    setattr(norm, "_vllm_compat_sink", sink_id)  # read by the tapped forward (a constant to dynamo)
    norm.__class__ = _tapped(type(norm))
    return sink


def release(sink: torch.Tensor) -> None:
    """Forget a buffer (its engine is closed)."""
    for k, v in list(_SINKS.items()):
        if v is sink:
            del _SINKS[k]
