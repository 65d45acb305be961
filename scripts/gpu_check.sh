#!/usr/bin/env bash
# One prepared GPU check of the block-diagonal CP kernels: the gpu_check suite of the bench runner
# (flash / te / dense vs fp32 for every layout x exchange at cp=2 and 4, the fused Triton merge
# against its eager body, engine overhead, kernel timing at 32k tokens, the bf16 matmul peak measured
# in the same run).
#
#   bash scripts/gpu_check.sh              # on the GPU machine, from anywhere in the repo
#   bash scripts/gpu_check.sh --dry-run    # CPU, fp32, tiny sizes, flash test double
#
# Needs python3 with torch (CUDA build for the real run); megatron-core, TransformerEngine and
# flash-attn are optional and not installed by this script. Prints one JSON line per check and
# writes them, with SUMMARY.md, to $OUT (default runs/gpu_check). Exit status 0 only if every
# check passed. A hard wall-clock limit keeps the whole run under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-runs/gpu_check}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
# --budget-s: no new check starts after 6.5 min; timeout: hard stop at 7.8 min.
exec timeout -k 10 468 "$PY" scripts/bench/run_all.py --suites gpu_check --no-plots --out "$OUT_DIR" \
  --budget-s 390 "$@"
