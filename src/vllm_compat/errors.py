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
