"""``runtime.llm.prompt_logprobs`` on a real engine (needs CUDA): the rows ``eagle3 evaluate
--acceptance-ceiling`` reads are the target's next-token distribution at each position, as
fp32 transformers computes it on the same weights, on chat-shaped prompts (special ids
included). The same rows read one position off are recorded beside, to show the comparison
would see a shift."""

from __future__ import annotations

import pytest
import torch

from . import _models as M

pytestmark = pytest.mark.gpu

K = 20
CLEAR = 0.1  # nats between the reference's top two: where bf16 cannot swap them
TOL_MEAN_ABS = 0.05  # mean |logprob - fp32 reference| over every returned token (bf16 engine)


def test_prompt_logprobs_are_the_targets_next_token_distribution(tmp_path, monkeypatch):
    import transformers as tf

    from vllm_compat.runtime import llm as serve

    path = M.build("llama", str(tmp_path / "llama"))
    seqs = [p for p in M.prompts() if len(p) > 1][:6]
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # whatever CUDA this process has up
    llm = serve.open_llm(path, enforce_eager=True, gpu_memory_utilization=0.05, max_model_len=M.MAX_LEN,
                         skip_tokenizer_init=True, max_num_seqs=8, max_logprobs=K, log_stats=False,
                         **M.engine_kwargs())
    try:
        rows = serve.prompt_logprobs(llm, seqs, k=K)
    finally:
        serve.close_llm(llm)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    diffs, shifted, agree, clear = [], [], 0, 0
    for seq, got in zip(seqs, rows, strict=True):
        assert got[0] is None and len(got) == len(seq)
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([seq], device="cuda")).logits[0].float(), -1).cpu()
        for t in range(1, len(seq)):
            row = got[t]
            assert len(row) == K, (t, len(row))
            top = torch.topk(ref[t - 1], 2)
            if float(top.values[0] - top.values[1]) > CLEAR:
                clear += 1
                agree += max(row, key=row.__getitem__) == int(top.indices[0])
            diffs += [abs(lp - float(ref[t - 1, tok])) for tok, lp in row.items()]
            if t < len(seq) - 1:
                shifted += [abs(lp - float(ref[t, tok])) for tok, lp in row.items()]
    mean_abs = sum(diffs) / len(diffs)
    M.record("prompt_logprobs_rows:llama", mean_abs=mean_abs, max_abs=max(diffs),
             mean_abs_one_position_off=sum(shifted) / len(shifted), top1_agree=agree / clear, clear=clear)
    assert clear and agree / clear >= 0.95, (agree, clear)
    assert mean_abs < TOL_MEAN_ABS, mean_abs
