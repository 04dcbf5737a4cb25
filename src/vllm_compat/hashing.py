"""Block hashers that match vLLM's engine core, with ``init_none_hash`` handled for you."""

from __future__ import annotations

import importlib.util
import threading
from typing import TYPE_CHECKING, Any, Callable

from .detect import adapter
from .errors import StaleBlockHasherError, VllmCompatError

if TYPE_CHECKING:  # vLLM's classes, for the type checker only
    from .adapters.vllm_types import Request


_lock = threading.Lock()
# algorithm -> the NONE_HASH our own init_none_hash call produced for it
_none_hash_by_algo: dict[str, bytes] = {}
_init_calls = 0


class BlockHasher:
    """vLLM's per-request block hasher, pinned to the ``NONE_HASH`` it was built with.

    vLLM keeps ``NONE_HASH`` (the root of every hash chain) in a module global that each
    ``init_none_hash`` call replaces. If something re-seeds it after this hasher was made
    (another algorithm, an in-process ``EngineCore`` on a release with a random seed),
    the hashes would silently stop matching the engine's; we raise instead.
    """

    __slots__ = ("block_size", "hash_algo", "lookahead_tokens", "none_hash", "source", "_fn",
                 "_current")

    def __init__(self, fn: Callable[[Any], list[bytes]], none_hash: bytes, block_size: int,
                 hash_algo: str, lookahead_tokens: int, current: Callable[[], bytes | None],
                 source: str = "vllm_compat"):
        self.source = source  # "vllm_compat", or "engine": a live engine's own hasher
        self._fn = fn
        self._current = current
        self.none_hash = none_hash
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.lookahead_tokens = lookahead_tokens

    def __call__(self, request: Request) -> list[bytes]:
        if self._current() != self.none_hash:
            raise StaleBlockHasherError(
                f"vLLM's NONE_HASH was re-initialised after this {self.hash_algo} hasher was "
                "built (another hash algorithm, or an EngineCore started in this process); "
                "its hashes would no longer match the engine's. Call make_block_hasher() again."
            )
        return self._fn(request)

    def __repr__(self) -> str:
        return (f"BlockHasher(block_size={self.block_size}, hash_algo={self.hash_algo!r}, "
                f"source={self.source!r})")


def _none_hash_for(ad: Any, hash_algo: str, fn: Callable[[Any], bytes]) -> bytes:
    """The NONE_HASH to hash with; calls vLLM's init_none_hash only when it must.

    - not set yet in this process: init for ``hash_algo`` (the case that crashes raw code);
    - set by us for this algorithm and unchanged: reuse it;
    - set by us for another algorithm: init for this one (vLLM's last-init-wins rule;
      hashers of the other algorithm then refuse to run, see BlockHasher);
    - set by someone else, i.e. an EngineCore in this process: adopt it, because
      re-initialising would change the engine's own hashes under it.
    """
    global _init_calls
    current = ad.current_none_hash()
    if current is not None:
        if _none_hash_by_algo.get(hash_algo) == current:
            return current
        if current not in _none_hash_by_algo.values():
            _none_hash_by_algo[hash_algo] = current
            return current
    _none_hash_by_algo[hash_algo] = ad.init_none_hash(fn)
    _init_calls += 1
    return _none_hash_by_algo[hash_algo]


def none_hash_init_count() -> int:
    """How many times vllm_compat has called vLLM's ``init_none_hash`` in this process."""
    return _init_calls


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise VllmCompatError(f"block_size must be a positive integer, got {block_size!r}")
    return block_size


# Per process, built once: the validated hash function per algorithm, and the last
# hasher per (block_size, algorithm, lookahead). vLLM's per-request hasher is a pure
# closure (it reads NONE_HASH at call time), so one is reused as long as the root that
# _none_hash_for settles on is the one it was pinned to.
_hash_fns: dict[str, Callable[[Any], bytes]] = {}
_hashers: dict[tuple[int, str, int], BlockHasher] = {}


def _hash_fn(ad: Any, hash_algo: str) -> Callable[[Any], bytes]:
    fn = _hash_fns.get(hash_algo) if isinstance(hash_algo, str) else None
    if fn is not None:
        return fn
    names = ad.hash_function_names()
    no_xxhash = importlib.util.find_spec("xxhash") is None
    if hash_algo not in names:
        note = ""
        if no_xxhash and any(n.startswith("xxhash") for n in names):
            note = " (the xxhash ones need the 'xxhash' package, which is not installed)"
        raise VllmCompatError(
            f"unknown hash algorithm {hash_algo!r}; vLLM {ad.version()} supports {list(names)}{note}"
        )
    if hash_algo.startswith("xxhash") and no_xxhash:
        raise VllmCompatError(f"hash algorithm {hash_algo!r} needs the 'xxhash' package: pip install xxhash")
    fn = _hash_fns[hash_algo] = ad.hash_function(hash_algo)
    return fn


