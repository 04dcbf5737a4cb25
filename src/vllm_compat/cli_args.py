"""Argument checks for the ``vllm-compat`` commands, run when the command line is parsed.

The ``type=`` functions check one value (argparse turns their ``ArgumentTypeError`` into
the contract's two-line error, exit 2); :func:`check_layer_ids` and the ``require_*``
helpers check what needs several arguments (the target's layer count for the layer ids)
and raise :class:`~vllm_compat.cli_errors.UsageError`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cli_errors import UsageError

__all__ = ["check_layer_ids", "existing_dir", "existing_file", "json_object", "jsonl_file", "model_dir",
           "non_negative_int", "positive_float", "positive_int", "require_any",
           "target_num_layers", "tokenizer_dir"]

DOWNLOAD_HINT = "download a Hub model first: huggingface-cli download ORG/NAME --local-dir DIR"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def _bad(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def existing_file(value: str) -> str:
    p = Path(value)
    if not p.exists():
        raise _bad(f"{value} does not exist")
    if p.is_dir():
        raise _bad(f"{value} is a directory, a file is expected")
    if not os.access(p, os.R_OK):
        raise _bad(f"{value} is not readable (permissions)")
    return value


def jsonl_file(value: str) -> str:
    """An existing file with at least one non-blank line."""
    existing_file(value)
    with open(value, "rb") as f:
        if not any(line.strip() for line in f):
            raise _bad(f"{value} is empty: it needs one JSON record per line")
    return value


def existing_dir(value: str) -> str:
    p = Path(value)
    if not p.exists():
        raise _bad(f"{value} does not exist")
    if not p.is_dir():
        raise _bad(f"{value} is a file, a directory is expected")
    return value


def _local_dir(value: str, expected: str) -> Path:
    """``value`` as a directory on this machine (nothing is downloaded), else a usage error."""
    p = Path(value)
    if not p.is_dir():
        what = "is a file" if p.exists() else "does not exist"
        raise _bad(f"{value} {what}: {expected}; {DOWNLOAD_HINT}")
    return p


def model_dir(value: str) -> str:
    """A local model directory: ``config.json`` in it."""
    p = _local_dir(value, "a local model directory (config.json + weights) is expected")
    if not (p / "config.json").is_file():
        raise _bad(f"{value} has no config.json: not a model directory")
    return value


def tokenizer_dir(value: str) -> str:
    """A local tokenizer directory (often the target's own)."""
    p = _local_dir(value, "--tokenizer takes a local tokenizer directory (the target's, usually)")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise _bad(f"{value} has none of {', '.join(TOKENIZER_FILES)}: not a tokenizer directory")
    return value


def _number(value: str, cast: type, noun: str) -> Any:
    try:
        return cast(value)
    except ValueError:
        raise _bad(f"{value!r} is not {noun}") from None


def positive_int(value: str) -> int:
    n = _number(value, int, "an integer")
    if n < 1:
        raise _bad(f"{n} must be 1 or more")
    return n


def non_negative_int(value: str) -> int:
    n = _number(value, int, "an integer")
    if n < 0:
        raise _bad(f"{n} must be 0 or more")
    return n


def non_negative_float(value: str) -> float:
    x = _number(value, float, "a number")
    if not x >= 0:
        raise _bad(f"{value} must be 0 or more")
    return x


def positive_float(value: str) -> float:
    x = _number(value, float, "a number")
    if not x > 0:
        raise _bad(f"{value} must be above 0")
    return x


def unit_interval(value: str) -> float:
    """A probability mass such as top_p: above 0, at most 1."""
    x = _number(value, float, "a number")
    if not 0 < x <= 1:
        raise _bad(f"{value} must be above 0 and at most 1")
    return x


def target_num_layers(target: str | None) -> int | None:
    """``num_hidden_layers`` of a target directory, None when its config cannot be read."""
    if not target:
        return None
    try:
        from .target import num_layers_from_config, read_model_config

        return num_layers_from_config(read_model_config(target))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_layer_ids(ids: Sequence[int] | None, flag: str, target: str | None, *,
                    final_allowed: bool) -> None:
    """Layer ids strictly increasing and in range for ``target`` (when its config is
    readable): ``[0, L)`` for aux layers, ``[0, L]`` where the final state may be asked for."""
    if not ids:
        return
    given = " ".join(map(str, ids))
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise UsageError(f"{flag} {given}: layer ids must be distinct and increasing",
                         f"e.g. {flag} {' '.join(map(str, sorted(set(ids))))}")
    n = target_num_layers(target)
    if n is None:
        return
    top = n if final_allowed else n - 1
    bad = [k for k in ids if k > top]
    if bad:
        extra = "" if final_allowed else f" ({n}, the final state, is always stored)"
        raise UsageError(f"{flag} {given}: {bad[0]} is out of range for {target}, which has "
                         f"{n} layers: ids go from 0 to {top}{extra}")


def require_any(directory: str, files: Sequence[str], what: str, hint: str = "") -> None:
    """``directory`` must hold one of ``files`` (it is ``what``)."""
    if not any((Path(directory) / f).exists() for f in files):
        raise UsageError(f"{directory} is not {what} (none of {', '.join(files)} in it)", hint)


def json_object(value: str) -> dict:
    """A JSON object given on the command line (``--engine-kwargs``)."""
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as exc:
        raise _bad(f"not valid JSON ({exc.msg} at column {exc.colno}): {value}") from None
    if not isinstance(obj, dict):
        raise _bad(f"a JSON object ({{\"key\": value}}) is expected, got {value}")
    return obj
