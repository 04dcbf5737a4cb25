"""FP8 states on their way from the worker to the caller, on the CPU: one packed buffer per
step unpacked into views, split per request, a prompt's chunks joined over several steps
(chunked prefill), and the sample the extractor hands out."""

from __future__ import annotations

import torch

from vllm_compat.extract import fp8
from vllm_compat.extract.extractor import ExtractedSample, HiddenStatesExtractor
from vllm_compat.extract.ordering import BatchLayout, OrderedAssembler
from vllm_compat.extract.staging import pack, per_request, unpack


def _step(T, n=4, H=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return fp8.encode(torch.randn(T, n, H, generator=g).to(torch.bfloat16))


def test_pack_and_unpack_keep_every_part_bit_for_bit():
    q, scale = _step(7, n=3)  # 105 FP8 bytes: the float32 scales' offset needs aligning
    flat, layout = pack((q, scale))
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    q2, s2 = unpack(flat.clone(), layout)
    assert q2.dtype == fp8.FP8_DTYPE and q2.shape == q.shape and s2.shape == scale.shape
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, scale)


def test_per_request_rows_of_a_tuple_are_tuples_of_views_or_copies():
    q, scale = _step(9)
    lay = BatchLayout(("a", "b", "c"), (0, 2, 6), (2, 6, 9))
    views = per_request((q, scale), lay)
    assert set(views) == {"a", "b", "c"}
    qb, sb = views["b"]
    assert torch.equal(qb.view(torch.uint8), q[2:6].view(torch.uint8)) and torch.equal(sb, scale[2:6])
    assert qb.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()  # a view
    copies = per_request((q, scale), lay, copy=True)
    assert copies["c"][1].untyped_storage().data_ptr() != scale.untyped_storage().data_ptr()
    plain = per_request(q.float(), lay)
    assert torch.equal(plain["a"], q[:2].float())


def test_a_prompts_fp8_chunks_are_joined_part_by_part():
    """A prompt split over three steps: its states and scales joined along the tokens."""
    steps = [_step(t, seed=i) for i, t in enumerate((3, 4, 2))]
    asm = OrderedAssembler()
    asm.register(0, "p0", list(range(9)))
    for q, s in steps:
        asm.feed("p0", (q, s))
    [(index, ids, (q, s))] = list(asm.pop_ready())
    assert index == 0 and q.shape == (9, 4, 5) and s.shape == (9, 4)
    assert torch.equal(q.view(torch.uint8), torch.cat([x[0] for x in steps]).view(torch.uint8))
    assert torch.equal(s, torch.cat([x[1] for x in steps]))


def test_the_extractor_hands_out_fp8_states_with_their_scales():
    ex = HiddenStatesExtractor.__new__(HiddenStatesExtractor)  # no engine: only _sample
    ex.layer_ids, ex.hidden_size = (1, 2, 3, 4), 5
    q, scale = _step(6)
    s = ex._sample(3, list(range(6)), (q, scale))
    assert isinstance(s, ExtractedSample) and s.hidden_states is q and s.hidden_states_scale is scale
    assert set(s.states()) == {"hidden_states", "hidden_states_scale"}
    plain = ex._sample(3, list(range(6)), q.float())
    assert plain.hidden_states_scale is None and set(plain.states()) == {"hidden_states"}
