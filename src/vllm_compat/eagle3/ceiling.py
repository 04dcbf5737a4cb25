"""How often the target itself lets a speculator's tokens through, on sampled outputs.

vLLM verifies a proposed token ``x`` that comes without the proposer's probabilities (n-gram's,
and an EAGLE-3 draft proposing its argmax) by accepting it with the target's probability
``p(x)`` under the request's sampling settings (temperature, then the ``top_p`` nucleus). So
at temperature 1 no draft is accepted more often, per proposed token, than the target's own
top-1 probability, however well it is trained; prompt lookup is accepted with ``p`` of the
token it copies. Both come from the target's logprobs along its own sampled outputs
(``prompt_logprobs`` of prompt + output), next to vLLM's measured acceptance lengths.

The target's logprobs are the top ``k`` tokens of each position; a probability inside the nucleus is divided by the nucleus' mass, the top ``k``'s cumulative
mass where it reaches ``top_p`` and ``top_p`` where it does not (an upper bound, as a
ceiling should be). A lookup proposal outside the top ``k`` has a probability between 0 and
the ``k``-th's; both bounds are reported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .repetition import lookup_predictions


def nucleus_probs(logprobs: Mapping[int, float], top_p: float) -> dict[int, float]:
    """Token -> probability within the ``top_p`` nucleus, for the tokens of ``logprobs``
    (token -> raw logprob at temperature 1) that the nucleus keeps; others get 0."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    ranked = sorted(((math.exp(lp), t) for t, lp in logprobs.items()), reverse=True)
    kept: list[tuple[float, int]] = []
    mass = 0.0
    for p, t in ranked:
        kept.append((p, t))
        mass += p
        if mass >= top_p:  # vLLM keeps the smallest set whose mass reaches top_p
            break
    norm = mass if mass >= top_p else top_p
    out = {t: 0.0 for t in logprobs}
    out.update({t: p / norm for p, t in kept})
    return out


def ceiling_stats(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                  logprobs: Sequence[Sequence[Mapping[int, float]]], *, top_p: float, ks: Sequence[int],
                  min_n: int, max_n: int) -> dict[str, Any]:
    """``logprobs[i][t]``: the target's top-``k`` logprobs (token -> logprob, exactly the top
    ``k``) at output position ``t`` of prompt ``i``. Returns over all output positions:
    ``top1_prob_mean`` (the most a draft is accepted per proposed token, on average),
    ``draft_al_ceiling`` (per K: a draft always proposing the target's argmax, accepted with
    its probability at each of K positions along the sampled path, plus the bonus token; what
    vLLM's acceptance length could reach at best), ``lookup_proposal_fraction`` and
    ``lookup_accept_prob`` (``[low, high]``: the mean probability vLLM accepts the token
    prompt lookup proposes, where it proposes one)."""
    if not len(prompts) == len(outputs) == len(logprobs):
        raise ValueError(f"{len(prompts)} prompts, {len(outputs)} outputs, {len(logprobs)} logprob rows")
    top1: list[list[float]] = []
    proposals = low = high = 0.0
    positions = 0
    for prompt, out, rows in zip(prompts, outputs, logprobs):
        if len(rows) != len(out):
            raise ValueError(f"{len(rows)} logprob positions for an output of {len(out)} tokens")
        seq: list[float] = []
        for proposal, row in zip(lookup_predictions(prompt, out, min_n, max_n), rows):
            probs = nucleus_probs(row, top_p)
            seq.append(max(probs.values()))
            positions += 1
            if proposal is None:
                continue
            proposals += 1
            if proposal in probs:
                low += probs[proposal]
                high += probs[proposal]
            else:  # below the top k: at most the k-th's probability
                high += min(probs.values())
        top1.append(seq)
    ceiling = {}
    for k in ks:
        starts = [_draft_al(seq[t:t + k]) for seq in top1 for t in range(len(seq))]
        ceiling[k] = sum(starts) / len(starts) if starts else None
    return {
        "tokens": positions,
        "top1_prob_mean": sum(map(sum, top1)) / positions if positions else None,
        "draft_al_ceiling": ceiling,
        "lookup_proposal_fraction": proposals / positions if positions else None,
        "lookup_accept_prob": [low / proposals, high / proposals] if proposals else None,
        "top_p": top_p,
    }


def _draft_al(probs: Sequence[float]) -> float:
    # one verification step: 1 (the target's own token) + P(first j proposals all accepted), j = 1..K
    al, run = 1.0, 1.0
    for p in probs:
        run *= p
        al += run
    return al
