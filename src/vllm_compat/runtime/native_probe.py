"""Does vLLM's own extract_hidden_states path keep a target's states intact on this release?

``backend="native"`` (vLLM's ``extract_hidden_states`` method with
``ExampleHiddenStatesConnector``) stores the captured states in the KV cache of one extra
layer, ``CacheOnlyAttentionLayer``: ``num_kv_heads`` = the number of layer ids ``K``,
``head_size`` = the hidden size ``H``. What decides whether they come back intact is how the
installed vLLM groups that layer with the model's own KV-cache layers:

* vLLM 0.17.1-0.21.0 (seen on CPU): beside MLA layers (DeepSeek-V2/V3, Kimi-K2.5: one
  ``1 x (kv_lora_rank + qk_rope_head_dim)`` head) the hidden-state layer joins the model's
  single MLA group and takes that group's ``1 x 576`` spec (``MLAAttentionSpec.merge``
  ignores head dimensions), so its cache has the wrong shape;
* later releases keep each layer's own spec inside one group
  (``UniformTypeKVCacheSpecs``), or give the hidden-state layer a group of its own; the
  connector (0.25.1+) must then find that group, and raises "MLA verifiers are unsupported"
  when it cannot.

:func:`native_path_check` runs exactly that on the installed vLLM, on the CPU, before any
engine is built: vLLM's own ``get_kv_cache_groups`` on the target's layer specs plus the
hidden-state layer's, then the connector's own group lookup. Measured on one H200 with
vLLM 0.26.0, the path this check passes does give the aux path's states for the tiny
DeepSeek-V3 and the Kimi-K2.5 ``kimi-tp8`` shape (docs/extraction.md).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any, Sequence

from ..target import TargetInfo

__all__ = ["NativeCheck", "native_path_check"]

_KV_IFACE = "vllm.v1.kv_cache_interface"
# Where this check finds vLLM's pieces (0.17.1-0.34.0); 0.33 moved the grouping function to
# kv_cache_planning. A build that has none of them makes the check answer "cannot tell".
_WHERE = {
    "get_kv_cache_groups": ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning"),
    "MLAAttention": ("vllm.model_executor.layers.attention.mla_attention",),
    "CacheOnlyAttentionLayer": ("vllm.model_executor.models.extract_hidden_states",),
}
_HIDDEN_LAYER = "model.layers.hidden_states_cache.attn"  # a name of our own: only its group matters


@dataclasses.dataclass(frozen=True)
class NativeCheck:
    """``ok``: True (intact), False (not), None (this release could not be checked)."""
    ok: bool | None
    reason: str
    groups: tuple[str, ...] = ()  # what vLLM made of the layers, for reports


def _module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _find(name: str) -> Any:
    for module in _WHERE[name]:
        obj = getattr(_module(module), name, None)
        if obj is not None:
            return obj
    return None


def _spec(cls: type, **kw: Any) -> Any:
    """A spec dataclass built with the fields this release has (signatures drift)."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(
        inspect.signature(cls).parameters)
    return cls(**{k: v for k, v in kw.items() if k in fields})


class _DenseMLABackend:
    """What 0.31+'s ``MLAAttention.get_kv_cache_spec`` asks of the layer's attention backend:
    its name, to tell the sparse FlashMLA / FlashInfer layouts apart. Every dense MLA backend
    (TRITON_MLA, FLASHMLA, FLASH_ATTN_MLA, CUTLASS_MLA) gives the same spec, and sparse models
    are answered "cannot tell" before this runs."""

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"


def _own_spec(cls: Any, vllm_config: Any, **attrs: Any) -> Any:
    """``cls.get_kv_cache_spec`` of this release, run on an instance built without its
    ``__init__`` (which would load kernels) that carries the attributes it reads: the spec
    exactly as the release's layer class builds it, its own helper methods included (0.31+
    calls ``self._uses_flat_kv_cache()``)."""
    layer = object.__new__(cls)
    vars(layer).update(attrs)  # past nn.Module.__setattr__, which needs __init__'s state
    return cls.get_kv_cache_spec(layer, vllm_config)


