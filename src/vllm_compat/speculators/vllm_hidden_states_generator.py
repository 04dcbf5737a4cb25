"""Drop-in ``VllmHiddenStatesGenerator`` for speculators 0.3.0 / 0.4.x forks.

Same constructor parameters, same ``generate(token_ids)`` and the same return format as
``speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator``
(0.4.0.1; 0.3.0's parameters are a prefix of it), running on every vLLM release
vllm_compat supports. The capture itself is :class:`vllm_compat.extract.HiddenStatesExtractor`;
this class translates arguments and shapes results the way speculators' training reads them.

The same arguments give the same states: ``layer_ids`` are numbered as speculators
0.3/0.4 numbered them (id i = output of decoder layer i, one layer deeper than vLLM's id i),
the default ids are its ``[2, L//2, L-3, L-1]``, and ``hidden_states`` holds one tensor per
distinct id in ascending layer order, as its capture loop returned them. A one-time
:class:`~vllm_compat.speculators.layers.LayerConventionWarning` says so unless the caller
chose; ``layer_convention="vllm"`` switches to vLLM's numbering (state entering layer k).

Fixed against speculators 0.3/0.4:

* results are in **input order** (0.4.x iterated ``sorted()`` string request ids, so
  ``req_0_10`` came before ``req_0_2`` and batches of >= 11 mispaired loss masks);
* every prompt token gets its own state under chunked prefill (0.3.0 mis-attributed
  tokens across requests);
* no truthiness test on tensors (0.3.0's ``if not aux_hidden_states`` raised).

This module never imports vLLM; torch and the extractor are imported when used.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from . import layers as _layers

if TYPE_CHECKING:
    import torch

__all__ = ["VllmHiddenStatesGenerator", "prepare_prompts", "samples_to_results"]

log = logging.getLogger(__name__)

# speculators 0.3/0.4 constants that shape the public behaviour
MAX_DECODE_TOKENS = 1  # prompts are truncated to max_model_len - 1 (room for max_tokens=1)
MIN_MAX_BATCHED_TOKENS = 8192  # default max_num_batched_tokens = max(8192, max_model_len)


def _model_config(model_path: str, trust_remote_code: bool = False) -> Any:
    """The model's config (transformers when available, else a local config.json)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"cannot read the config of {model_path!r}: install transformers or pass a "
                "local directory holding config.json"
            ) from None
        with open(path) as f:
            return json.load(f, object_hook=lambda d: SimpleNamespace(**d))
    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (ValueError, OSError):
        # a model type transformers does not know and the checkpoint ships no code for (vLLM
        # has its own config class for it, e.g. Kimi-K2.5's kimi_k25): its config.json. With
        # trust_remote_code, an auto_map naming a module the directory lacks raises OSError.
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise
        with open(path) as f:
            return json.load(f, object_hook=lambda d: SimpleNamespace(**d))


def local_model_path(model_path: str) -> str:
    """A local checkpoint directory for ``model_path`` (the extractor reads its config.json).

    speculators accepted Hugging Face hub ids; those are resolved with
    ``huggingface_hub.snapshot_download`` (the download vLLM would have made anyway).
    """
    if os.path.isdir(model_path):
        return model_path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"{model_path!r} is not a local directory and huggingface_hub is not "
                         "installed to download it") from None
    return snapshot_download(model_path)


def num_hidden_layers(config: Any) -> int:
    """Decoder layer count, for text models and VLMs (``text_config``) as speculators read it."""
    n = getattr(config, "num_hidden_layers", None)
    if n is None and getattr(config, "text_config", None) is not None:
        n = getattr(config.text_config, "num_hidden_layers", None)
    if n is None:
        raise ValueError("Cannot determine num_layers from config")
    return int(n)


def _as_id_list(ids: Any, i: int) -> list[int]:
    if hasattr(ids, "tolist"):  # torch.Tensor / numpy array
        ids = ids.tolist()
    out = list(ids)
    for t in out:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"token_ids[{i}] contains {t!r}, not an integer token id")
    return [int(t) for t in out]


