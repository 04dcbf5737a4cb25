"""CPU benchmark: the target's labels for one EAGLE-3 training batch at Kimi-K2.5's vocabulary.

    python -m bench.cpu_target_labels --out OUT.json

Each training step turns the target's last hidden state into its distribution over the draft
vocabulary and its argmax over the whole vocabulary. Side by side, interleaved per round, on
the same batch: the whole ``[B, T, V]`` logits of the padded batch at once (what training did
before) against ``eagle3.model.target_labels`` (the valid positions only, the lm_head in pieces
of ``TARGET_ROWS_PER_MATMUL`` rows). Reports the time of each, their ratio, and the largest
logits tensor each holds. A CPU measurement of the work, not of a GPU's speed.
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


def whole_logits(target: M.TargetHead, last: torch.Tensor, vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tgt = target(last).float()  # [B, T, V]
    return tgt[..., vocab].softmax(-1), tgt.argmax(-1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="cpu_target_labels.json")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024, help="longest sample; the others 1/4 to all of it")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=163_840, help="target vocabulary (Kimi-K2.5's)")
    ap.add_argument("--draft-vocab", type=int, default=16_384)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    target = M.TargetHead(torch.rand(a.hidden, generator=g) + 0.5, torch.randn(a.vocab, a.hidden, generator=g), 1e-6)
    lens = torch.randint(a.seq // 4, a.seq + 1, (a.batch,), generator=g).tolist()
    lens[0] = a.seq
    valid = torch.arange(a.seq).expand(a.batch, a.seq) < torch.tensor(lens)[:, None]
    last = torch.randn(a.batch, a.seq, a.hidden, generator=g)
    vocab = torch.randperm(a.vocab, generator=g)[:a.draft_vocab].sort().values
    d2t = vocab - torch.arange(a.draft_vocab)
    times: dict[str, list[float]] = {"whole": [], "pieces": []}
    with torch.no_grad():
        p0, b0 = whole_logits(target, last, vocab)
        p1, b1 = M.target_labels(target, last, valid, vocab, d2t, pad=0)
        same = bool(torch.equal(b0[valid], b1[valid])) and bool(torch.allclose(p0[valid], p1[valid], atol=1e-6))
        del p0, b0, p1, b1
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            whole_logits(target, last, vocab)
            times["whole"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            M.target_labels(target, last, valid, vocab, d2t, pad=0)
            times["pieces"].append(time.perf_counter() - t0)
    tokens = sum(lens)
    res = {
        "benchmark": "cpu_target_labels", "shape": {k: getattr(a, k) for k in ("batch", "seq", "hidden", "vocab",
                                                                                 "draft_vocab")},
        "valid_tokens": tokens, "padded_tokens": a.batch * a.seq, "same_labels": same,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "speedup_median": round(statistics.median(times["whole"]) / statistics.median(times["pieces"]), 2),
        "largest_logits_gib": {"whole": round(a.batch * a.seq * a.vocab * 4 / 2**30, 2),
                               "pieces": round(tokens * min(M.TARGET_ROWS_PER_MATMUL, a.vocab) * 4 / 2**30, 2)},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("median_s", "speedup_median", "largest_logits_gib", "same_labels")}))
    return res


if __name__ == "__main__":
    main()
