"""``runtime.llm.generate``'s sampling parameters on this release: greedy by default, sampled
with one seed per prompt when asked (so a sampled evaluation can be repeated), vLLM's own
``SamplingParams`` built with them. The engine cannot run on the CPU: a stand-in for ``LLM``
keeps what ``generate`` is given; the parameters are vLLM's real objects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


class _KeepsParams:
    def generate(self, prompts, params, use_tqdm=False):
        self.prompts, self.params = prompts, params
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 8])]) for _ in prompts]


def test_sampled_prompts_get_their_own_seed():
    from vllm_compat.runtime import llm as serve

    keep = _KeepsParams()
    assert serve.generate(keep, [[1, 2], [3]], max_tokens=4, temperature=0.7, seeds=[10, 11]) == [[7, 8], [7, 8]]
    assert [p.seed for p in keep.params] == [10, 11]
    assert all((p.temperature, p.max_tokens, p.ignore_eos, p.top_p) == (0.7, 4, True, 1.0) for p in keep.params)


def test_sampled_prompts_keep_the_nucleus_asked_for():
    from vllm_compat.runtime import llm as serve

    keep = _KeepsParams()
    serve.generate(keep, [[1, 2], [3]], max_tokens=4, temperature=1.0, seeds=[1, 2], top_p=0.95)
    assert [(p.top_p, p.seed) for p in keep.params] == [(0.95, 1), (0.95, 2)]
    with pytest.raises(ValueError, match="top_p"):
        serve.generate(keep, [[1]], max_tokens=4, temperature=1.0, seeds=[1], top_p=0.0)


def test_greedy_has_one_unseeded_parameter_set():
    from vllm_compat.runtime import llm as serve

    keep = _KeepsParams()
    serve.generate(keep, [[1, 2], [3]], max_tokens=4)
    assert keep.params.temperature == 0.0 and keep.params.seed is None


def test_sampling_without_a_seed_per_prompt_is_refused():
    from vllm_compat.runtime import llm as serve

    with pytest.raises(ValueError, match="one seed per prompt"):
        serve.generate(_KeepsParams(), [[1], [2]], max_tokens=4, temperature=0.8, seeds=[1])
