"""How repetitive a target's outputs are: what vLLM's n-gram (prompt-lookup) speculator
can exploit in them.

A small target trained on a small corpus loops, and prompt lookup predicts a loop perfectly;
an EAGLE-3 draft's acceptance length against n-gram's only means something next to how much of
the output a lookup could have predicted. These statistics describe the outputs; the acceptance
lengths themselves are vLLM's own counters (:mod:`vllm_compat.eagle3.evaluate`).

Per output token ``t`` (context: the prompt and the output before ``t``), the lookup takes the
longest suffix of the context of ``max_n`` down to ``min_n`` tokens that occurred earlier with a
token after it, and proposes the token that followed its earliest occurrence (vLLM's n-gram
proposer also takes the longest match, at its earliest position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PERIOD_WINDOW = 64  # an output "loops" when its last 64 tokens repeat with a period <= 32


def lookup_predictions(prompt: Sequence[int], output: Sequence[int], min_n: int, max_n: int) -> list[int | None]:
    """Per output position, the token a prompt lookup proposes first (None: no earlier match)."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    ctx = list(prompt)
    # per n: n-gram -> end index of its earliest occurrence that has a token after it
    seen: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def register(end: int) -> None:
        for n in seen:
            if end - n + 1 >= 0:
                seen[n].setdefault(tuple(ctx[end - n + 1:end + 1]), end)

    for end in range(len(ctx) - 1):
        register(end)
    proposals: list[int | None] = []
    for tok in output:
        proposal: int | None = None
        for n in range(max_n, min_n - 1, -1):
            found = seen[n].get(tuple(ctx[-n:])) if len(ctx) >= n else None
            if found is not None:
                proposal = ctx[found + 1]
                break
        proposals.append(proposal)
        ctx.append(tok)
        if len(ctx) >= 2:
            register(len(ctx) - 2)
    return proposals


def loop_period(output: Sequence[int], window: int = PERIOD_WINDOW) -> int | None:
    """The smallest period p <= window // 2 with which the output's last ``window`` tokens repeat."""
    tail = list(output[-window:])
    if len(tail) < window:
        return None
    for p in range(1, window // 2 + 1):
        if all(tail[i] == tail[i - p] for i in range(p, window)):
            return p
    return None


def repetition_stats(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                     min_n: int, max_n: int) -> dict[str, Any]:
    """Over all outputs: ``lookup_match_fraction`` (positions where a lookup proposes a token),
    ``lookup_hit_fraction`` (positions where that token is the output's), ``distinct_4gram_fraction``
    (distinct 4-grams / 4-grams within each output, averaged over tokens) and
    ``looping_outputs`` (outputs whose tail repeats with a short period)."""
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts vs {len(outputs)} outputs")
    positions = matched = hit = grams = distinct = looping = 0
    periods: list[int] = []
    for p, o in zip(prompts, outputs):
        for proposal, tok in zip(lookup_predictions(p, o, min_n, max_n), o):
            positions += 1
            matched += proposal is not None
            hit += proposal == tok
        four = [tuple(o[i:i + 4]) for i in range(len(o) - 3)]
        grams += len(four)
        distinct += len(set(four))
        period = loop_period(o)
        if period is not None:
            looping += 1
            periods.append(period)
    return {
        "outputs": len(outputs), "tokens": positions, "min_n": min_n, "max_n": max_n,
        "lookup_match_fraction": matched / positions if positions else None,
        "lookup_hit_fraction": hit / positions if positions else None,
        "distinct_4gram_fraction": distinct / grams if grams else None,
        "looping_outputs": looping,
        "loop_periods": sorted(periods),
    }
