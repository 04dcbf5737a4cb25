"""Batch layout, chunk concatenation and input-order release (no vLLM, no torch)."""

import random

import pytest

from vllm_compat.extract.ordering import (
    BatchLayout, OrderedAssembler, check_prompt, split_batch, windows,
)


def _lists():
    return OrderedAssembler(concat=lambda parts: [x for p in parts for x in p])


def test_split_batch_follows_runner_order_not_dict_order():
    lay = split_batch(["b", "a", None, "c"], {"a": 3, "c": 1, "b": 5})
    assert lay == BatchLayout(("b", "a", "c"), (0, 5, 8), (5, 8, 9))
    assert lay.total == 9


def test_split_batch_skips_unscheduled_and_rejects_missing_or_duplicates():
    assert split_batch(["x", "a"], {"a": 2}).req_ids == ("a",)
    with pytest.raises(ValueError, match=r"absent from the batch order: \['z'\]"):
        split_batch(["a"], {"a": 1, "z": 2})
    with pytest.raises(ValueError, match="twice"):
        split_batch(["a", "a"], {"a": 1})


def test_chunks_concatenate_and_release_in_input_order():
    asm = _lists()
    prompts = {0: list(range(5)), 1: list(range(2)), 2: list(range(7))}
    for i, p in prompts.items():
        asm.register(i, f"r{i}", p)
    # step 1: r1 completes first, r0 and r2 get partial chunks
    asm.feed_many({"r1": ["b0", "b1"], "r0": ["a0", "a1"], "r2": ["c0"]})
    assert list(asm.pop_ready()) == []          # r1 waits for r0
    asm.feed("r0", ["a2", "a3", "a4"])
    out = list(asm.pop_ready())
    assert [o[0] for o in out] == [0, 1]
    assert out[0][2] == ["a0", "a1", "a2", "a3", "a4"]
    assert out[1][2] == ["b0", "b1"]
    asm.feed("r2", ["c1", "c2", "c3", "c4", "c5", "c6"])
    (i, ids, data), = asm.pop_ready()
    assert (i, ids, data) == (2, prompts[2], [f"c{j}" for j in range(7)])
    assert asm.in_flight == 0 and asm.running == 0


def test_overlong_and_unknown_chunks_are_errors():
    asm = _lists()
    asm.register(0, "r0", [1, 2])
    with pytest.raises(ValueError, match="0 \\+ 3 tokens received, the prompt has 2"):
        asm.feed("r0", [0, 0, 0])
    with pytest.raises(KeyError, match="unknown"):
        asm.feed("nope", [0])
    asm.feed("r0", [0, 0])
    with pytest.raises(KeyError):
        asm.feed("r0", [0])  # finished requests accept nothing


def test_missing_reports_partial_requests():
    asm = _lists()
    asm.register(0, "r0", [1, 2, 3])
    asm.feed("r0", [9])
    assert asm.missing() == {"r0": (1, 3)}


def test_register_order_enforced():
    asm = _lists()
    asm.register(3, "a", [1])
    with pytest.raises(ValueError, match="index 2 registered after 3"):
        asm.register(2, "b", [1])
    with pytest.raises(ValueError, match="already registered"):
        asm.register(4, "a", [1])


def test_simulated_chunked_engine_keeps_order_for_many_prompts():
    """A fake scheduler: random token budget per step, runner-order shuffled each step."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(23)]
    prompts = [[1000 * i + j for j in range(n)] for i, n in enumerate(lengths)]
    asm = _lists()
    done = [0] * len(prompts)
    queue = list(range(len(prompts)))
    out = []
    window = 5
    active: list[int] = []
    while queue or active:
        while queue and asm.in_flight < window:
            i = queue.pop(0)
            asm.register(i, f"k{i}", prompts[i])
            active.append(i)
        budget = rng.randint(3, 17)
        sched = {}
        for i in active:  # FCFS token budget like vLLM's scheduler
            n = min(budget, lengths[i] - done[i])
            if n <= 0:
                break
            sched[f"k{i}"] = n
            budget -= n
        order = list(sched)
        rng.shuffle(order)  # the runner lays requests out in its own order
        flat = []
        lay = split_batch(order, sched)
        for r in lay.req_ids:
            i = int(r[1:])
            flat += prompts[i][done[i]: done[i] + sched[r]]
            done[i] += sched[r]
        asm.feed_many({r: flat[s:e] for r, s, e in zip(lay.req_ids, lay.starts, lay.ends)})
        active = [i for i in active if done[i] < lengths[i]]
        out += list(asm.pop_ready())
    assert [o[0] for o in out] == list(range(len(prompts)))
    assert all(o[2] == prompts[o[0]] for o in out)


def test_check_prompt():
    assert check_prompt(0, (1, 2)) == [1, 2]
    with pytest.raises(ValueError, match="prompt 3 is empty"):
        check_prompt(3, [])
    with pytest.raises(ValueError, match="prompt 1: token 1 = 99 is outside"):
        check_prompt(1, [1, 99], vocab_size=50)
    with pytest.raises(ValueError, match="prompt 2 has 5 tokens; at most 4"):
        check_prompt(2, [1] * 5, max_len=4)
    with pytest.raises(ValueError, match="string"):
        check_prompt(0, "hello")
    with pytest.raises(ValueError, match="not an integer"):
        check_prompt(0, [1, 2.0])


def test_windows():
    assert list(windows(iter(range(7)), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError):
        list(windows([], 0))


# ---------------------------------------------------------------- StreamAssembler


def test_stream_assembler_hands_out_each_request_when_complete():
    from vllm_compat.extract.ordering import StreamAssembler

    asm = StreamAssembler(concat=lambda parts: [x for p in parts for x in p], length=len)
    asm.register("long", [1, 2, 3, 4])
    asm.register("short", [5])
    asm.feed_many({"long": [10, 20], "short": [50]})
    assert asm.pop_finished() == [("short", [5], [50])]  # not held behind "long"
    asm.feed_many({"long": [30, 40]})
    assert asm.pop_finished() == [("long", [1, 2, 3, 4], [10, 20, 30, 40])]
    assert asm.running == 0


def test_stream_assembler_drops_a_cancelled_request_and_its_late_chunks():
    from vllm_compat.extract.ordering import StreamAssembler

    asm = StreamAssembler(concat=lambda parts: parts, length=len)
    asm.register("a", [1, 2])
    asm.register("b", [3])
    assert asm.drop("a") is True and asm.drop("a") is False
    asm.feed_many({"a": [1], "b": [3]})  # a step launched before the cancel still made "a"
    assert [k for k, _, _ in asm.pop_finished()] == ["b"]
    asm.forget_dropped()
    with pytest.raises(KeyError):
        asm.feed_many({"a": [2]})  # once nothing is in flight, an unknown key is an error
    with pytest.raises(ValueError):
        asm.register("b2", [1]) or asm.register("b2", [1])
