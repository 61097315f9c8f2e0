#!/usr/bin/env bash
# Every GPU measurement of lychee-rtc in one run, for a fresh GPU machine with no network:
# environment record, the CUDA-only tests (graph replay equals eager, for the LM's window programs
# and the vocoder's per-hop solve), `lychee-rtc bench gpu`
# (full size, random weights, C = 1,2,4,8,16, eager vs CUDA graphs), `lychee-rtc bench slide` (window
# steps around context slides of speaking sessions, C = 1,4: deadline misses and each slide's cost)
# and the per-hop vocoder bench.
# Results land in $OUT (default ./gpu-results); each step logs to its own file and the run goes on
# when a step fails, so one run leaves everything it could measure. The final line is a summary.
#
#   OUT=/tmp/results scripts/gpu_run.sh            # on the GPU machine
#   OUT=/tmp/results scripts/gpu_run.sh --tiny     # the same steps at tiny size on a CPU (a check)
#
# The last step is end to end through the server (`lychee-rtc bench e2e`): configs/lychee-c4.yaml,
# N = 1, 2, 4 aiortc callers speaking the recorded utterances of tests/fixtures/speech; window
# deadline misses, dropped windows, end of utterance to first answer audio. On the GPU it serves the
# models the profile names (mounted under /models); with --tiny it swaps in tiny random ones on the
# CPU, N = 1, 2 only, to fit a shared machine.
#
# Knobs (environment): PYTHON (default python3), WINDOWS (30), CONCURRENCY (1,2,4,8,16),
# STEP_TIMEOUT_S (330, the bench gpu step), E2E_TIMEOUT_S (300, the end-to-end step),
# SLIDE_TIMEOUT_S (180, the slide bench; SLIDE_SESSIONS 1,4), SMALL_TIMEOUT_S (90, every other
# step): at most about 17.5 minutes in all. bench gpu writes its report after every C, so a step cut short keeps the Cs
# it finished; it exits non-zero when a row has fewer windows than asked or nothing was measured.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
SIZE=full DEVICE=cuda
WINDOWS=${WINDOWS:-30}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16}
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-330}
SMALL_TIMEOUT_S=${SMALL_TIMEOUT_S:-90}
E2E_TIMEOUT_S=${E2E_TIMEOUT_S:-300}
SLIDE_TIMEOUT_S=${SLIDE_TIMEOUT_S:-180}
SLIDE_SESSIONS=${SLIDE_SESSIONS:-1,4}
EXTRA=()
SLIDE=()  # full size: the profiles' slide geometry (8192 positions, 6000 kept, 1500 per slide)
E2E=(--sessions 1,2,4 --turns 2)
if [[ "${1:-}" == "--tiny" ]]; then
  SIZE=tiny DEVICE=cpu WINDOWS=${TINY_WINDOWS:-2} CONCURRENCY=1,2
  EXTRA=(--threads 1 --prompt-seconds 1 --warmup 1)
  SLIDE=(--threads 1 --max-seq 1024 --window 600 --step 200 --chunk 64) SLIDE_SESSIONS=1,2
  E2E=(--sessions 1,2 --turns 1 --tiny "$OUT/e2e-tiny" --device cpu)
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
SUMMARY=()
FAILED=0

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record the exit status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee "$OUT/$name.log"
  timeout "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  SUMMARY+=("$name=$rc")
  [[ $rc == 0 ]] || FAILED=$((FAILED + 1))
}

step environment 30 bash -c "
  date -u; uname -a; nproc; free -g || true
  nvidia-smi || echo 'no nvidia-smi'
  $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
\"available\", torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"cpu\")'
  git log -1 --format='commit %H %s' 2>/dev/null || true"

# The graph-vs-eager checks of the LM's window programs and the vocoder's per-hop solve skip on CPUs
# ("needs CUDA"); on the GPU a skipped test fails this step, since it means nothing ran on the GPU.
GRAPH_TESTS=(tests/test_lychee_graphs.py tests/test_vocoder_graphs.py
             tests/test_lychee_context.py::test_replayed_graphs_give_the_eager_streams_across_slides)
if [[ $DEVICE == cuda ]]; then
  step tests_graphs "$SMALL_TIMEOUT_S" bash -c '
    py=$0 report=$1; shift
    "$py" -m pytest -q -x -rs "$@" | tee "$report"; rc=${PIPESTATUS[0]}
    if grep -q SKIPPED "$report"; then echo "a CUDA test skipped on the GPU"; exit 1; fi
    exit "$rc"' "$PY" "$OUT/tests_graphs.pytest.txt" "${GRAPH_TESTS[@]}"
else
  step tests_graphs "$SMALL_TIMEOUT_S" "$PY" -m pytest -q -x -rs "${GRAPH_TESTS[@]}" \
    -k "bucket or padding or fetch or switch or signature"
fi

step bench_gpu "$STEP_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench gpu --size "$SIZE" --device "$DEVICE" \
  --windows "$WINDOWS" --concurrency "$CONCURRENCY" --out "$OUT/bench-gpu" "${EXTRA[@]}"

step bench_slide "$SLIDE_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench slide --size "$SIZE" --device "$DEVICE" \
  --sessions "$SLIDE_SESSIONS" --slides 1 --out "$OUT/bench-slide" "${SLIDE[@]}"

if [[ $DEVICE == cuda ]]; then
  step bench_vocoder "$SMALL_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench vocoder --size full --device cuda \
    --dtype bf16 --concurrency 1 2 4 8 --rounds 30 --json "$OUT/vocoder_bf16.json"
else
  step bench_vocoder "$SMALL_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench vocoder --size tiny --device cpu \
    --concurrency 1 2 --rounds 2 --prompt-seconds 1 --threads 1 --json "$OUT/vocoder.json"
fi

step e2e "$E2E_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench e2e --config configs/lychee-c4.yaml \
  --json "$OUT/e2e.json" "${E2E[@]}"

echo "summary: ${SUMMARY[*]}" | tee "$OUT/summary.txt"
exit $((FAILED > 0))
