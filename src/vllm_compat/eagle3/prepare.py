"""Chat or completion JSONL -> token ids + loss mask (assistant / completion tokens only).

Accepted records, one JSON object per line:

- chat: ``{"messages": [{"role": "user"|"assistant"|"system"|..., "content": str}, ...]}``
  (ShareGPT ``{"conversations": [{"from": "human"|"gpt"|..., "value": str}]}`` is mapped onto it)
- completion: ``{"prompt": str, "completion": str}``

Chat records are rendered with the tokenizer's chat template. An assistant turn's tokens
are found by rendering the conversation up to that turn with ``add_generation_prompt=True``
and up to the end of the turn; the text between is the turn (content plus the template's
end-of-turn marker), and every token overlapping it is trained on. A template whose
renderings are not prefixes of each other cannot be masked this way; such a record is
skipped with reason ``template_error``.

Skipped records are never silent: each is written to ``skipped.jsonl`` with its line number
and reason, and the counts are in ``report.json``. Output goes to ``prepared.jsonl``; a
rerun continues after the last line already handled.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..tokenizer import load_tokenizer

PREPARED = "prepared.jsonl"
SKIPPED = "skipped.jsonl"
REPORT = "report.json"
SKIP_REASONS = ("malformed_json", "malformed_record", "empty", "too_long", "template_error")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool"}


class SkipRecord(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass
class PrepareReport:
    kept: int = 0
    kept_tokens: int = 0
    loss_tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    lines_read: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"lines_read": self.lines_read, "kept": self.kept, "kept_tokens": self.kept_tokens,
                "loss_tokens": self.loss_tokens, "skipped": dict(sorted(self.skipped.items())),
                "skipped_total": sum(self.skipped.values())}


def _messages(record: Any) -> list[dict[str, str]] | None:
    if not isinstance(record, dict):
        raise SkipRecord("malformed_record", "not a JSON object")
    if "messages" in record:
        msgs = record["messages"]
    elif "conversations" in record:
        conv = record["conversations"]
        if not isinstance(conv, list) or not all(isinstance(m, dict) for m in conv):
            raise SkipRecord("malformed_record", "conversations is not a list of objects")
        msgs = [{"role": _SHAREGPT_ROLES.get(str(m.get("from")), str(m.get("from"))),
                 "content": m.get("value")} for m in conv]
    else:
        return None
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in msgs
    ):
        raise SkipRecord("malformed_record", "messages must be a list of {role: str, content: str}")
    return msgs


def _render(tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    try:
        out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # a template may raise on unexpected roles or orders
        raise SkipRecord("template_error", f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(out, str):
        raise SkipRecord("template_error", "chat template did not render a string")
    return out


def assistant_spans(tok: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the character spans of its assistant turns."""
    if tok.chat_template is None:
        raise SkipRecord("template_error", "tokenizer has no chat template")
    text = _render(tok, messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"].strip():
            continue
        before = _render(tok, messages[:i], add_generation_prompt=True)
        through = _render(tok, messages[: i + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise SkipRecord("template_error", "template renderings are not prefix-stable")
        spans.append((len(before), len(through)))
    return text, spans


def _tokenize_by_span(tok: Any, text: str, spans: list[tuple[int, int]], *,
                      add_special_tokens: bool) -> tuple[list[int], list[int]]:
    """For tokenizers without offset mappings (slow ones, e.g. Kimi-K2.5's tiktoken code): each
    piece between span boundaries on its own, the assistant pieces trained on. Chat templates
    put special tokens at those boundaries, so pieces tokenize as the whole text does there."""
    cuts = sorted({0, len(text), *(b for span in spans for b in span)})
    ids: list[int] = []
    mask: list[int] = []
    if add_special_tokens and getattr(tok, "bos_token_id", None) is not None:
        ids, mask = [tok.bos_token_id], [0]
    for a, b in zip(cuts, cuts[1:]):
        piece = tok.encode(text[a:b], add_special_tokens=False)
        inside = int(any(s <= a and b <= e for s, e in spans))
        ids += piece
        mask += [inside] * len(piece)
    return ids, mask


def tokenize_record(tok: Any, record: Any, max_length: int | None) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one record, or :class:`SkipRecord`."""
    messages = _messages(record)
    if messages is not None:
        text, spans = assistant_spans(tok, messages)
    elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        if not record["completion"].strip():
            raise SkipRecord("empty", "empty completion")
        text = record["prompt"] + record["completion"]
        spans = [(len(record["prompt"]), len(text))]
    else:
        raise SkipRecord("malformed_record", "neither messages/conversations nor prompt+completion")
    if not spans:
        raise SkipRecord("empty", "no non-empty assistant turn")
    if getattr(tok, "is_fast", False):
        enc = tok(text, add_special_tokens=messages is None, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        # a token overlapping an assistant span is trained on (one may straddle the prompt
        # boundary, e.g. " there" after the prompt "Hello "): the model emits it to start the answer
        mask = [int(end > start and any(start < e and end > s for s, e in spans))
                for start, end in offsets]
    else:
        ids, mask = _tokenize_by_span(tok, text, spans, add_special_tokens=messages is None)
    if not ids or not any(mask):
        raise SkipRecord("empty", "no trainable tokens after tokenisation")
    if max_length is not None and len(ids) > max_length:
        raise SkipRecord("too_long", f"{len(ids)} tokens > max_length {max_length}")
    return ids, mask


def _resume_point(path: Path) -> int:
    """Drop a torn last line (crash mid-write); return the highest source line recorded."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    last = 0
    for line in data.splitlines():
        last = max(last, json.loads(line)["line"])
    return last


def _report_from_disk(out: Path) -> PrepareReport:
    rep = PrepareReport()
    for row in _read_jsonl(out / PREPARED):
        rep.kept += 1
        rep.kept_tokens += len(row["input_ids"])
        rep.loss_tokens += sum(row["loss_mask"])
        rep.lines_read = max(rep.lines_read, row["line"])
    for row in _read_jsonl(out / SKIPPED):
        rep.skipped[row["reason"]] += 1
        rep.lines_read = max(rep.lines_read, row["line"])
    return rep


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    if path.exists():
        with path.open() as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def prepare(
    input_path: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Any,
    output_dir: str | os.PathLike[str],
    *,
    max_length: int | None = 4096,
    chat_template: str | None = None,
    trust_remote_code: bool = False,
    progress: bool = False,
) -> PrepareReport:
    """Tokenise ``input_path`` into ``output_dir``; resumes after the last line handled.

    A tokenizer the checkpoint ships as code (Kimi-K2.5's) is run only with
    ``trust_remote_code=True`` (:func:`vllm_compat.tokenizer.load_tokenizer`)."""
    tok = tokenizer if hasattr(tokenizer, "apply_chat_template") else load_tokenizer(
        tokenizer, trust_remote_code=trust_remote_code, chat_template=chat_template)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = max(_resume_point(out / PREPARED), _resume_point(out / SKIPPED))
    report = _report_from_disk(out)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(initial=done, desc="prepare", unit="rec")
    with Path(input_path).open() as src, (out / PREPARED).open("a") as kept, \
            (out / SKIPPED).open("a") as skipped:
        for n, line in enumerate(src, start=1):
            if n <= done:  # handled by an earlier run
                continue
            try:
                if not line.strip():
                    raise SkipRecord("empty", "blank line")
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SkipRecord("malformed_json", str(exc)) from exc
                ids, mask = tokenize_record(tok, record, max_length)
            except SkipRecord as skip:
                report.skipped[skip.reason] += 1
                skipped.write(json.dumps({"line": n, "reason": skip.reason, "detail": skip.detail}) + "\n")
                skipped.flush()
            else:
                report.kept += 1
                report.kept_tokens += len(ids)
                report.loss_tokens += sum(mask)
                kept.write(json.dumps({"line": n, "input_ids": ids, "loss_mask": mask}) + "\n")
                kept.flush()
            report.lines_read = n
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    (out / REPORT).write_text(json.dumps(report.to_json(), indent=1))
    return report


def iter_token_records(directory: str | os.PathLike[str]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, loss_mask)`` from a hidden-state dataset or a ``prepare`` output directory."""
    from .data import MANIFEST, HiddenStatesDataset

    d = Path(directory)
    if (d / MANIFEST).exists():
        yield from HiddenStatesDataset(d).token_stream()
    elif (d / PREPARED).exists():
        for row in _read_jsonl(d / PREPARED):
            yield (torch.tensor(row["input_ids"], dtype=torch.int64),
                   torch.tensor(row["loss_mask"], dtype=torch.bool))
    else:
        raise FileNotFoundError(f"{d}: neither a hidden-state dataset ({MANIFEST}) nor {PREPARED}")
