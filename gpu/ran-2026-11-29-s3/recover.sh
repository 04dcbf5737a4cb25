#!/usr/bin/env bash
# Recovery of the 2026-11-29 (3rd) session: the target phase trained and saved the target,
# then failed writing its report into $OUT (emptied by the device tool at every call).
pkill -f "h200-session.sh job-026" ; sleep 1
cd /root/vc
PYTHONPATH=/root/vc/src python3 - <<'EOF'
import json
from pathlib import Path
from vllm_compat.eagle3.e2e import write_marker
work = Path("/root/e2e")
rows = [json.loads(l) for l in (work / "e2e.jsonl").read_text().splitlines() if l.strip()]
t = [r for r in rows if r.get("step") == "target_train"][-1]
print("target_train:", t["status"], t["wall_s"], t["result"].get("heldout"), t["result"].get("selected_step"))
print(sorted(p.name for p in (work / "llama" / "target").iterdir()))
assert t["status"] == "ok"
write_marker(work, "target", status="ok", heldout=t["result"]["heldout"], note="marker rewritten after the report mirror failed")
EOF
cat > /root/job2.sh <<'EOF'
set -u
OUTDIR=/root/sess; cd /root/vc
stamp() { echo "$(date +%H:%M:%S) $*" >> "$OUTDIR/timeline.txt"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=/tmp/site-026:/root/vc/src VLLM_CACHE_ROOT=/root/vllm-cache-026
export VLLM_COMPAT_GPU_RESULTS=$OUTDIR/gpu-results-026.jsonl
stamp "pipeline (2nd) start"
python3 -m vllm_compat.eagle3.e2e pipeline --model llama --work /root/e2e --out "$OUTDIR/e2e" \
  --draft-minutes 3 --engine-kwargs '{"kv_cache_memory_bytes": 8589934592}' > "$OUTDIR/pipeline.log" 2>&1
stamp "pipeline rc=$?"
for _ in $(seq 1 100); do [ -f /root/t020.done ] && break; sleep 3; done
stamp "evaluate start (t020.done: $([ -f /root/t020.done ] && echo yes || echo NO))"
python3 -m vllm_compat.eagle3.e2e evaluate --model llama --work /root/e2e --out "$OUTDIR/e2e" \
  --eval-budget-s 360 > "$OUTDIR/evaluate.log" 2>&1
stamp "evaluate rc=$?"
stamp "bench start"
python3 bench/gpu_extraction.py --model llama-1b --out "$OUTDIR/bench" --modes a,a_sync,b,b_sync,c,d,e \
  --repeats 1 --warmup-prompts 16 --time-budget-s 330 > "$OUTDIR/bench.log" 2>&1
stamp "bench rc=$?"
touch "$OUTDIR/job-026.done"
EOF
setsid nohup bash /root/job2.sh > /root/sess/job2.log 2>&1 < /dev/null &
sleep 2; tail -3 /root/sess/timeline.txt; grep -E "PASSED|FAILED|ERROR" /root/sess/t020.log | tail -3; tail -c 600 /root/sess/t020.log
