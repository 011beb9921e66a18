#!/usr/bin/env bash
# Deferred staging on a GPU machine (issue 31): correctness with CUDA tensors, the D2H copy
# time, and lost time per save (today's mode, deferred, dcp.async_save). One short run:
#   bash benchmarks/deferred_gpu.sh OUT_DIR     (OUT_DIR defaults to $OUT, then ./gpu-deferred)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-deferred}}"
mkdir -p "$out"
nvidia-smi -L | tee "$out/device.txt" || true
PYTHONPATH="$PWD" timeout 480 python benchmarks/deferred_gpu.py --out "$out" 2>&1 | tee "$out/log.txt"
