"""``runtime.llm.generate``'s sampling parameters on this release: greedy by default, sampled
with one seed per prompt when asked (so a sampled evaluation can be repeated), vLLM's own
``SamplingParams`` built with them; ``runtime.llm.prompt_logprobs`` read from the containers
this release's output processor fills. The engine cannot run on the CPU: a stand-in for ``LLM``
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


@pytest.mark.parametrize("flat", [False, True])
def test_prompt_logprobs_are_the_top_k_of_each_position_in_either_container(flat):
    from vllm_compat.runtime import llm as serve

    from . import reference

    # the sequence [5, 6, 7]: 6 ranks 3rd at position 1, 7 is the top token at position 2
    container = reference.prompt_logprobs_container(
        flat, [([6, 9, 8], [-3.0, -0.1, -2.5], 3), ([7, 9], [-0.2, -1.9], 1)], 2)
    if container is None:
        pytest.skip("no FlatLogprobs in this release")

    class _Keeps:
        def generate(self, prompts, params, use_tqdm=False):
            self.prompts, self.params = prompts, params
            return [SimpleNamespace(prompt_logprobs=container) for _ in prompts]

    keep = _Keeps()
    rows = serve.prompt_logprobs(keep, [[5, 6, 7]], k=2)
    assert rows == [[None, {9: -0.1, 8: -2.5}, {7: -0.2, 9: -1.9}]]  # 6 ranked 3rd: left out
    assert (keep.params.prompt_logprobs, keep.params.max_tokens, keep.params.temperature) == (2, 1, 0.0)
