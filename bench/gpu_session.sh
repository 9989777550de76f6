#!/usr/bin/env bash
# One call on a lent GPU (the device tool), run from the repository root:
#   COURSE_COMMIT=<sha> bash bench/gpu_session.sh
# Stages, each under one time limit of its own, so that the call ends in under 9 minutes (worst case:
# the limits' sum, ENV_S + AOT_S + PREFILL_S + DECODE_S + TEST_S = 525 s, plus packing):
#   1. the environment: nvidia-smi's query, torch / CUDA / cuDNN / Triton versions, and what
#      `bench_attention.py --estimate` expects each bench stage to take (a model; compare with the log);
#   2. ahead-of-time compiles with the Triton the GPU runs (helpers.tools.kernel_report);
#   3. the prefill rows (make bench's training shapes), --repeats passes, --time-limit so that a pass
#      that would not fit is not started (the CSV is written after every cell in any case);
#   4. the decode rows (bench_decode.py), likewise;
#   5. the kernel tests on CUDA.
# Everything lands in $OUT: session.log (all output) and session.tgz (every file written, repacked
# after each stage: the device tool returns at most 8 files, and a stage cut short keeps what the
# earlier ones wrote). The decode rows alone: PREFILL_S=0 TEST_FILES=tests/test_nb12_triton_decode.py.
set -u
OUT=${OUT:-/tmp/gpu_session}
WORK=${WORK:-/tmp/gpu_session_work}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
ENV_S=${ENV_S:-30} AOT_S=${AOT_S:-90} PREFILL_S=${PREFILL_S:-240} DECODE_S=${DECODE_S:-105} TEST_S=${TEST_S:-60}
# T = 1,024 and 4,096 hold every goal's cells; course-pointers and both SDPA backends are what
# notebook 09 reads at T = 4,096. What each should take: the environment stage prints it (and
# bench/README.md says it, tests/test_bench_attention.py keeping the two in step).
PREFILL_ARGS=${PREFILL_ARGS:---seqs 1024,4096 --impls sdpa-flash,sdpa-cudnn,course,course-pointers,course-fused --rep 25 --repeats 3}
DECODE_ARGS=${DECODE_ARGS:---decode-batches 1,32 --decode-ctx 1024,16384 --decode-impls course,course-1split,sdpa-flash,sdpa-cudnn,sdpa-default --rep 25 --repeats 3}
pack() { tar -czf "$OUT/session.tgz.part" -C "$WORK" . && mv "$OUT/session.tgz.part" "$OUT/session.tgz"; }
stage() { echo "== $1, at most $2 s ($(date -u +%T))"; }
# the environment stage's commands, under one timeout together (a timeout each would allow 4 x ENV_S)
# shellcheck disable=SC2086
environment() {
  nvidia-smi --format=csv \
    --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu,pstate
  $PY -c "import os, torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__, 'capability',
torch.cuda.get_device_capability(), 'cpus', os.cpu_count())"
  $PY bench/bench_attention.py --estimate --no-decode $PREFILL_ARGS
  $PY bench/bench_attention.py --estimate --decode-only $DECODE_ARGS
}
export -f environment
export PY PREFILL_ARGS DECODE_ARGS
# shellcheck disable=SC2086
{
  stage environment "$ENV_S"
  timeout "$ENV_S" bash -c environment
  stage "ahead-of-time compiles (kernel_report)" "$AOT_S"
  time timeout "$AOT_S" $PY -m helpers.tools.kernel_report --fast --targets sm_90 --jobs 16 --out "$WORK/aot"
  pack
  if [ "$PREFILL_S" -gt 0 ]; then
    stage "prefill rows" "$PREFILL_S"
    time timeout "$PREFILL_S" $PY bench/bench_attention.py --out "$WORK" --no-decode \
      --time-limit $((PREFILL_S - 15)) $PREFILL_ARGS
    pack
  fi
  if [ "$DECODE_S" -gt 0 ]; then
    stage "decode rows" "$DECODE_S"
    time timeout "$DECODE_S" $PY bench/bench_attention.py --out "$WORK" --decode-only \
      --time-limit $((DECODE_S - 10)) $DECODE_ARGS
    pack
  fi
  if [ "$TEST_S" -gt 0 ]; then
    stage "kernel tests on CUDA" "$TEST_S"
    timeout "$TEST_S" $PY -m pytest -q -n 8 -m "not slow" -p no:cacheprovider ${TESTS:+-k "$TESTS"} \
      ${TEST_FILES:-tests/test_nb09_triton_flash.py} 2>&1 | tail -60
  fi
  echo "== done ($(date -u +%T))"
} 2>&1 | tee "$OUT/session.log"
pack
