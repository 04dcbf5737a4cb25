#!/usr/bin/env bash
# One H200 device session (30 min of device time) for issues #7 and #4, vLLM 0.26.0 only
# (#3, which needed 0.20.2 beside it, was resolved on 2026-11-29). Sixth version (adds `x2`:
# a two-GPU host for #4 and #9); what went wrong in the earlier ones is in gpu/README.md.
# Run on the GPU host from /root/vc (a copy of src/ bench/ tests/ gpu/), after the staging
# calls of gpu/README.md. Jobs run detached; every log, JSON and plot goes to /root/sess,
# which `collect` (also run by `status` and `wait`) archives into $OUT.
# Order (everything timed runs alone on the GPU):
#   target training (1 min, during the staging calls)
#   -> the launch_ahead GPU test beside the pipeline's prepare + self-distill (fixed KV
#      caches on both sides: vLLM's memory profiler counts other processes' allocations)
#   -> the EAGLE-3 pipeline (prepare, self-distill, extract, draft training, export, validate)
#   -> evaluate (7 engines: baseline, EAGLE-3 and n-gram at K = 3, 1, 5)
#   -> the extraction benchmark (#4) in whatever device time is left: llama-1b (a, b,
#      b_ahead, c: to disk, bf16 and FP8), then deepseek-tiny (a, b, b_ahead, d, e).
# Expected (s of device time from call 1): staging ~60; target done ~90; pipeline ~90-650
# (draft training 5 min); evaluate ~650-1150; benchmarks ~1150-1700.
# VLLM_USE_FLASHINFER_SAMPLER=0: the first engine on a fresh host spent 143 s after the
# FlashInfer autotune line (4th session, bench2.log) -- the warm-up's top-k/top-p sampler
# run, JIT-built by FlashInfer (no flashinfer-cubin in the staging). Every run here is
# greedy, which samples by argmax and never reaches that sampler.
#
#   bash gpu/h200-session.sh target      # call 1: EAGLE-3 target training (no vLLM needed)
#   bash gpu/h200-session.sh after-026   # last staging call: pipeline, evaluate, benchmarks
#   bash gpu/h200-session.sh bench-all   # instead of the two above: issue #4's benchmarks only
#   bash gpu/h200-session.sh x2          # on nvidia-h200-x2: #4's benchmarks + #9's two-GPU tests
#   bash gpu/h200-session.sh wait [S]    # block until job-026.done or S s (540), then status
#   bash gpu/h200-session.sh status      # progress
#   bash gpu/h200-session.sh collect     # everything small into $OUT/h200-out.tar.gz
set -u
OUTDIR=/root/sess  # not $OUT: the device tool empties $OUT at every call
SESSION_S=${SESSION_S:-1740}  # the session's device time; the benchmarks get what is left
mkdir -p "$OUTDIR" /root/e2e
cd /root/vc
common() {
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export VLLM_USE_FLASHINFER_SAMPLER=0
}
stamp() { echo "$(date +%H:%M:%S) $*" >> "$OUTDIR/timeline.txt"; }
detach() { setsid nohup bash -c "$1" > "$2" 2>&1 < /dev/null & }
# seconds of the session left, counted from call 1 (its start is in $OUTDIR/t0)
left() { echo $(( SESSION_S - ($(date +%s) - $(cat "$OUTDIR/t0")) )); }
# benchmarks "MODEL MODES" ...: one bench/gpu_extraction.py run per model (eager), each given
# the session's time left minus 60 s for the last collect; skipped under 90 s
benchmarks() {
  local spec budget model modes
  for spec in "$@"; do
    set -- $spec
    model=$1 modes=$2
    shift 2  # the rest: extra arguments for bench/gpu_extraction.py
    budget=$(( $(left) - ${BENCH_KEEP_S:-60} ))
    [ "$budget" -lt 90 ] && { stamp "bench $model skipped (left $(left) s)"; continue; }
    stamp "bench $model start (budget $budget s)"
    timeout $(( budget + 30 )) python3 bench/gpu_extraction.py --model "$model" --out "$OUTDIR/bench" \
      --modes "$modes" --enforce-eager --time-budget-s "$budget" "$@" > "$OUTDIR/bench-$model.log" 2>&1
    stamp "bench $model rc=$?"
  done
}

