"""bench.gpu_state_audit on CPU: the audited prompts carry the tokenizer's special and reserved
ids where they should, the transformers source runs for real on a tiny Kimi-K2.5 checkpoint,
and the comparison finds a source that parts from the reference, at the token where it does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from bench import gpu_state_audit as A

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KIMI_VOCAB = 163_840


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    from vllm_compat.testing.kimi_k25 import write_kimi_k25_checkpoint
    return str(write_kimi_k25_checkpoint(tmp_path_factory.mktemp("kimi"), variant="int4", seed=5))


def test_special_ids_are_read_from_the_checkpoints_tokenizer(kimi, tmp_path):
    assert A.special_ids(kimi, KIMI_VOCAB) == list(range(163_584, KIMI_VOCAB))
    assert A.special_ids(tmp_path, 1000) == list(range(744, 1000))  # no tokenizer: the top 256


def test_audit_prompts_place_special_ids_as_named():
    specials = list(range(163_584, KIMI_VOCAB))
    audited, filler = A.audit_prompts(KIMI_VOCAB, specials, filler=3)
    sp = set(specials)
    pos = {n: A.special_positions(p, sp) for n, p in audited.items()}
    assert pos["bench-0"] and not pos["bench-0-no-special"]
    assert len(audited["bench-0"]) == len(audited["bench-0-no-special"]) == 1024
    assert [a == b for a, b in zip(audited["bench-0"], audited["bench-0-no-special"])].count(
        False) == len(pos["bench-0"])  # only the special ids were replaced
    assert not pos["low-ids"] and max(audited["low-ids"]) < 32_000
    assert not pos["high-ids"] and min(audited["high-ids"]) >= 32_000
    assert pos["one-special-at-64"] == [64]
    assert pos["special-every-8th"] == list(range(0, 256, 8))
    assert pos["chat"][:3] == [0, 3, 64]
    assert len(filler) == 3 and all(len(p) == 1024 for p in filler)
    # the benchmark's own prompts: the same ids bench.gpu_extraction measures
    from bench.gpu_extraction import make_workloads
    assert audited["bench-1"] == make_workloads(128, 1024, 1, 1, 1, KIMI_VOCAB)["fixed"][1]


def test_layer_ids():
    assert A.layer_ids("1,2,L/2,L", 12) == (1, 2, 6, 12)
    assert A.layer_ids("L-3,0", 61) == (58, 0)
    with pytest.raises(ValueError):
        A.layer_ids("13", 12)


def test_comparison_finds_where_a_source_parts_from_the_reference(kimi):
    specials = list(range(163_584, KIMI_VOCAB))
    audited, _ = A.audit_prompts(KIMI_VOCAB, specials, filler=0)
    small = {n: audited[n][:24] for n in ("chat", "low-ids")}
    ids = (1, 2, 8)
    ref, info = A.run_hf(kimi, list(small.values()), ids)
    assert info["model"] == "DeepseekV3ForCausalLM" and ref[0].shape == (24, 3, 256)
    bf16, _ = A.run_hf(kimi, list(small.values()), ids, torch.bfloat16)
    wrong = [s.clone() for s in ref]
    wrong[0][3] = 0.0  # a source that loses the state of chat token 3 (a role marker)
    spec = {"audited": small, "layer_ids": ids, "specials": specials}
    pairs = A.compare(spec, {"hf": ref, "hf_bf16": bf16, "broken": wrong}, token_tol=0.05)
    broken = pairs["broken vs hf"]["chat"]
    assert broken["first_over_tol"] == 3 and broken["tokens_over_tol"] == 1
    assert broken["over_tol_special"] == 1 and broken["over_tol_ids"] == [small["chat"][3]]
    assert pairs["broken vs hf"]["low-ids"]["tokens_over_tol"] == 0
    assert pairs["hf_bf16 vs hf"]["chat"]["rel"]["1"] < 0.05  # bf16 noise, 24 tokens
    assert "broken vs hf_bf16" in pairs
    lines = A.summary(pairs, ids)
    assert any(line.startswith("broken vs hf") and "first 3" in line for line in lines)
