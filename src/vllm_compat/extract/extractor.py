"""The extractor: :class:`HiddenStatesExtractor` and :func:`extract_hidden_states`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from ..target import TargetInfo, read_target
from .fp8 import SCALE_KEY
from .layers import resolve_layer_ids
from .ordering import OrderedAssembler, check_prompt, windows

if TYPE_CHECKING:
    from .stream import ExtractionStream

_serial = itertools.count()


@dataclass
class ExtractedSample:
    """One prompt's result. ``hidden_states``: ``[seq_len, len(layer_ids), hidden]``, CPU.

    With ``tensor_parallel_size=1`` a prompt finished in one engine step gets a view of that
    step's host buffer (no copy). Keeping a few samples for long keeps their steps' buffers
    alive; ``.clone()`` them if that matters.

    With ``states_dtype=torch.float8_e4m3fn``: ``hidden_states`` in FP8 and
    ``hidden_states_scale`` float32 ``[seq_len, len(layer_ids)]`` (:mod:`.fp8`)."""
    index: int
    token_ids: Any          # 1-D int64 torch tensor
    hidden_states: Any      # torch tensor, model dtype (or FP8)
    layer_ids: tuple[int, ...]
    hidden_states_scale: Any = None  # FP8 only

    def states(self) -> dict[str, Any]:
        """The sample's state tensors by their dataset names (``hidden_states`` and, for FP8,
        ``hidden_states_scale``): ``ShardWriter.add({"input_ids": ..., "loss_mask": ...,
        **s.states()})``."""
        out = {"hidden_states": self.hidden_states}
        if self.hidden_states_scale is not None:
            out[SCALE_KEY] = self.hidden_states_scale
        return out


class HiddenStatesExtractor:
    """Prefill-only extraction of per-token hidden states, streamed in input order.

    ``layer_ids``: ids in the convention above (None: EAGLE-3 default + L); results keep
    this order along dim 1. ``max_in_flight`` bounds how many prompts are held at once
    (default: the engine's ``max_num_seqs``-sized window of 64). ``backend``: ``"auto"``
    (aux path, hooks when it cannot express an id), ``"aux"``, ``"hooks"`` (forces
    ``enforce_eager``), ``"native"`` (vLLM's own ``extract_hidden_states`` connector), or
    ``"transformers"``: no vLLM, the target runs in HF transformers, one prompt per
    forward, float32 on ``device`` (default CPU), states handed out in the checkpoint's dtype
    (:mod:`vllm_compat.extract.hf_engine`; for machines where vLLM cannot run the model).
    Other keywords go to ``vllm.LLM``. With
    ``tensor_parallel_size > 1`` only rank 0 hands states back (they are replicated).
    ``overlap_copy`` (TP=1; default on, ``VLLM_COMPAT_EXTRACT_OVERLAP=0`` turns it off): copy
    each step's states to the host while the next step computes, through reused pinned
    buffers; off: a blocking copy per step. ``launch_ahead`` (default on at TP=1 on vLLM
    0.11.2+, off otherwise; ``VLLM_COMPAT_EXTRACT_LAUNCH_AHEAD=0/1`` decides): keep two
    engine steps in flight (:class:`vllm_compat.StepPipeline`), step N+1 scheduled and
    launched before step N's output is waited for, so the GPU never idles between forwards.
    ``states_dtype=torch.float8_e4m3fn``: states come back in FP8 with a float32 scale per
    token and layer (:mod:`vllm_compat.extract.fp8`), encoded on the GPU in the worker (half
    the bytes to copy and store; ``backend="native"`` encodes on the CPU). Default None:
    the model's dtype.

    The engine runs in this process. ``close()`` (or leaving the ``with`` block) gives its GPU
    memory and the environment variables it set back, so extractors can be opened and closed
    again and again in one process, one at a time. Several engines in a row in one job are
    better run one per process (:func:`vllm_compat.isolation.run_isolated`).
    """

    def __init__(self, model_path: str | TargetInfo, *, layer_ids: Sequence[int] | None = None,
                 tensor_parallel_size: int = 1, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, enforce_eager: bool = False,
                 gpu_memory_utilization: float = 0.5, backend: str = "auto",
                 max_in_flight: int = 64, overlap_copy: bool | None = None,
                 launch_ahead: bool | None = None, states_dtype: Any = None,
                 **llm_kwargs: Any) -> None:
        self.target = read_target(model_path)  # a path, or facts the caller already read
        self.model_path = self.target.path
        self.config = self.target.config
        self.num_layers = self.target.num_hidden_layers
        self.hidden_size = self.target.hidden_size
        self.layer_ids = resolve_layer_ids(layer_ids, self.num_layers)
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.max_model_len = max_model_len
        if backend == "transformers":
            self._engine: Any = self._transformers_engine(states_dtype, llm_kwargs)
            mml = max_model_len or self.target.text_config.get("max_position_embeddings")
            self._max_prompt = int(mml) - 1 if mml else None
        else:
            from vllm_compat.runtime.extraction import ExtractionEngine  # imports vLLM
            self._engine = ExtractionEngine(
                self.target, self.layer_ids, backend=backend,
                tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager,
                gpu_memory_utilization=gpu_memory_utilization, overlap_copy=overlap_copy,
                launch_ahead=launch_ahead, states_dtype=states_dtype, llm_kwargs=llm_kwargs)
            mml = self._engine.llm.llm_engine.model_config.max_model_len
            self._max_prompt = int(mml) - 1
        vocab = self.target.text_config.get("vocab_size") or self.config.get("vocab_size")
        self._vocab = int(vocab) if vocab else None

    def _transformers_engine(self, states_dtype: Any, kw: dict[str, Any]) -> Any:
        from .hf_engine import TransformersEngine

        allowed = {"device", "trust_remote_code"}
        if set(kw) - allowed:
            raise ValueError(f"backend='transformers' takes {sorted(allowed)} besides the "
                             f"extractor's own arguments, got {sorted(set(kw) - allowed)}")
        return TransformersEngine(self.model_path, self.layer_ids, states_dtype=states_dtype,
                                  **kw)

    @property
    def max_prompt_len(self) -> int | None:
        """The longest prompt accepted: ``max_model_len - 1`` (one slot for the sampled token,
        as vLLM keeps it), None when unbounded."""
        return self._max_prompt

    @property
    def backend(self) -> str:
        """The capture mode in use: ``aux``, ``hooks``, ``native`` or ``transformers``."""
        return str(self._engine.plan.mode)

    @property
    def info(self) -> dict[str, Any]:
        """What ran: vLLM version, runner (v1/v2), capture mode, model class, eager, steps."""
        return dict(self._engine.info, steps=getattr(self._engine, "num_steps", 0),
                    max_step_tokens=getattr(self._engine, "max_step_tokens", 0),
                    phase_s={k: round(v, 4) for k, v in
                             getattr(self._engine, "phase_s", {}).items()})

    def kv_blocks(self) -> tuple[int, int]:
        """``(free, total)`` KV-cache blocks; between ``extract`` calls every block but the
        null block must be free again (a leak check for long runs). Not for ``native`` nor
        ``transformers``."""
        if self._engine.plan.mode in ("native", "transformers"):
            raise RuntimeError("kv_blocks() needs the aux or hooks backend (native runs "
                               "through LLM.generate, whose engine core is not ours)")
        return self._engine.kv_blocks()

    @property
    def llm(self) -> Any:
        if self.backend == "transformers":
            raise RuntimeError("backend='transformers' runs no vLLM engine")
        return self._engine.llm

    @property
    def states_dtype(self) -> Any:
        """None (the model's dtype) or ``torch.float8_e4m3fn``; settable between ``extract``
        calls (the same engine then hands out the other kind)."""
        return self._engine.states_dtype

    @states_dtype.setter
    def states_dtype(self, dtype: Any) -> None:
        self._engine.states_dtype = dtype

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float | None]]:
        """vLLM's own ``prompt_logprobs`` of each prompt token (for cross-checks)."""
        if self.backend == "transformers":
            raise RuntimeError("prompt_logprobs() needs a vLLM backend")
        return self._engine.prompt_logprobs(prompts)

    def _sample(self, index: int, ids: list[int], hs: Any) -> ExtractedSample:
        import torch
        hs, scale = hs if isinstance(hs, tuple) else (hs, None)  # FP8: (states, scales)
        if hs.shape != (len(ids), len(self.layer_ids), self.hidden_size):
            raise RuntimeError(f"prompt {index}: got states of shape {tuple(hs.shape)}, expected "
                               f"{(len(ids), len(self.layer_ids), self.hidden_size)}")
        return ExtractedSample(index, torch.tensor(ids, dtype=torch.int64), hs, self.layer_ids,
                               scale)

    def extract(self, prompts: Iterable[Sequence[int]]) -> Iterator[ExtractedSample]:
        """Yield one :class:`ExtractedSample` per prompt, in input order, as they finish."""
        checked = (
            (i, check_prompt(i, p, self._max_prompt, self._vocab)) for i, p in enumerate(prompts))
        if self._engine.plan.mode == "native":
            for win in windows(checked, self.max_in_flight):
                states = self._engine.run_native([(str(i), ids) for i, ids in win])
                for (i, ids), hs in zip(win, states):
                    yield self._sample(i, ids, hs)
            return
        tag = next(_serial)
        asm = OrderedAssembler()
        try:
            yield from self._drive(checked, tag, asm)
        finally:
            left = list(asm.missing())
            if left:  # consumer stopped early or an error: free the engine's requests
                self._engine.abort(left)

    def _drive(self, checked: Iterator[tuple[int, list[int]]], tag: int,
               asm: OrderedAssembler) -> Iterator[ExtractedSample]:
        exhausted = False
        while True:
            while not exhausted and asm.in_flight < self.max_in_flight:
                nxt = next(checked, None)
                if nxt is None:
                    exhausted = True
                    break
                i, ids = nxt
                key = f"vcx{tag}-{i}"
                asm.register(i, key, ids)
                self._engine.add(key, ids)
            if asm.running == 0:
                if asm.in_flight:
                    raise RuntimeError("assembler holds requests that never finish")
                break
            asm.feed_many(self._engine.step())
            for i, ids, hs in asm.pop_ready():
                yield self._sample(i, ids, hs)
        if self._engine.has_unfinished():
            raise RuntimeError("the engine still has unfinished requests after extraction")

    def open_stream(self) -> "ExtractionStream":
        """Requests in, samples out as each finishes, while the engine keeps stepping: for a
        caller whose prompts arrive over time (a server). One stream at a time, not beside
        :meth:`extract`."""
        from .stream import ExtractionStream

        return ExtractionStream(self)

    def close(self) -> None:
        self._engine.close()

    def __enter__(self) -> "HiddenStatesExtractor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def extract_hidden_states(model_path: str, prompts: Iterable[Sequence[int]],
                          layer_ids: Sequence[int] | None = None,
                          **kw: Any) -> list[ExtractedSample]:
    """All prompts at once (list, input order); builds and closes an extractor."""
    with HiddenStatesExtractor(model_path, layer_ids=layer_ids, **kw) as ex:
        return list(ex.extract(prompts))
