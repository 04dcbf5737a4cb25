#!/usr/bin/env bash
# 0.20.2, second part: the tests the first run's timeout cut off (it sat 5+ min in the first
# DeepSeek-V3 engine). Non-DeepSeek first (gates the timed work), DeepSeek with stack dumps.
set -u
OUTDIR=/root/sess; cd /root/vc
stamp() { echo "$(date +%H:%M:%S) $*" >> "$OUTDIR/timeline.txt"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONPATH=/tmp/site:/root/vc/src VLLM_CACHE_ROOT=/root/vllm-cache-020
export VLLM_COMPAT_GPU_RESULTS=$OUTDIR/gpu-results-020.jsonl VLLM_COMPAT_GPU_TEST_KV_BYTES=2147483648
stamp "020b start"
timeout 200 python3 -m pytest -m gpu -v tests/gpu/test_extract_gpu.py --durations=0 \
  -k "runners or native or function or overlapped" > "$OUTDIR/t020b.log" 2>&1
rc=$?; echo "rc=$rc" >> "$OUTDIR/t020b.log"; stamp "020b rc=$rc"
touch /root/t020.done
timeout 330 python3 -m pytest -m gpu -v -s tests/gpu/test_extract_gpu.py --durations=0 -k deepseek \
  -o faulthandler_timeout=150 > "$OUTDIR/t020c.log" 2>&1
rc=$?; echo "rc=$rc" >> "$OUTDIR/t020c.log"; stamp "020c (deepseek) rc=$rc"