case "${1:-}" in
target)
  common
  [ -f "$OUTDIR/t0" ] || date +%s > "$OUTDIR/t0"
  stamp "target start"
  detach "PYTHONPATH=/root/vc/src python3 -m vllm_compat.eagle3.e2e target --work /root/e2e \
    --out $OUTDIR/e2e; echo rc=\$? ; echo \"\$(date +%H:%M:%S) target end\" >> $OUTDIR/timeline.txt" \
    "$OUTDIR/target.log"
  ;;
after-026)
  stamp "0.26.0 installed"
  detach "bash /root/vc/gpu/h200-session.sh job-026" "$OUTDIR/job-026.log"
  detach "bash /root/vc/gpu/h200-session.sh tests" "$OUTDIR/tests-job.log"
  ;;
tests)
  # the launch_ahead GPU test (tiny Llama), beside the pipeline's prepare and self-distill;
  # the draft's training waits for it (--train-after)
  common
  export PYTHONPATH=/tmp/site:/root/vc/src VLLM_CACHE_ROOT=/root/vllm-cache-026
  export VLLM_COMPAT_GPU_RESULTS=$OUTDIR/gpu-results-026.jsonl
  export VLLM_COMPAT_GPU_TEST_KV_BYTES=2147483648
  stamp "tests start"
  timeout 300 python3 -m pytest -m gpu -v tests/gpu/test_extract_gpu.py -k "launch_ahead" \
    --durations=0 -o faulthandler_timeout=200 > "$OUTDIR/tests.log" 2>&1
  rc=$?; echo "rc=$rc" >> "$OUTDIR/tests.log"; stamp "tests rc=$rc"
  touch /root/tests.done
  ;;
job-026)
  common
  export PYTHONPATH=/tmp/site:/root/vc/src VLLM_CACHE_ROOT=/root/vllm-cache-026
  export VLLM_COMPAT_GPU_RESULTS=$OUTDIR/gpu-results-026.jsonl
  # 1. the EAGLE-3 draft pipeline (issue #7), alone on the GPU
  stamp "pipeline start (left $(left) s)"
  python3 -m vllm_compat.eagle3.e2e pipeline --model llama --work /root/e2e --out "$OUTDIR/e2e" \
    --draft-minutes "${DRAFT_MINUTES:-5}" --self-distill 8192 --engine-kwargs '{"kv_cache_memory_bytes": 8589934592}' \
    --train-after /root/tests.done --wait-timeout 300 > "$OUTDIR/pipeline.log" 2>&1
  stamp "pipeline rc=$?"
  # 2. evaluate: timed, alone; keep ~240 s for the benchmarks and the last polls
  stamp "evaluate start (left $(left) s)"
  python3 -m vllm_compat.eagle3.e2e evaluate --model llama --work /root/e2e --out "$OUTDIR/e2e" \
    --eval-budget-s $(( $(left) - 240 > 300 ? $(left) - 240 : 300 )) > "$OUTDIR/evaluate.log" 2>&1
  stamp "evaluate rc=$?"
  # 3. the benchmarks (issue #4) in what is left (60 s kept for the last collect)
  benchmarks "llama-1b a,b,b_ahead,c" "deepseek-tiny a,b,b_ahead,d,e"
  touch "$OUTDIR/job-026.done"
  ;;
bench-all)
  # issue #4 alone (for a session without #7): every mode of every model in one run per model,
  # the 8B last, in the session's time (call 1 writes t0 as `target` does; no target here)
  [ -f "$OUTDIR/t0" ] || date +%s > "$OUTDIR/t0"
  detach "bash /root/vc/gpu/h200-session.sh job-bench-all" "$OUTDIR/job-bench-all.log"
  ;;