def make_block_hasher(block_size: int, hash_algo: str = "sha256", *,
                      lookahead_tokens: int = 0) -> BlockHasher:
    """Return the block hasher vLLM's engine core builds for ``block_size`` / ``hash_algo``.

    Runs vLLM's ``init_none_hash`` once per process and algorithm (thread-safe), and
    never over a ``NONE_HASH`` an in-process engine already set (see ``_none_hash_for``).
    ``block_size`` is the engine's *hash* block size (equal to the KV block size for one
    attention group). ``lookahead_tokens`` mirrors ``num_hash_lookahead_tokens`` (0.33+).
    Cheap to call per request: the same hasher comes back while its root is current.
    """
    _check_block_size(block_size)
    if isinstance(lookahead_tokens, bool) or not isinstance(lookahead_tokens, int) or lookahead_tokens < 0:
        raise VllmCompatError(f"lookahead_tokens must be an integer >= 0, got {lookahead_tokens!r}")
    key = (block_size, hash_algo, lookahead_tokens)
    cached = _hashers.get(key) if type(hash_algo) is str else None
    if cached is not None:
        # Lock-free hit: _none_hash_for's first case (root set by us for this algorithm
        # and unchanged) returns it without touching any state.
        current = cached._current()
        if current == cached.none_hash and _none_hash_by_algo.get(hash_algo) == current:
            return cached
    ad = adapter()
    fn = _hash_fn(ad, hash_algo)
    with _lock:
        none_hash = _none_hash_for(ad, hash_algo, fn)
        cached = _hashers.get(key)
        if cached is not None and cached.none_hash == none_hash:
            return cached
        inner = cached._fn if cached is not None else ad.request_block_hasher(
            block_size, fn, lookahead_tokens)
        hasher = _hashers[key] = BlockHasher(inner, none_hash, block_size, hash_algo,
                                             lookahead_tokens, ad.current_none_hash)
    return hasher


def block_hasher_for(target: Any) -> BlockHasher:
    """The hasher a live engine admits requests with, for requests built here.

    ``target``: an ``EngineCore``, an in-process ``LLM`` / ``LLMEngine`` (its engine core), or
    a ``Scheduler`` (the one an ``EngineCore`` owns, or one from ``make_scheduler``). A
    scheduler does not refer to its engine: the engine is found from it through the garbage
    collector's referrers, which cannot see an engine that froze its GC heap (0.16.0 and later
    do); then the scheduler is treated as a standalone one.

    - An engine with a hasher (prefix caching on): that very hasher
      (``EngineCore.request_block_hasher``, kept by every release 0.10.2-0.34), wrapped as a
      :class:`BlockHasher` with ``source == "engine"``.
    - Otherwise ours, for the engine's hash block size and algorithm, after checking it once
      per process against the hasher an EngineCore of this vLLM builds, on chat-like probe
      requests (special and reserved ids, with and without ``cache_salt``):
      :class:`~vllm_compat.errors.EngineHashMismatchError` when they differ.
    """
    from . import hash_check
    from .engine_hashing import engine_core_of, engine_request_hasher

    ad = adapter()
    core, scheduler = engine_core_of(target)
    owner = core if core is not None else scheduler
    config = owner.vllm_config
    algo = config.cache_config.prefix_caching_hash_algo
    block_size = (ad.scheduler_hash_block_size(scheduler) if scheduler is not None
                  else int(config.cache_config.block_size))
    # 0.33.0 added VllmConfig.num_hash_lookahead_tokens (EAGLE block-drop drafters); before
    # it the engine hashed without lookahead
    lookahead = int(getattr(config, "num_hash_lookahead_tokens", 0) or 0)
    engine_fn = engine_request_hasher(core) if core is not None else None
    if engine_fn is not None:
        root = ad.current_none_hash() or b""
        return BlockHasher(engine_fn, root, block_size, algo, lookahead, lambda: root,
                           source="engine")
    hasher = make_block_hasher(block_size, algo, lookahead_tokens=lookahead)
    model = getattr(config, "model_config", None)
    vocab = None
    try:
        vocab = int(model.get_vocab_size()) if model is not None else None
    except Exception:  # noqa: BLE001 - a config without a vocab: the default probes
        vocab = None
    hash_check.verify(algo, block_size, lookahead, vocab)
    return hasher


def attach_block_hasher(request: Request, hasher: Callable[[Any], list[bytes]]) -> None:
    """Give a Request built elsewhere (without a hasher) one, and hash its full blocks now."""
    adapter().attach_block_hasher(request, hasher)
