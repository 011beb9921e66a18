#!/usr/bin/env bash
# One prepared run on a GPU machine (the device tool lends one for minutes): the CUDA tests,
# the FSDP2 example across devices, and benchmarks/gpu.py. Everything lands under $OUT.
#   OUT=/tmp/gpu bash benchmarks/gpu_run.sh
# Wheels the machine lacks (crc32c, pytest-asyncio) may travel in .whl/ (git-ignored).
set -u
OUT=${OUT:-bench-results/gpu-run}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi; free -g; df -h /tmp .; nproc; } >"$OUT/machine.txt" 2>&1
$PY -c "import torch, asyncckpt, crc32c; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" \
  2>&1 | tee -a "$OUT/machine.txt"
timeout "${TESTS_S:-200}" $PY -m pytest -q -p no:cacheprovider -rA --timeout 170 \
  tests/test_cuda.py tests/test_readinto.py >"$OUT/tests.log" 2>&1
echo "tests: exit $?" | tee -a "$OUT/machine.txt"
tail -5 "$OUT/tests.log"
timeout "${BENCH_S:-300}" $PY benchmarks/gpu.py --sizes "${SIZES:-1G,4G}" --restore-sizes "${RESTORE_SIZES:-1G}" \
  --repeats 5 --budget-s "${BUDGET_S:-170}" ${BENCH_ARGS:-} --out "$OUT/bench" 2>"$OUT/bench.err"
echo "bench: exit $?" | tee -a "$OUT/machine.txt"
