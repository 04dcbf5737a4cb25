"""Our block hashes against the engine's, on probe requests like real chat traffic.

vllm_compat's hasher and the engine's are both built from vLLM functions; a vLLM build can
still make them differ (a hash function wrapped on the engine's path only, another root).
Then requests built by vllm_compat and requests the engine admits never share a prefix-cache
block, silently. :func:`check` hashes the same probe requests three ways, under a fixed
``PYTHONHASHSEED`` so that every side derives ``NONE_HASH`` from the same seed:

- ``engine``: the request hasher an ``EngineCore`` builds (``engine_hashing.engine_path_hasher``);
- ``vllm_compat``: what ``make_block_hasher`` composes;
- ``vllm``: vLLM's own ``hash_block_tokens`` chain over ``generate_block_hash_extra_keys``,
  under the engine's algorithm: it tells which side moved when the two differ.

vLLM's ``NONE_HASH`` state is put back as it was afterwards. :func:`fingerprint` records the
engine's hashes of the same probes per algorithm (``matrix/snapshot.py`` stores them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from .detect import adapter
from .engine_hashing import EnginePathUnknown, engine_core_class, engine_path_hasher
from .errors import EngineHashMismatchError, VllmCompatError


def _resolve():
    from . import resolve  # imports vLLM: only when a function here runs

    return resolve


BLOCK_SIZE = 16
SEED = "vllm-compat-hash-check"  # PYTHONHASHSEED while probing: one root for every side
# Kimi-K2.5's special and reserved ids (163584-163839, vocab 163840): used where the model's
# vocab has them, else the same roles at the top of its vocab
KIMI_FIRST_SPECIAL, KIMI_VOCAB = 163584, 163840
KIMI_ROLES = {"bos": 163584, "im_end": 163586, "im_user": 163587, "im_assistant": 163588,
              "im_system": 163594, "im_middle": 163601, "reserved": 163777, "pad": 163839}
WORKAROUND = ("use the engine's own hasher: block_hasher_for(engine_core | llm | scheduler), "
              "or make_request(..., block_hasher=<the engine's request_block_hasher>)")


def _text_ids(n: int, seed: int, limit: int) -> list[int]:
    """``n`` ordinary-token ids below ``limit``, spread over the vocab (a fixed LCG)."""
    out, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(x % limit)
    return out


def probe_token_ids(vocab_size: int | None = None) -> list[int]:
    """A chat-like prompt: role headers and end markers (special ids), a reserved id, and
    ordinary text, 5 full blocks of 16 and a partial one."""
    vocab = KIMI_VOCAB if vocab_size is None else vocab_size
    if vocab >= KIMI_VOCAB:
        role, text_limit = KIMI_ROLES, KIMI_FIRST_SPECIAL
    else:  # a smaller model: the same roles on its top ids
        top = [vocab - 1 - i for i in range(len(KIMI_ROLES))]
        role = dict(zip(KIMI_ROLES, top))
        text_limit = max(1, vocab - len(KIMI_ROLES))
    return ([role["bos"], role["im_system"]] + _text_ids(9, 1, text_limit)
            + [role["im_middle"], role["im_end"], role["im_user"]] + _text_ids(30, 2, text_limit)
            + [role["reserved"], 0, 1, 2, role["im_end"], role["im_assistant"]]
            + _text_ids(30, 3, text_limit) + [role["im_end"], role["pad"], role["pad"]]
            + _text_ids(7, 4, text_limit))


PROBES: tuple[tuple[str, str | None], ...] = (
    ("chat", None), ("chat, cache_salt", "tenant-a"), ("chat, other cache_salt", "tenant-b"))


@contextlib.contextmanager
def root_state(*init_fns: Callable[..., Any]) -> Iterator[None]:
    """vLLM's ``NONE_HASH`` (and 0.29+'s ``_NONE_HASH_SEED``) put back as they were, in every
    module an ``init_none_hash`` writes to; ``PYTHONHASHSEED`` pinned to :data:`SEED` meanwhile."""
    found = [getattr(f, "__globals__", None) for f in init_fns]
    try:
        found.append(vars(_resolve().module_of("init_none_hash")))
    except VllmCompatError:  # vLLM lost it: only the engine's own module is written to
        pass
    spaces: list[dict[str, Any]] = []
    for space in found:
        if isinstance(space, dict) and all(space is not t for t in spaces):
            spaces.append(space)
    missing = object()
    saved = [(s, {k: s.get(k, missing) for k in ("NONE_HASH", "_NONE_HASH_SEED")}) for s in spaces]
    env = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = SEED
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = env
        for space, values in saved:
            for k, v in values.items():
                if v is missing:
                    space.pop(k, None)
                else:
                    space[k] = v


def _probe_requests(vocab_size: int | None) -> list[tuple[str, Any]]:
    # the adapter's Request (what make_request builds), with no hasher of its own
    ad = adapter()
    ids = probe_token_ids(vocab_size)
    return [(name, ad.new_request(f"hash-check {name}", list(ids), block_hasher=None,
                                  cache_salt=salt))
            for name, salt in PROBES]


def _hex(hashes: list[Any]) -> list[str]:
    return [bytes(h).hex() for h in hashes]


def _vllm_chain(fn: Callable[[Any], bytes], block_size: int, request: Any) -> list[bytes]:
    """vLLM's own block-hash chain: ``hash_block_tokens`` over each full block, with
    ``generate_block_hash_extra_keys`` (cache salt, LoRA, multi-modal keys)."""
    hash_block_tokens = _resolve().sym("hash_block_tokens")
    extra_keys = _resolve().sym("generate_block_hash_extra_keys")
    tokens = list(request.all_token_ids)
    out: list[bytes] = []
    parent, mm_idx = None, 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        keys, mm_idx = extra_keys(request, start, start + block_size, mm_idx)
        parent = hash_block_tokens(fn, parent, tokens[start:start + block_size], keys)
        out.append(parent)
    return out


@dataclass
class HashCheck:
    """One algorithm's comparison. ``differs``: None (equal), "engine", "vllm_compat",
    "both", or "engine or vllm_compat" (vLLM's own chain could not be computed)."""

    hash_algo: str
    block_size: int
    lookahead_tokens: int = 0
    differs: str | None = None
    error: str | None = None  # nothing compared: why
    # whose hasher could not be built: "engine" (its set-up cannot be replayed) or
    # "vllm_compat" (our hashing drifted: the drift report names that on its own)
    error_side: str | None = None
    probes: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.differs is None and self.error is None

    def line(self) -> str:
        head = f"{self.hash_algo} (block {self.block_size})"
        if self.error:
            return f"{head}: cannot tell: {self.error}"
        if self.differs is None:
            n = sum(len(p["engine"]) for p in self.probes.values())
            return (f"{head}: engine and vllm_compat equal on {len(self.probes)} probe requests "
                    f"({n} block hashes)")
        return f"{head}: differs: {self.differs} (the engine's hashes are not vllm_compat's)"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ours(hash_algo: str, block_size: int, lookahead_tokens: int) -> Callable[[Any], list[Any]]:
    # exactly what make_block_hasher composes (without its per-process root bookkeeping)
    ad = adapter()
    fn = ad.hash_function(hash_algo)
    ad.init_none_hash(fn)
    return ad.request_block_hasher(block_size, fn, lookahead_tokens)


_lock = threading.RLock()


def check(hash_algo: str, block_size: int = BLOCK_SIZE, lookahead_tokens: int = 0,
          vocab_size: int | None = None) -> HashCheck:
    """Compare the engine's, vllm_compat's and vLLM's own hashes of the probe requests."""
    result = HashCheck(hash_algo, block_size, lookahead_tokens)
    requests = _probe_requests(vocab_size)
    core_init = vars(sys.modules[engine_core_class().__module__]).get("init_none_hash")
    with _lock, root_state(*([core_init] if callable(core_init) else [])):
        try:
            engine = engine_path_hasher(hash_algo, block_size, lookahead_tokens)
            hashes_e = {name: engine(r) for name, r in requests}
        except (EnginePathUnknown, VllmCompatError) as exc:
            result.error, result.error_side = str(exc), "engine"
            return result
        try:
            ours = _ours(hash_algo, block_size, lookahead_tokens)
            hashes_o = {name: ours(r) for name, r in requests}
        except VllmCompatError as exc:  # hashing drifted on our side: reported as such
            result.error, result.error_side = f"vllm_compat's hasher: {exc}", "vllm_compat"
            return result
        hashes_v: dict[str, list[Any]] | None = None
        if not lookahead_tokens:  # vLLM's plain chain has no lookahead keys
            try:
                fn = _resolve().sym("get_hash_fn_by_name")(hash_algo)
                _resolve().sym("init_none_hash")(fn)
                hashes_v = {name: _vllm_chain(fn, block_size, r) for name, r in requests}
            except Exception:  # noqa: BLE001 - the tie-breaker is optional
                hashes_v = None
    for name, _ in requests:
        row = {"engine": _hex(hashes_e[name]), "vllm_compat": _hex(hashes_o[name])}
        if hashes_v is not None:
            row["vllm"] = _hex(hashes_v[name])
        result.probes[name] = row
    rows = result.probes.values()
    if all(r["engine"] == r["vllm_compat"] for r in rows):
        return result
    if hashes_v is None:
        result.differs = "engine or vllm_compat"
    elif all(r["engine"] == r["vllm"] for r in rows):
        result.differs = "vllm_compat"
    elif all(r["vllm_compat"] == r["vllm"] for r in rows):
        result.differs = "engine"
    else:
        result.differs = "both"
    return result


def mismatch_error(result: HashCheck) -> EngineHashMismatchError:
    name = next(n for n, r in result.probes.items() if r["engine"] != r["vllm_compat"])
    row = result.probes[name]
    i = next(i for i, (a, b) in enumerate(zip(row["engine"], row["vllm_compat"])) if a != b)
    return EngineHashMismatchError(
        capability="hashing", vllm_version=adapter().version(),
        symbol=f"EngineCore request hasher ({result.hash_algo}, block {result.block_size})",
        expected="the engine's block hashes equal vllm_compat's",
        found=(f"probe request {name!r} differs from block {i} on (engine {row['engine'][i][:16]}"
               f"..., vllm_compat {row['vllm_compat'][i][:16]}...); differs: {result.differs}"),
        workaround=WORKAROUND, differs=result.differs or "")


_verified: dict[tuple[str, int, int, int | None], HashCheck] = {}


def verify(hash_algo: str, block_size: int, lookahead_tokens: int = 0,
           vocab_size: int | None = None) -> HashCheck:
    """:func:`check`, once per process and key; :class:`EngineHashMismatchError` on a mismatch."""
    key = (hash_algo, block_size, lookahead_tokens, vocab_size)
    with _lock:
        result = _verified.get(key)
        if result is None:
            result = _verified[key] = check(hash_algo, block_size, lookahead_tokens, vocab_size)
    if result.differs is not None:
        raise mismatch_error(result)
    return result


def offered_algorithms() -> list[str]:
    """The algorithms this release offers whose functions can run here (xxhash needs its
    package)."""
    names = list(adapter().hash_function_names())
    if importlib.util.find_spec("xxhash") is None:
        names = [n for n in names if not n.startswith("xxhash")]
    return names


def default_algorithm() -> str:
    import dataclasses

    cls = _resolve().get("CacheConfig")
    for f in dataclasses.fields(cls) if cls is not None and dataclasses.is_dataclass(cls) else ():
        if f.name == "prefix_caching_hash_algo" and isinstance(f.default, str):
            return f.default
    return "sha256"


def check_all() -> list[HashCheck]:
    """:func:`check` for every algorithm the release offers (doctor --drift)."""
    return [check(a) for a in offered_algorithms()]


def fingerprint(results: list[HashCheck] | None = None) -> dict[str, Any]:
    """The engine's block hashes of the probe requests per algorithm (hex), under
    ``PYTHONHASHSEED`` = :data:`SEED`, block size 16: what a snapshot records."""
    results = check_all() if results is None else results
    return {"seed": SEED, "block_size": BLOCK_SIZE, "default": default_algorithm(),
            "algos": {r.hash_algo: {n: p["engine"] for n, p in r.probes.items()}
                      for r in results if r.error is None}}


def strict_drift_line(info: Any) -> str | None:
    """For ``VLLM_COMPAT_STRICT=drift`` on an untested build: the engine's block hashes under
    its default algorithm against ours. A line when they differ; None when they agree or the
    check cannot tell (``doctor --drift`` reports that)."""
    try:
        algo = default_algorithm()
        result = check(algo)
    except Exception:  # noqa: BLE001 - cannot tell is no refusal; doctor --drift says why
        return None
    if result.error or result.differs is None:
        return None
    return (f"hashing: EngineCore request hasher ({algo}): expected the engine's block hashes "
            f"equal vllm_compat's; found differs: {result.differs} (workaround: {WORKAROUND})")