job-bench-all)
  common
  export PYTHONPATH=/tmp/site:/root/vc/src VLLM_CACHE_ROOT=/root/vllm-cache-026
  benchmarks "llama-1b a,b,b_sync,c,e,d" "deepseek-tiny a,b,c,e,d" "llama-8b a,b,c,e,d"
  touch "$OUTDIR/job-026.done"
  ;;
x2)
  # sixth session, nvidia-h200-x2: issue #4's benchmarks on GPU 0 with the pipelined-loop GPU
  # tests beside them on GPU 1, then issue #9's two-GPU tests, then the 8B benchmark in
  # whatever is left (call 1 writes t0)
  [ -f "$OUTDIR/t0" ] || date +%s > "$OUTDIR/t0"
  detach "bash /root/vc/gpu/h200-session.sh job-x2" "$OUTDIR/job-x2.log"
  ;;
job-x2)
  common
  export PYTHONPATH=/tmp/site:/root/vc/src VLLM_CACHE_ROOT=/root/vllm-cache-026
  export VLLM_COMPAT_GPU_RESULTS=$OUTDIR/gpu-results-026.jsonl
  nvidia-smi -L > "$OUTDIR/gpus.txt" 2>&1; nvidia-smi topo -m >> "$OUTDIR/gpus.txt" 2>&1
  stamp "pipeline tests start on GPU 1"
  CUDA_VISIBLE_DEVICES=1 timeout 600 python3 -m pytest -m gpu -v tests/gpu/test_extract_gpu.py \
    -k "launch_ahead or overlapped" --durations=0 -o faulthandler_timeout=300 \
    > "$OUTDIR/tests.log" 2>&1 &
  tp=$!
  CUDA_VISIBLE_DEVICES=0 BENCH_KEEP_S=480 benchmarks \
    "llama-1b a,b,b_lockstep,b_sync,c,e,d --num-prompts 512 --mixed-prompts 256" \
    "deepseek-tiny a,b,b_lockstep,c,e,d --num-prompts 512 --mixed-prompts 512"
  wait $tp; stamp "pipeline tests rc=$?"
  stamp "multi-gpu tests start (left $(left) s)"
  timeout $(( $(left) - 120 )) python3 -m pytest -m gpu -v tests/gpu/test_multi_gpu.py \
    tests/gpu/test_extract_gpu.py -k "multi_gpu or tensor_parallel or tp2 or torchrun or long_run" \
    --durations=0 -o faulthandler_timeout=400 > "$OUTDIR/tests-multi.log" 2>&1
  stamp "multi-gpu tests rc=$?"
  CUDA_VISIBLE_DEVICES=0 benchmarks "llama-8b a,b,c,e,d"
  touch "$OUTDIR/job-026.done"
  ;;
wait)
  # block until the session's last job is done or ${2:-540} s have passed, then report:
  # one long call instead of many short polls, so no gap between calls can release the host
  for _ in $(seq 1 $(( ${2:-540} / 5 ))); do [ -f "$OUTDIR/job-026.done" ] && break; sleep 5; done
  bash /root/vc/gpu/h200-session.sh status
  ;;
status)
  bash /root/vc/gpu/h200-session.sh collect >/dev/null 2>&1 || true
  cat "$OUTDIR/timeline.txt" 2>/dev/null
  for f in tests tests-multi; do [ -f "$OUTDIR/$f.log" ] && { echo "== $f"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|rc=" "$OUTDIR/$f.log" | tail -10 | cut -c1-250; }; done
  for f in target pipeline evaluate bench-deepseek-tiny bench-llama-1b bench-llama-8b; do [ -f "$OUTDIR/$f.log" ] && { echo "== $f"; grep -v "^\s*$" "$OUTDIR/$f.log" | grep -iv "warn" | tail -4 | cut -c1-300; }; done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  ;;
collect)
  cd /root && tar czf "$OUT/h200-out.tar.gz" --exclude="*.safetensors" --exclude="*.pt" sess
  ls -la "$OUT"
  ;;
*) echo "unknown step ${1:-}" >&2; exit 2 ;;
esac
