#!/usr/bin/env bash
# The first draft training of this session shared the CPU with a FlashInfer JIT build
# (0.20.2 DeepSeek test) and ran 119 steps in 3 min instead of ~1400: stop that build and
# the evaluation of that draft; train the draft again on the same extracted data, alone.
pkill -f "job020b.sh"; pkill -f "pytest -m gpu"; pkill -f "ninja"; pkill -f "e2e evaluate"; pkill -f "h200-session.sh"; pkill -f "/root/job2.sh"; sleep 3
pkill -9 -f "e2e evaluate"; pkill -9 -f "pytest -m gpu"; pkill -9 -f nvcc; sleep 1
OUTDIR=/root/sess; cd /root/vc
stamp() { echo "$(date +%H:%M:%S) $*" >> "$OUTDIR/timeline.txt"; }
stamp "killed: 020c, evaluate of the 119-step draft; retrain start"
cat > /root/job3.sh <<'EOF'
set -u
OUTDIR=/root/sess; cd /root/vc
stamp() { echo "$(date +%H:%M:%S) $*" >> "$OUTDIR/timeline.txt"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=/tmp/site-026:/root/vc/src VLLM_CACHE_ROOT=/root/vllm-cache-026
mv /root/e2e/llama/run /root/e2e/llama/run-contended 2>/dev/null
python3 - > "$OUTDIR/retrain.log" 2>&1 <<'PY'
import shutil, torch
from pathlib import Path
from vllm_compat.eagle3 import e2e
from vllm_compat.eagle3.export import export
from vllm_compat.eagle3.validate import validate
work, out = Path("/root/e2e"), Path("/root/sess/e2e")
mdir, target = work / "llama", work / "llama" / "target"
rec = e2e.Recorder(work, out, "pipeline", "llama")
with rec.step("train_draft") as r:
    kw = dict(dataset=str(mdir / "ds"), target=str(target), vocab=str(mdir / "vocab"), output_dir=str(mdir / "run"),
              batch_size=16, ttt_steps=5, lr=5e-4, warmup_steps=100, min_lr_ratio=0.1, dtype="bf16", seed=0,
              checkpoint_every=10 ** 9, progress=False, tensorboard=False)
    r.update(e2e.train_draft(kw, torch.device("cuda"), minutes=2.5, steps=None))
    r["note"] = "re-run alone: the first training shared the CPU with a FlashInfer JIT build (119 steps)"
with rec.step("export") as r:
    shutil.rmtree(mdir / "draft", ignore_errors=True)
    r["path"] = str(export(mdir / "run", target, mdir / "draft", speculative_tokens=3))
with rec.step("validate") as r:
    rep = validate(mdir / "draft", target, with_vllm=False, raise_on_error=False)
    r.update(ok=rep.ok, with_vllm=False, problems=[p.code for p in rep.problems])
    assert rep.ok, rep.problems
PY
stamp "retrain rc=$?"
python3 -m vllm_compat.eagle3.e2e evaluate --model llama --work /root/e2e --out "$OUTDIR/e2e" \
  --eval-budget-s 330 > "$OUTDIR/evaluate.log" 2>&1
stamp "evaluate rc=$?"
touch "$OUTDIR/job3.done"
EOF
setsid nohup bash /root/job3.sh > /root/sess/job3.log 2>&1 < /dev/null &
sleep 2; ps -eo pid,etime,pcpu,cmd | grep -E "python3|ninja|nvcc" | grep -v grep | cut -c1-120; tail -3 /root/sess/timeline.txt
