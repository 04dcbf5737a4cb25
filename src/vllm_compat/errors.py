"""Exceptions raised by vllm_compat. All derive from :class:`VllmCompatError`."""

from __future__ import annotations


class VllmCompatError(Exception):
    """Base class for every error vllm_compat raises on purpose."""


class VllmNotInstalledError(VllmCompatError, ImportError):
    """vLLM is not importable; raised on first use, never by ``import vllm_compat``."""


class InvalidVllmVersionError(VllmCompatError, ValueError):
    """A version string that PEP 440 cannot parse."""


class UnsupportedVllmVersionError(VllmCompatError):
    """The installed vLLM is outside the range an adapter exists for."""


class UnknownAdapterError(VllmCompatError, ValueError):
    """``VLLM_COMPAT_ADAPTER`` (or ``adapter=``) names no adapter."""


class UnsupportedFeatureError(VllmCompatError):
    """The installed vLLM lacks a feature the caller asked for."""


class VllmDriftError(VllmCompatError):
    """The installed vLLM differs from the surface vllm_compat relies on (a symbol moved or
    is missing, a signature or a return type changed) in a way that breaks a capability.

    Carries what ``vllm-compat doctor --drift`` reports for the same change: the capability,
    the vLLM version, the symbol, what was expected and what was found, and the workaround
    where one exists.
    """

    def __init__(self, *, capability: str, vllm_version: str, symbol: str, expected: str,
                 found: str, workaround: str = "") -> None:
        self.capability = capability
        self.vllm_version = vllm_version
        self.symbol = symbol
        self.expected = expected
        self.found = found
        self.workaround = workaround
        msg = (f"{capability}: vLLM {vllm_version} drifted from what vllm_compat expects: "
               f"{symbol}: expected {expected}; found {found}")
        msg += f". Workaround: {workaround}" if workaround else ". No workaround is known"
        super().__init__(msg + " (`vllm-compat doctor --drift` lists every change)")

    def __reduce__(self):  # keep the keywords through pickling (worker processes)
        return (_rebuild, (type(self), self.capability, self.vllm_version, self.symbol,
                           self.expected, self.found, self.workaround))


def _rebuild(cls, capability, vllm_version, symbol, expected, found, workaround):
    return cls(capability=capability, vllm_version=vllm_version, symbol=symbol,
               expected=expected, found=found, workaround=workaround)


class MissingSymbolError(VllmDriftError, AttributeError):
    """A vLLM symbol is at none of its known locations and a search did not find it."""


class SignatureDriftError(VllmDriftError, TypeError):
    """A vLLM callable gained a required parameter, or lost one vllm_compat passes."""


class ReturnTypeDriftError(VllmDriftError, TypeError):
    """A vLLM callable returned another type than the one vllm_compat relies on."""


class RejectedAliasError(VllmDriftError, AttributeError):
    """A declared alias (``VLLM_COMPAT_ALIASES`` / ``vllm_compat.alias``) names nothing, or
    something that does not take the call vllm_compat makes: it is not used."""


class EngineHashMismatchError(VllmDriftError):
    """The engine's request hasher and vllm_compat's give different block hashes for the same
    request: their requests would never share a prefix-cache block.

    ``differs`` says which side departs from vLLM's own ``hash_block_tokens`` chain under the
    engine's algorithm: "engine", "vllm_compat", "both", or "engine or vllm_compat" where that
    chain could not be computed. The workaround is the engine's own hasher.
    """

    def __init__(self, *, capability: str, vllm_version: str, symbol: str, expected: str,
                 found: str, workaround: str = "", differs: str = "") -> None:
        super().__init__(capability=capability, vllm_version=vllm_version, symbol=symbol,
                         expected=expected, found=found, workaround=workaround)
        self.differs = differs

    def __reduce__(self):
        return (_rebuild_mismatch, (self.capability, self.vllm_version, self.symbol,
                                    self.expected, self.found, self.workaround, self.differs))


def _rebuild_mismatch(capability, vllm_version, symbol, expected, found, workaround, differs):
    return EngineHashMismatchError(capability=capability, vllm_version=vllm_version,
                                   symbol=symbol, expected=expected, found=found,
                                   workaround=workaround, differs=differs)


class StaleBlockHasherError(VllmCompatError, RuntimeError):
    """vLLM's process-global ``NONE_HASH`` changed after this hasher was built.

    Hashes from the hasher would no longer match the engine's; build a new one.
    """


class InvalidLayerIdError(VllmCompatError, ValueError):
    """A layer id outside ``0..L``, negative, duplicated or not an integer."""


class TargetMismatchError(VllmCompatError, ValueError):
    """A dataset, vocabulary mapping or trained draft was made for another target model."""


class TrainingCheckpointError(VllmCompatError, ValueError):
    """A training checkpoint that cannot be read or resumed from."""
