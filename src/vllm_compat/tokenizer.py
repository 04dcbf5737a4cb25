"""A checkpoint's tokenizer, loaded locally; code shipped with a checkpoint runs only when asked.

Some checkpoints ship their tokenizer (and image processor) as Python code, declared by
``auto_map`` in ``tokenizer_config.json`` / ``preprocessor_config.json``: Kimi-K2.5's
``tokenization_kimi.TikTokenTokenizer`` is one. Loading those runs that code, so it needs
the user's explicit ``trust_remote_code=True``; without it :func:`load_tokenizer` refuses
with a message naming the file and the code, before anything is imported from the checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import VllmCompatError

_DECLARES_CODE = {"tokenizer_config.json": "AutoTokenizer",
                  "preprocessor_config.json": "AutoImageProcessor"}


class RemoteCodeRefusedError(VllmCompatError, ValueError):
    """A checkpoint's tokenizer or processor is code and ``trust_remote_code`` was not given."""


def remote_code(path: str | os.PathLike[str]) -> dict[str, str]:
    """``{file: class reference}`` for each tokenizer / processor that ``path`` ships as code."""
    found = {}
    for name, key in _DECLARES_CODE.items():
        f = Path(path) / name
        if not f.is_file():
            continue
        ref = (json.loads(f.read_text()).get("auto_map") or {}).get(key)
        if isinstance(ref, (list, tuple)):  # AutoTokenizer: [slow, fast]
            ref = next((r for r in ref if r), None)
        if ref:
            found[name] = str(ref)
    return found


def check_remote_code(path: str | os.PathLike[str], trust_remote_code: bool, *,
                      what: str = "its tokenizer", flag: str = "trust_remote_code=True") -> None:
    """Refuse a checkpoint that ships code unless the caller trusts it."""
    code = remote_code(path)
    if code and not trust_remote_code:
        shipped = ", ".join(f"{v} ({k})" for k, v in sorted(code.items()))
        raise RemoteCodeRefusedError(
            f"{path} ships {what} as code: {shipped}. Loading it runs that code; pass {flag} "
            "if you trust this checkpoint")


def load_tokenizer(path: str | os.PathLike[str], *, trust_remote_code: bool = False,
                   chat_template: str | None = None) -> Any:
    """A local tokenizer (never the hub); ``chat_template`` (text or a file path) overrides its
    own. A tokenizer shipped as code is loaded only with ``trust_remote_code=True``."""
    from transformers import AutoTokenizer

    check_remote_code(path, trust_remote_code)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    if chat_template is not None:
        p = Path(chat_template)
        tok.chat_template = p.read_text() if p.is_file() else chat_template
    return tok
