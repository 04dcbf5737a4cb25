"""The acceptance ceiling of sampled evaluations (``vllm_compat.eagle3.ceiling``): the target's
probabilities within its nucleus, the best acceptance length a draft could reach along the
sampled outputs, and the probability vLLM accepts prompt lookup's proposals with."""

from __future__ import annotations

import math

import pytest

from vllm_compat.eagle3.ceiling import ceiling_stats, nucleus_probs
from vllm_compat.eagle3.repetition import lookup_predictions

LN = math.log


def test_the_nucleus_keeps_the_smallest_set_reaching_top_p_and_renormalises():
    probs = nucleus_probs({7: LN(0.5), 8: LN(0.3), 9: LN(0.2)}, 0.7)
    assert probs == pytest.approx({7: 0.625, 8: 0.375, 9: 0.0})
    assert nucleus_probs({7: LN(0.5), 8: LN(0.3), 9: LN(0.2)}, 1.0) == pytest.approx({7: 0.5, 8: 0.3, 9: 0.2})
    # the top k hold less than top_p: the rest of the nucleus is unseen, divide by top_p (a ceiling)
    assert nucleus_probs({7: LN(0.4), 8: LN(0.2)}, 0.95) == pytest.approx({7: 0.4 / 0.95, 8: 0.2 / 0.95})
    with pytest.raises(ValueError, match="top_p"):
        nucleus_probs({7: 0.0}, 0.0)


def test_the_draft_ceiling_multiplies_the_top1_probabilities_along_the_path():
    out = [5, 6, 7]
    rows = [{5: LN(0.5), 1: LN(0.5)}, {6: LN(0.8), 1: LN(0.2)}, {7: LN(1.0)}]
    st = ceiling_stats([[1, 2]], [out], [rows], top_p=1.0, ks=[1, 2], min_n=2, max_n=2)
    assert st["top1_prob_mean"] == pytest.approx((0.5 + 0.8 + 1.0) / 3)
    # K=1: 1 + p_t at each start; K=2: 1 + p_t + p_t p_t+1, cut at the end of the output
    assert st["draft_al_ceiling"][1] == pytest.approx(1 + (0.5 + 0.8 + 1.0) / 3)
    assert st["draft_al_ceiling"][2] == pytest.approx(((1 + 0.5 + 0.4) + (1 + 0.8 + 0.8) + 2.0) / 3)
    assert st["lookup_proposal_fraction"] == 0.0 and st["lookup_accept_prob"] is None


def test_a_lookup_proposal_is_accepted_with_the_targets_probability_of_it():
    prompt, out = [1, 2, 3, 1, 2], [3, 9, 4]  # the lookup proposes 3 after (1, 2), 1 after (2, 3)
    assert lookup_predictions(prompt, out, 2, 2) == [3, 1, None]
    rows = [{3: LN(0.6), 4: LN(0.4)}, {9: LN(0.9), 8: LN(0.1)}, {4: LN(0.7), 5: LN(0.3)}]
    st = ceiling_stats([prompt], [out], [rows], top_p=1.0, ks=[3], min_n=2, max_n=2)
    assert st["lookup_proposal_fraction"] == pytest.approx(2 / 3)
    # 3 with 0.6; 1 is below the top k: between 0 and the k-th token's probability (0.1)
    assert st["lookup_accept_prob"] == pytest.approx([0.3, 0.35])
    rows[0] = {4: LN(0.6), 5: LN(0.25)}
    st = ceiling_stats([prompt], [out], [rows], top_p=1.0, ks=[3], min_n=2, max_n=2)
    assert st["lookup_accept_prob"] == pytest.approx([0.0, 0.175])
    # outside the nucleus a proposal is never accepted
    rows[0] = {3: LN(0.1), 4: LN(0.9)}
    st = ceiling_stats([prompt], [out], [rows], top_p=0.9, ks=[3], min_n=2, max_n=2)
    assert st["lookup_accept_prob"][0] == pytest.approx(0.0)


def test_rows_must_cover_each_output_position():
    with pytest.raises(ValueError, match="2 logprob positions for an output of 3"):
        ceiling_stats([[1]], [[1, 2, 3]], [[{1: 0.0}, {2: 0.0}]], top_p=1.0, ks=[1], min_n=1, max_n=1)
