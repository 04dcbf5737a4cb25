"""CPU benchmark: one EAGLE-3 draft training step (training-time-test forward + backward).

    python -m bench.cpu_ttt_step --out OUT

The draft's TTT forward (``--ttt-steps`` steps on one fused ``scaled_dot_product_attention``
over the context and the speculated keys, the target's distribution once per batch) and its
backward at ``--batch`` x ``--seq`` tokens, best and median of ``--repeats`` after a warm-up.
A CPU measurement of the step's work, not of a GPU's speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from vllm_compat.eagle3 import model as M


def setup(a: argparse.Namespace, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    cfg = M.DraftConfig(hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                        intermediate_size=a.intermediate, target_vocab_size=a.vocab, draft_vocab_size=a.vocab,
                        aux_layer_ids=[2, 4, 5], final_layer_id=8)
    draft = M.Eagle3Draft(cfg)
    target = M.TargetHead(torch.rand(a.hidden) + 0.5, torch.randn(a.vocab, a.hidden) * 0.05, 1e-6)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(a.seq // 2, a.seq + 1, (a.batch,), generator=g).tolist()
    lens[0] = a.seq
    valid = torch.zeros(a.batch, a.seq, dtype=torch.bool)
    for i, n in enumerate(lens):
        valid[i, :n] = True
    batch = {"input_ids": torch.randint(0, a.vocab, (a.batch, a.seq), generator=g), "loss_mask": valid.clone(),
             "valid": valid, "hidden_states": torch.randn(a.batch, a.seq, 4, a.hidden, generator=g)}
    return draft, target, batch


def step_time(draft: M.Eagle3Draft, target: M.TargetHead, batch: dict, steps: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = M.ttt_forward(draft, target, batch, steps, 1.0)
    out.loss.backward()
    draft.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, out.loss.item()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/vllm-compat-bench")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024, help="longest sample (batches pad to it)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    draft, target, batch = setup(a)
    _, loss = step_time(draft, target, batch, a.ttt_steps)  # warm-up
    times = [step_time(draft, target, batch, a.ttt_steps)[0] for _ in range(a.repeats)]
    res = {
        "benchmark": "cpu_ttt_step", "shape": {k: getattr(a, k) for k in (
            "batch", "seq", "hidden", "heads", "kv_heads", "intermediate", "vocab", "ttt_steps")},
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "seconds": [round(x, 4) for x in times], "best_s": round(min(times), 4),
        "median_s": round(statistics.median(times), 4), "loss": loss,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_ttt_step.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("best_s", "median_s", "loss")}))
    return res


if __name__ == "__main__":
    main()
