#!/usr/bin/env bash
# One call on a lent GPU (the device tool), run from the repository root:
#   COURSE_COMMIT=<sha> BENCH_ARGS="--quick" bash bench/gpu_session.sh
#   (the decode rows alone: BENCH_ARGS="--decode-only" TEST_FILES=tests/test_nb12_triton_decode.py)
# The GPU and its software; make bench's checks, precompile, timings and autotuner report
# (bench/bench_attention.py); then the kernel tests on CUDA. Everything lands in $OUT.
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton',
triton.__version__, 'capability', torch.cuda.get_device_capability(), 'cpus', __import__('os').cpu_count())"
  # shellcheck disable=SC2086
  time $PY bench/bench_attention.py --out "$OUT" ${BENCH_ARGS:-}
} 2>&1 | tee "$OUT/bench.log"
if [ "${TEST_S:-120}" -gt 0 ]; then
  timeout "${TEST_S:-120}" $PY -m pytest -q -n 8 -m "not slow" -p no:cacheprovider ${TESTS:+-k "$TESTS"} ${TEST_FILES:-tests/test_nb09_triton_flash.py} 2>&1 \
    | tail -60 | tee "$OUT/pytest.log"
fi
