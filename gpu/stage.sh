#!/usr/bin/env bash
# Stage a vLLM release for the GPU host with the shared staging logic
# (../shared/gpu/stage.sh + install.sh, unchanged) and this repo's lock file.
#
# usage (from the repo root): bash gpu/stage.sh [VERSION] [OUTDIR]
#   defaults: 0.20.2, .gpu-stage.  SHARED_GPU overrides where the shared scripts live.
set -euo pipefail
VERSION=${1:-0.20.2}
OUT=${2:-.gpu-stage}
HERE=$(cd "$(dirname "$0")" && pwd)
SHARED=${SHARED_GPU:-$HERE/../../shared/gpu}
LOCK="$HERE/vllm-$VERSION.lock"
[ -f "$LOCK" ] || { echo "no lock file $LOCK" >&2; exit 2; }
[ -f "$SHARED/stage.sh" ] || { echo "no shared stage.sh in $SHARED" >&2; exit 2; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
cp "$SHARED/stage.sh" "$SHARED/install.sh" "$LOCK" "$T/"
bash "$T/stage.sh" "$VERSION" "$OUT"
