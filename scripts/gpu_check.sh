#!/usr/bin/env bash
# One prepared GPU check of the block-diagonal CP kernels (flash / te vs dense, bf16, cp=2 and 4).
#
#   bash scripts/gpu_check.sh              # on the GPU machine, from anywhere in the repo
#   bash scripts/gpu_check.sh --dry-run    # CPU, fp32, tiny sizes, flash test double
#
# Needs python3 with torch (CUDA build for the real run); megatron-core, TransformerEngine and
# flash-attn are optional and not installed by this script. Prints one JSON line per check and
# writes them to $OUT/gpu_check.jsonl when OUT is set. Exit status 0 only if every check passed.
# A hard wall-clock limit keeps the whole run under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
# --budget-s: no new check starts after 6.5 min; timeout: hard stop at 7.8 min.
exec timeout -k 10 468 "$PY" scripts/gpu_check.py --budget-s 390 "$@"
