"""What prompt lookup can exploit in a target's outputs (``eagle3.repetition``), on sequences
whose answer is known by hand: a loop, tokens that never repeat, and the earliest-match rule
vLLM's n-gram proposer follows."""

from __future__ import annotations

import random

import pytest

from vllm_compat.eagle3.repetition import lookup_predictions, loop_period, repetition_stats


def test_lookup_proposes_what_followed_the_longest_earlier_match():
    # by hand: [1, 2] is seen (followed by 3) once the output repeats it; from there on every
    # longer suffix has an earlier occurrence too
    assert lookup_predictions([1, 2, 3, 4], [1, 2, 3, 4, 1, 2], 2, 3) == [None, None, 3, 4, 1, 2]


def test_lookup_takes_the_earliest_occurrence():
    # [5, 6] was followed by 7, later by 8: vLLM's proposer takes the earliest
    assert lookup_predictions([5, 6, 7, 5, 6, 8], [5, 6, 9], 2, 2)[2] == 7


def test_lookup_prefers_the_longer_match():
    # [9, 5, 6] occurred (followed by 1) as well as [5, 6] (followed by 7 first)
    assert lookup_predictions([5, 6, 7, 9, 5, 6, 1, 9], [5, 6, 0], 2, 3)[2] == 1


def test_a_loop_is_predicted_and_found():
    cycle = [11, 12, 13, 14, 15]
    out = (cycle * 40)[:200]
    s = repetition_stats([[1, 2, 3]], [out], 2, 5)
    # the first cycle cannot be predicted, nor the second's first min_n = 2 tokens (no earlier
    # 2-gram ends there); every later token is
    assert s["lookup_hit_fraction"] == pytest.approx((200 - 5 - 2) / 200)
    assert s["looping_outputs"] == 1 and s["loop_periods"] == [5]
    assert s["distinct_4gram_fraction"] == pytest.approx(5 / 197)


def test_tokens_that_never_repeat_give_nothing_to_lookup():
    rng = random.Random(0)
    out = rng.sample(range(100_000), 256)
    s = repetition_stats([list(range(100_000, 100_064))], [out], 2, 5)
    assert s["lookup_match_fraction"] == 0 and s["lookup_hit_fraction"] == 0
    assert s["looping_outputs"] == 0 and s["distinct_4gram_fraction"] == 1


def test_loop_period_needs_a_full_window():
    assert loop_period([1, 2] * 10) is None  # 20 tokens: too short to call it a loop
    assert loop_period(list(range(30)) + [7, 8] * 32) == 2
    assert loop_period(list(range(64))) is None


def test_mismatched_lengths_and_bad_n_are_refused():
    with pytest.raises(ValueError):
        repetition_stats([[1]], [], 2, 5)
    with pytest.raises(ValueError):
        lookup_predictions([1], [2], 3, 2)