def _layer_specs(target: TargetInfo, num_ids: int, cfg: Any,
                 tensor_parallel_size: int) -> tuple[dict[str, Any], Any]:
    """Each layer's KV-cache spec, the model's and the hidden-state layer's, for ``cfg``."""
    iface = _module(_KV_IFACE)
    tc = target.text_config
    L = target.num_hidden_layers
    block_size = cfg.cache_config.block_size
    dtype = cfg.model_config.dtype
    if target.is_mla:
        # one latent head of kv_lora_rank + qk_rope_head_dim (DeepSeek-V2/V3, Kimi): a dense
        # MLA layer, no sparse indexer, no sliding window (0.33 reads these four)
        layer = _own_spec(_find("MLAAttention"), cfg, kv_cache_dtype=cfg.cache_config.cache_dtype,
                          head_size=int(tc["kv_lora_rank"]) + int(tc.get("qk_rope_head_dim", 64)),
                          num_heads=int(tc["num_attention_heads"]) // tensor_parallel_size,
                          block_size=block_size, sliding_window=None, indexer=None,
                          topk_buffer_width=None, non_causal_multi_token_decode=False,
                          attn_backend=_DenseMLABackend)
    else:
        heads = int(tc.get("num_key_value_heads") or tc["num_attention_heads"])
        head_dim = int(tc.get("head_dim") or target.hidden_size // int(tc["num_attention_heads"]))
        layer = _spec(iface.FullAttentionSpec, block_size=block_size,
                      num_kv_heads=max(1, heads // tensor_parallel_size), head_size=head_dim,
                      dtype=dtype)
    hidden = _own_spec(_find("CacheOnlyAttentionLayer"), cfg, num_heads=num_ids,
                       head_size=target.hidden_size, kv_cache_torch_dtype=dtype,
                       block_size=block_size, kv_cache_dtype=cfg.cache_config.cache_dtype)
    specs = {f"model.layers.{i}.self_attn.attn": layer for i in range(L)}
    specs[_HIDDEN_LAYER] = hidden
    return specs, hidden


def _describe(group: Any) -> str:
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)
    shape = (f"{getattr(spec, 'num_kv_heads', '?')}x{getattr(spec, 'head_size', '?')}"
             if inner is None else "per-layer")
    return f"{type(spec).__name__}({shape}, {len(group.layer_names)} layers)"


def native_path_check(target: TargetInfo, layer_ids: Sequence[int], *, block_size: int = 16,
                      tensor_parallel_size: int = 1) -> NativeCheck:
    """Whether the installed vLLM's extract_hidden_states connector keeps ``target``'s states
    for ``layer_ids`` intact (see the module doc). Never raises: a release whose pieces
    cannot be found or called gives ``ok=None`` with the reason."""
    tc = target.text_config
    if target.is_mla and (tc.get("index_topk") or tc.get("sliding_window")):
        return NativeCheck(None, "a sparse-attention or sliding-window MLA model (DeepSeek-V3.2 "
                                 "style): its layer specs are not the dense ones this check builds")
    try:
        get_groups = _find("get_kv_cache_groups")
        connector = _module("vllm.distributed.kv_transfer.kv_connector.v1."
                            "example_hidden_states_connector")
        if (get_groups is None or connector is None or _find("CacheOnlyAttentionLayer") is None
                or (target.is_mla and _find("MLAAttention") is None)):
            return NativeCheck(None, "this vLLM has no extract_hidden_states connector or no "
                                     "KV-cache grouping function to check it with")
        from ..scheduling import make_vllm_config

        cfg = make_vllm_config(target.path, block_size=block_size)
        specs, hidden = _layer_specs(target, len(layer_ids), cfg, tensor_parallel_size)
        groups = get_groups(cfg, dict(specs))
    except Exception as exc:  # noqa: BLE001 - any failure means: cannot tell
        return NativeCheck(None, f"the check could not run on this vLLM: {type(exc).__name__}: "
                                 f"{exc}")
    seen = tuple(_describe(g) for g in groups)
    where = [g for g in groups if _HIDDEN_LAYER in g.layer_names]
    if len(where) != 1:
        return NativeCheck(False, "vLLM put the hidden-state cache layer in "
                                  f"{len(where)} KV-cache groups", seen)
    spec = where[0].kv_cache_spec
    own = (getattr(spec, "kv_cache_specs", None) or {}).get(_HIDDEN_LAYER, spec)
    want = (hidden.num_kv_heads, hidden.head_size)
    got = (getattr(own, "num_kv_heads", None), getattr(own, "head_size", None))
    if got != want:
        return NativeCheck(False, f"vLLM groups the hidden-state cache layer with the model's "
                                  f"layers under a {got[0]}x{got[1]} spec (it needs "
                                  f"{want[0]}x{want[1]}): the states would come back "
                                  "mis-shaped", seen)
    find = getattr(connector.ExampleHiddenStatesConnector, "_find_cache_kv_group_id", None)
    if find is not None:  # 0.25.1+: the connector looks its group up at start
        try:
            gid = find(types.SimpleNamespace(kv_cache_groups=groups))
        except ValueError as exc:
            return NativeCheck(False, f"vLLM's connector refuses it: {exc}", seen)
        if _HIDDEN_LAYER not in groups[gid].layer_names:
            return NativeCheck(False, f"vLLM's connector would read group {gid}, which does not "
                                      "hold the hidden-state cache layer", seen)
    return NativeCheck(True, "the hidden-state cache layer keeps its own "
                             f"{want[0]}x{want[1]} spec", seen)
