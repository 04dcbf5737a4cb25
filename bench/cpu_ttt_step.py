"""CPU benchmark: one EAGLE-3 draft training step (TTT forward + backward), the explicit
attention and per-step target softmax against the fused attention and once-per-batch target
distribution, side by side in one process.

    python bench/cpu_ttt_step.py --out bench/results

Why: on the H200 (2026-11-29, fourth session) the draft trained at 8.85 steps/s at batch 32
with every sample already on the GPU: the step itself, not the host, was the cost. The
explicit form builds fp32 ``[batch, heads, T, T]`` scores per TTT step and recomputes the
target's softmax over the vocabulary at every step. The "before" code is the
``model.py`` of the commit before the change, read from git (``--before``), so nothing of it
is copied here. This is a CPU measurement: it shows the work saved, not the GPU's speed-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from git_history import ROOT, before_change, full_sha, module_at  # noqa: E402  (bench/ is not a package)

MODEL = "src/vllm_compat/eagle3/model.py"


def before_rev() -> str:
    """The parent of the commit that brought the fused attention (``ttt_attention_mask``)."""
    rev = before_change("def ttt_attention_mask", MODEL)
    if rev is None:
        raise SystemExit("the fused attention is not committed yet: pass --before REV")
    return rev


def setup(M, a, seed=0):
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


def step_time(M, draft, target, batch, steps):
    t0 = time.perf_counter()
    out = M.ttt_forward(draft, target, batch, steps, 1.0)
    out.loss.backward()
    draft.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, out.loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--before", help="git revision of the explicit form (default: found with git log -S)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024, help="longest sample (batches pad to it)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rev = a.before or before_rev()
    sha = full_sha(rev)
    from vllm_compat.eagle3 import model as after

    mods = {"before": module_at(rev, MODEL, "ttt_model_before"), "after": after}
    built = {k: setup(M, a) for k, M in mods.items()}
    # same weights in both (the modules are distinct classes with the same parameter names)
    built["after"][0].load_state_dict(built["before"][0].state_dict())
    times: dict[str, list[float]] = {k: [] for k in mods}
    losses = {}
    for k, M in mods.items():  # warm-up
        losses[k] = step_time(M, *built[k], a.ttt_steps)[1]
    for _ in range(a.repeats):  # interleaved
        for k, M in mods.items():
            times[k].append(step_time(M, *built[k], a.ttt_steps)[0])
    best = {k: min(v) for k, v in times.items()}
    res = {
        "benchmark": "cpu_ttt_step", "before_rev": sha, "shape": {k: getattr(a, k) for k in (
            "batch", "seq", "hidden", "heads", "kv_heads", "intermediate", "vocab", "ttt_steps")},
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "best_s": {k: round(v, 4) for k, v in best.items()},
        "median_s": {k: round(statistics.median(v), 4) for k, v in times.items()},
        "speedup_best": round(best["before"] / best["after"], 3),
        "loss": losses, "loss_rel_diff": abs(losses["after"] - losses["before"]) / abs(losses["before"]),
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_ttt_step.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("best_s", "median_s", "speedup_best", "loss_rel_diff")}))


if __name__ == "__main__":
    main()