def prepare_prompts(token_ids: Any, max_model_len: int) -> list[list[int]]:
    """``generate``'s input handling: a 2-D tensor, or a sequence of id lists / 1-D tensors.

    Each prompt is truncated to ``max_model_len - 1`` tokens (vLLM needs room for the one
    sampled token), as speculators 0.3/0.4 did. Lengths are checked with ``len()``, never
    with the truth value of a tensor.
    """
    if hasattr(token_ids, "dim") and hasattr(token_ids, "tolist"):
        if token_ids.dim() != 2:
            raise ValueError(f"token_ids tensor must be 2-D [batch, seq], got {token_ids.dim()}-D")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise ValueError("token_ids must be a list of token-id lists or a 2-D tensor")
    if len(token_ids) == 0:
        raise ValueError("token_ids cannot be empty")
    max_len = max_model_len - MAX_DECODE_TOKENS
    prompts = []
    for i, ids in enumerate(token_ids):
        ids = _as_id_list(ids, i)[:max_len]
        if len(ids) == 0:
            raise ValueError(f"token_ids[{i}] is empty: every prompt needs at least one token")
        prompts.append(ids)
    return prompts


@dataclass(frozen=True)
class _Slots:
    """Which extracted layer (by vLLM id) fills each result slot, in slot order."""

    canonical: tuple[int, ...]  # one per slot, duplicates allowed

    @property
    def unique(self) -> list[int]:
        return list(dict.fromkeys(self.canonical))


def samples_to_results(samples: Iterable[Any], prompts: Sequence[Sequence[int]],
                       slot_layer_ids: Sequence[int]) -> list[dict]:
    """Turn extractor samples into speculators' ``generate`` results, in input order.

    ``samples`` are ``ExtractedSample``-like objects (``index``, ``token_ids [T]``,
    ``hidden_states [T, K, H]``, ``layer_ids``) in any order; ``slot_layer_ids`` are the
    canonical ids of the result's ``hidden_states`` list, in order. Each result is
    ``{"input_ids": LongTensor[T], "hidden_states": [Tensor[T, H]] * len(slot_layer_ids),
    "loss_mask": None}`` with CPU tensors that own their storage (so ``torch.save`` of one
    slot never writes the whole ``[T, K, H]`` block).
    """
    import torch

    n = len(prompts)
    results: list[dict | None] = [None] * n
    for s in samples:
        idx = int(s.index)
        if not 0 <= idx < n:
            raise RuntimeError(f"extractor returned sample index {idx} for a batch of {n}")
        if results[idx] is not None:
            raise RuntimeError(f"extractor returned sample {idx} twice")
        ids = torch.as_tensor(s.token_ids, dtype=torch.long).reshape(-1).cpu()
        want = list(prompts[idx])
        if ids.numel() != len(want) or ids.tolist() != want:
            raise RuntimeError(
                f"sample {idx}: extracted token ids (len {ids.numel()}) differ from prompt {idx} "
                f"(len {len(want)}): results would be mispaired"
            )
        hs = s.hidden_states
        got_ids = [int(x) for x in s.layer_ids]
        if hs.dim() != 3 or hs.shape[0] != len(want) or hs.shape[1] != len(got_ids):
            raise RuntimeError(
                f"sample {idx}: hidden_states shape {tuple(hs.shape)} is not "
                f"[T={len(want)}, K={len(got_ids)}, H]"
            )
        pos = {lid: k for k, lid in enumerate(got_ids)}
        missing = [lid for lid in slot_layer_ids if lid not in pos]
        if missing:
            raise RuntimeError(f"sample {idx}: layers {missing} were not extracted (got {got_ids})")
        layer_states = [
            hs[:, pos[lid], :].detach().to("cpu").clone(memory_format=torch.contiguous_format)
            for lid in slot_layer_ids]
        results[idx] = {"input_ids": ids.clone(), "hidden_states": layer_states, "loss_mask": None}
    absent = [i for i, r in enumerate(results) if r is None]
    if absent:
        raise RuntimeError(f"extractor returned no states for prompt(s) {absent[:10]}")
    return results  # type: ignore[return-value]


