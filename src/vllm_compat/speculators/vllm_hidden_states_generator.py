"""Drop-in ``VllmHiddenStatesGenerator`` for speculators 0.3.0 / 0.4.x forks.

Same constructor parameters, same ``generate(token_ids)`` and the same return format as
``speculators.data_generation.vllm_hidden_states_generator.VllmHiddenStatesGenerator``
(0.4.0.1; 0.3.0's parameters are a prefix of it), running on every vLLM release
vllm_compat supports. The capture itself is :class:`vllm_compat.extract.HiddenStatesExtractor`;
this class translates arguments and shapes results the way speculators' training reads them.

Fixed against speculators 0.3/0.4:

* results are in **input order** (0.4.x iterated ``sorted()`` string request ids, so
  ``req_0_10`` came before ``req_0_2`` and batches of >= 11 mispaired loss masks);
* no truthiness test on tensors (0.3.0's ``if not aux_hidden_states`` raised);
* layer ids mean the state **entering** layer k, as vLLM's EAGLE-3 path defines them
  (see :mod:`vllm_compat.speculators.layers`); ``legacy_layer_indices=True`` reproduces
  0.3/0.4's "output of layer i" ids for drafts already trained on them.

This module never imports vLLM; torch and the extractor are imported when used.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from . import layers as _layers

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
    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)


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
    """Which extracted layer (by canonical id) fills each result slot, in the caller's order."""

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

    ``legacy_layer_indices``: ``True`` reads ``layer_ids`` the speculators 0.3/0.4 way
    (output of layer i, default ``[2, L//2, L-3, L-1]``) and captures exactly what those
    releases captured; ``False`` (the default) reads them as vLLM / EAGLE-3 do (state
    entering layer k, default ``[2, L//2, L-3, L]``). Leaving it unset while passing
    ``layer_ids`` emits a ``UserWarning``, since the same numbers now mean one layer earlier.
    ``extractor_kwargs``: extra keywords for ``HiddenStatesExtractor`` (and through it,
    vLLM's ``LLM``), e.g. ``{"enforce_eager": False}`` or ``{"dtype": "bfloat16"}``.

    ``generate(token_ids)`` returns one dict per prompt, in input order:
    ``input_ids`` LongTensor[T], ``hidden_states`` list of ``len(layer_ids)`` tensors [T, H]
    (model dtype, CPU), ``loss_mask`` None. Prompts longer than ``max_model_len - 1`` are
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
        self._tokenizer = None

        local_path = local_model_path(model_path)
        # speculators 0.3/0.4 hard-coded trust_remote_code=True: code shipped with a
        # checkpoint ran unasked. Here it is the caller's choice, off by default.
        self.trust_remote_code = bool(trust_remote_code)
        self.config = _model_config(local_path, self.trust_remote_code)
        self.num_layers = num_hidden_layers(self.config)
        self.legacy_layer_indices, self.layer_ids, self.capture_layer_ids = resolve_layer_ids(
            layer_ids, self.num_layers, legacy_layer_indices)
        log.info("hidden states from layers %s (%s convention; extractor ids %s)",
                 self.layer_ids, "legacy speculators 0.3/0.4" if self.legacy_layer_indices
                 else "vLLM/EAGLE-3", self.capture_layer_ids)
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

    # ------------------------------------------------------------------ speculators API

    def generate(self, token_ids: list[list[int]] | torch.Tensor) -> list[dict]:  # noqa: F821
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
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.model_path, trust_remote_code=self.trust_remote_code)
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
                      legacy: bool | None) -> tuple[bool, list[int], list[int]]:
    """``(legacy, reported_ids, canonical_ids)`` for the generator's layer arguments.

    ``reported_ids`` are in the caller's convention (what ``generator.layer_ids`` and
    ``data_config.json`` show); ``canonical_ids`` are what the extractor is asked for.
    """
    if layer_ids is not None and legacy is None:
        warnings.warn(
            "VllmHiddenStatesGenerator(layer_ids=...) now means the hidden state ENTERING "
            "decoder layer k (vLLM / EAGLE-3 convention); speculators 0.3/0.4 captured the "
            "OUTPUT of layer k, i.e. k+1 here. Pass legacy_layer_indices=True to keep the old "
            "meaning (drafts trained on 0.3/0.4 data), or False to silence this warning.",
            UserWarning, stacklevel=3,
        )
    legacy = bool(legacy)
    if layer_ids is None and num_layers < 4:
        raise ValueError(f"the model has {num_layers} decoder layers: the default layer ids "
                         "(2, L//2, L-3, final) need at least 4; pass layer_ids")
    if legacy:
        ids = (_layers.legacy_default_layer_ids(num_layers) if layer_ids is None
               else _layers.validate_legacy(layer_ids, num_layers))
        return True, list(ids), _layers.from_legacy(ids, num_layers)
    ids = (_layers.default_layer_ids(num_layers) if layer_ids is None
           else _layers.validate(layer_ids, num_layers))
    return False, list(ids), list(ids)
