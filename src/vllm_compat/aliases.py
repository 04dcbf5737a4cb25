"""Declared aliases: the user's word that a vLLM name vllm_compat looks for now has another
name (pure Python: never imports vLLM).

A vLLM build that renamed something vllm_compat uses (``sample_tokens`` on the workers and
executors, say) need not wait for a release of vllm_compat: declare the new name, as

    VLLM_COMPAT_ALIASES="sample_tokens=sample_step_tokens"      # comma-separated pairs
    vllm_compat.alias(sample_tokens="sample_step_tokens")       # the same, from code

The resolver (:mod:`vllm_compat.resolve`) uses an alias only where the declared name is
missing, and only after checking that the aliased object takes the call vllm_compat makes
(the same parameters); ``vllm-compat doctor --drift`` reports every use as drift "resolved
by alias". A name is never replaced by a guess: the successors the resolver finds on its own
are named in the error and the report, and used only once declared here.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Mapping

ENV = "VLLM_COMPAT_ALIASES"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_lock = threading.Lock()
_declared: dict[str, str] = {}  # from alias(); the environment variable is read on each call


def parse(text: str) -> dict[str, str]:
    """``"a=b, c=d"`` -> ``{"a": "b", "c": "d"}``; a malformed pair raises ValueError."""
    out: dict[str, str] = {}
    for pair in (p.strip() for p in text.split(",")):
        if not pair:
            continue
        old, sep, new = (s.strip() for s in pair.partition("="))
        if not sep or not _NAME.match(old) or not _NAME.match(new) or old == new:
            raise ValueError(f"{ENV}: {pair!r} is not of the form old_name=new_name "
                             "(two different Python identifiers)")
        out[old] = new
    return out


def declare(names: Mapping[str, str]) -> None:
    """Add aliases (``old=new``); ``new=None`` or ``""`` removes one."""
    with _lock:
        for old, new in names.items():
            if not new:
                _declared.pop(old, None)
                continue
            parse(f"{old}={new}")  # validated like the environment variable
            _declared[old] = new


def clear() -> None:
    with _lock:
        _declared.clear()


def current(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every alias in force: the environment variable's, overridden by :func:`declare`'s."""
    env = os.environ if env is None else env
    out = parse(env.get(ENV, ""))
    with _lock:
        out.update(_declared)
    return out


def how(old: str, new: str) -> str:
    """How an alias was declared, for the report."""
    return (f"{ENV}={old}={new}" if parse(os.environ.get(ENV, "")).get(old) == new
            and old not in _declared else f"vllm_compat.alias({old}={new!r})")