class VllmHiddenStatesGenerator:
    """Extract hidden states from chosen layers during prefill, speculators-style.

    Parameters as speculators 0.4.0.1 (positional order kept), then vllm_compat's own,
    keyword-only:

    ``layer_convention``: ``"speculators"`` (what an unset value means) reads ``layer_ids``
    as speculators 0.3/0.4 did: id i is the output of decoder layer i, ids in ``[0, L-1]``,
    default ``[2, L//2, L-3, L-1]``, one result tensor per distinct id in ascending order.
    ``"vllm"`` reads them as vLLM's EAGLE-3 path does: id k is the state entering layer k
    (``L`` = final pre-norm state), default ``[2, L//2, L-3, L]``, one tensor per id in the
    given order. Leaving it unset emits a one-time ``LayerConventionWarning``.
    ``legacy_layer_indices``: the earlier spelling, ``True`` = ``"speculators"``,
    ``False`` = ``"vllm"``; contradicting ``layer_convention`` is a ``ValueError``.
    ``extractor_kwargs``: extra keywords for ``HiddenStatesExtractor`` (and through it,
    vLLM's ``LLM``), e.g. ``{"enforce_eager": False}`` or ``{"dtype": "bfloat16"}``.

    ``generate(token_ids)`` returns one dict per prompt, in input order:
    ``input_ids`` LongTensor[T], ``hidden_states`` list of tensors [T, H] (model dtype, CPU;
    one per entry of ``capture_layer_ids``, the vLLM ids of the slots), ``loss_mask`` None. Prompts longer than ``max_model_len - 1`` are
    truncated, as in speculators.
    """

    def __init__(
        self,
        model_path: str,
        layer_ids: list[int] | None = None,
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.8,
        tensor_parallel_size: int = 1,
        max_num_batched_tokens: int | None = None,
        *,
        layer_convention: str | None = None,
        legacy_layer_indices: bool | None = None,
        extractor_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
    ):
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self.max_model_len = int(max_model_len)
        self.gpu_memory_utilization = gpu_memory_utilization
        # speculators 0.4: a falsy value means max(8192, max_model_len)
        self.max_num_batched_tokens = (max_num_batched_tokens
                                       or max(MIN_MAX_BATCHED_TOKENS, self.max_model_len))
        self._tokenizer: Any = None

        local_path = local_model_path(model_path)
        # speculators 0.3/0.4 hard-coded trust_remote_code=True: code shipped with a
        # checkpoint ran unasked. Here it is the caller's choice, off by default.
        self.trust_remote_code = bool(trust_remote_code)
        self.config = _model_config(local_path, self.trust_remote_code)
        self.num_layers = num_hidden_layers(self.config)
        self.layer_convention, explicit = _layers.choose_convention(
            layer_convention, legacy_layer_indices)
        self.layer_ids, self.capture_layer_ids = resolve_layer_ids(
            layer_ids, self.num_layers, self.layer_convention)
        if not explicit:
            _layers.warn_speculators_numbering_once(stacklevel=2)
        log.info("hidden states from layers %s (%s numbering; vLLM ids %s)",
                 self.layer_ids, self.layer_convention, self.capture_layer_ids)
        self._slots = _Slots(tuple(self.capture_layer_ids))

        from ..extract import HiddenStatesExtractor  # lazy: the extractor imports vLLM

        kw: dict[str, Any] = {"trust_remote_code": self.trust_remote_code}
        kw.update(extractor_kwargs or {})
        kw.setdefault("enforce_eager", True)  # what speculators 0.3/0.4 ran with
        self.extractor = HiddenStatesExtractor(
            local_path,
            layer_ids=self._slots.unique,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            **kw,
        )

    @property
    def legacy_layer_indices(self) -> bool:
        """``True`` when ``layer_ids`` use speculators 0.3/0.4's numbering."""
        return self.layer_convention == _layers.SPECULATORS

    # ------------------------------------------------------------------ speculators API

    def generate(self, token_ids: list[list[int]] | torch.Tensor) -> list[dict]:
        """Extract hidden states from the prefill of each prompt (input order).

        Args:
            token_ids: batch of token id sequences, as list[list[int]] or a 2-D Tensor

        Returns:
            list of dicts with keys ``input_ids``, ``hidden_states``, ``loss_mask`` (None)
        """
        prompts = prepare_prompts(token_ids, self.max_model_len)
        extractor = self.__dict__.get("extractor")
        if extractor is None:
            raise RuntimeError("this VllmHiddenStatesGenerator was shut down")
        samples = extractor.extract(prompts)
        return samples_to_results(samples, prompts, self._slots.canonical)

    @property
    def tokenizer(self) -> Any:
        """The target model's tokenizer (loaded on first use; speculators loaded it eagerly)."""
        if self._tokenizer is None:
            from ..tokenizer import load_tokenizer

            # a tokenizer shipped as code (Kimi-K2.5's) is refused unless trust_remote_code
            self._tokenizer = load_tokenizer(local_model_path(self.model_path),
                                             trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    @property
    def vllm_config(self) -> Any:
        """The settings speculators' ``DataGenerationConfig.from_generator`` and scripts read.

        A read-only view (``model_config.max_model_len``, ``cache_config
        .gpu_memory_utilization``, ``parallel_config.tensor_parallel_size``,
        ``scheduler_config.max_num_batched_tokens``) of the values this generator runs with,
        not vLLM's ``VllmConfig`` (which lives inside the extractor's engine).
        """
        return SimpleNamespace(
            model_config=SimpleNamespace(model=self.model_path, max_model_len=self.max_model_len),
            cache_config=SimpleNamespace(gpu_memory_utilization=self.gpu_memory_utilization),
            parallel_config=SimpleNamespace(tensor_parallel_size=self.tensor_parallel_size),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=self.max_num_batched_tokens),
        )

    def shutdown(self) -> None:
        """Stop the extractor's engine (speculators did this in ``__del__``)."""
        ex = self.__dict__.pop("extractor", None)
        close = getattr(ex, "close", None) or getattr(ex, "shutdown", None)
        if close is not None:
            close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: the engine may already be gone
            pass

    def __enter__(self) -> VllmHiddenStatesGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def resolve_layer_ids(layer_ids: Sequence[int] | None, num_layers: int,
                      convention: str) -> tuple[list[int], list[int]]:
    """``(reported_ids, slot_ids)`` for the generator's layer arguments.

    ``reported_ids`` are in the caller's numbering (``generator.layer_ids`` and
    ``data_config.json`` show them); ``slot_ids`` are the vLLM ids of the result's
    ``hidden_states`` tensors, in order. speculators numbering: one slot per distinct id,
    ascending, each id + 1 (0.3/0.4 captured in layer order from a ``frozenset``). vLLM
    numbering: one slot per id, in the given order.
    """
    if convention == _layers.SPECULATORS:
        # 0.3/0.4's default and bounds check, with its error message
        ids = _layers.validate_legacy(
            _layers.legacy_default_layer_ids(num_layers) if layer_ids is None else layer_ids,
            num_layers)
        return ids, _layers.from_legacy(sorted(set(ids)), num_layers)
    if convention != _layers.VLLM:
        raise ValueError(f"unknown layer convention {convention!r}")
    if layer_ids is None and num_layers < 4:
        raise ValueError(f"the model has {num_layers} decoder layers: the default layer ids "
                         "(2, L//2, L-3, final) need at least 4; pass layer_ids")
    ids = (_layers.default_layer_ids(num_layers) if layer_ids is None
           else _layers.validate(layer_ids, num_layers))
    return list(ids), list(ids)
