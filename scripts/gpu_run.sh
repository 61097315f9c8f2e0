#!/usr/bin/env bash
# Every GPU measurement of lychee-rtc in one run, for a fresh GPU machine with no network:
# environment record, the checkpoint to serve (written here when none is given), its check and
# memory plan, the CUDA-only tests (graph replay equals eager, for the LM's window programs and the
# vocoder's per-hop solve), end to end through the server on that checkpoint (`lychee-rtc bench
# e2e`), `lychee-rtc bench slide` (window steps of speaking sessions around context slides, full
# size, the profiles' slide geometry: deadline misses and each slide's cost), `lychee-rtc bench gpu`
# (full size, random weights in memory, eager vs CUDA graphs) and the per-hop vocoder bench.
# Results land in $OUT (default ./gpu-results); each step logs to its own file and the run goes on
# when a step fails, so one run leaves everything it could measure. The final line is a summary.
#
#   OUT=/tmp/results scripts/gpu_run.sh            # on the GPU machine
#   OUT=/tmp/results scripts/gpu_run.sh --tiny     # the same steps at tiny size on a CPU (a check)
#
# The checkpoint: CHECKPOINT=DIR serves DIR/lychee_full_duplex and DIR/token2wav (a `lychee-rtc
# download --dir DIR`, or a random one written earlier); otherwise the released folders in the
# Hugging Face cache if `lychee-rtc check` finds them there; otherwise a random full-size checkpoint
# in the released layout is written to WRITE_DIR (default /tmp/lychee-rtc-random, about 26 GB; an
# earlier run's is reused when it checks out) by
# `lychee-rtc random-checkpoint --device cuda`, so the server has the real shapes to load. Random
# weights cannot hear a turn end, so it is written with --decision-bias 4 (the callers commit).
#
# Knobs (environment): PYTHON (default python3), WINDOWS (20), CONCURRENCY (1,2,4,8,16),
# E2E_SESSIONS (1,2,4), BUDGET_S (570: the whole run, inside one 10-minute call), and per-step
# limits WRITE_TIMEOUT_S (240), STEP_TIMEOUT_S (300, bench gpu), E2E_TIMEOUT_S (240),
# SLIDE_TIMEOUT_S (150, bench slide at SLIDE_SESSIONS 1,4), SMALL_TIMEOUT_S (90). A step gets the
# smaller of its limit and what is left of the budget, and is skipped with less than 20 s left; bench gpu writes its report after every C, so a step cut short keeps the Cs
# it finished; it exits non-zero when a row has fewer windows than asked or nothing was measured.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
SIZE=full DEVICE=cuda
WINDOWS=${WINDOWS:-20}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16}
E2E_SESSIONS=${E2E_SESSIONS:-1,2,4}
BUDGET_S=${BUDGET_S:-570}
WRITE_TIMEOUT_S=${WRITE_TIMEOUT_S:-240}
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-300}
SMALL_TIMEOUT_S=${SMALL_TIMEOUT_S:-90}
SLIDE_TIMEOUT_S=${SLIDE_TIMEOUT_S:-150}
SLIDE_SESSIONS=${SLIDE_SESSIONS:-1,4}
SLIDE=()  # full size: the profiles' slide geometry (8192 positions; window, step and budget derived)
E2E_TIMEOUT_S=${E2E_TIMEOUT_S:-240}
WRITE_DIR=${WRITE_DIR:-}
CHECKPOINT=${CHECKPOINT:-}
EXTRA=()
E2E=(--turns 2)
if [[ "${1:-}" == "--tiny" ]]; then
  SIZE=tiny DEVICE=cpu WINDOWS=${TINY_WINDOWS:-2} CONCURRENCY=1,2 E2E_SESSIONS=1,2
  EXTRA=(--threads 1 --prompt-seconds 1 --warmup 1)
  SLIDE=(--threads 1 --max-seq 1024 --window 600 --step 200) SLIDE_SESSIONS=1,2
  E2E=(--turns 1 --device cpu)
fi
[[ -n $WRITE_DIR ]] || WRITE_DIR=/tmp/lychee-rtc-random$([[ $SIZE == tiny ]] && echo -tiny)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
SUMMARY=()
FAILED=0
DEADLINE=$((SECONDS + BUDGET_S))

step() {  # step NAME TIMEOUT_S COMMAND...: run within the budget, log to $OUT/NAME.log, record the status
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  if ((left < 20)); then
    echo "== $name: skipped, $left s of the budget left" | tee "$OUT/$name.log"
    SUMMARY+=("$name=skipped"); FAILED=$((FAILED + 1)); return
  fi
  ((limit > left - 5)) && limit=$((left - 5))
  local t0=$SECONDS
  echo "== $name (limit $limit s): $*" | tee "$OUT/$name.log"
  timeout "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  SUMMARY+=("$name=$rc")
  [[ $rc == 0 ]] || FAILED=$((FAILED + 1))
}

step environment 30 bash -c "
  date -u; uname -a; nproc; free -g || true; df -h /tmp . || true
  nvidia-smi || echo 'no nvidia-smi'
  $PY -c 'import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
\"available\", torch.cuda.is_available()); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"cpu\")'
  git log -1 --format='commit %H %s' 2>/dev/null || true"

# The checkpoint the server will load (see the head of this file).
CHECK_ARGS=(--config configs/lychee-c4.yaml)
[[ $SIZE == tiny ]] && CHECK_ARGS+=(--layout any)
checks() { $PY -m lychee_rtc.cli check "${CHECK_ARGS[@]}" --sessions 1 "$@" >/dev/null 2>&1; }
if [[ -z $CHECKPOINT && $SIZE == full ]] && checks; then
  echo "== checkpoint: the released folders in the Hugging Face cache" | tee "$OUT/checkpoint.log"
elif [[ -z $CHECKPOINT ]] && checks --dir "$WRITE_DIR"; then
  echo "== checkpoint: the one an earlier run wrote to $WRITE_DIR" | tee "$OUT/checkpoint.log"
  CHECKPOINT=$WRITE_DIR
elif [[ -z $CHECKPOINT ]]; then
  [[ $SIZE == full ]] && WRITE_DEVICE=$DEVICE || WRITE_DEVICE=cpu
  step write_checkpoint "$WRITE_TIMEOUT_S" "$PY" -m lychee_rtc.cli random-checkpoint "$WRITE_DIR" --size "$SIZE" \
    --decision-bias 4 --device "$WRITE_DEVICE" --json "$OUT/write_checkpoint.json"
  CHECKPOINT=$WRITE_DIR
fi
E2E_CKPT=()
if [[ -n $CHECKPOINT ]]; then
  CHECK_ARGS+=(--dir "$CHECKPOINT"); E2E_CKPT=(--checkpoint "$CHECKPOINT")
fi

# Validation from the headers and the memory plan for C1..C8 (and the profile's C4) against an H200.
step check "$SMALL_TIMEOUT_S" "$PY" -m lychee_rtc.cli check "${CHECK_ARGS[@]}" --json "$OUT/check.json"

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

# End to end through the server loading that checkpoint: configs/lychee-c4.yaml, aiortc callers
# speaking the recorded utterances of tests/fixtures/speech; window deadline misses, dropped
# windows, end of utterance to first answer audio.
step e2e "$E2E_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench e2e --config configs/lychee-c4.yaml \
  --sessions "$E2E_SESSIONS" --json "$OUT/e2e.json" "${E2E[@]}" "${E2E_CKPT[@]}"

# Context slides of speaking sessions opened together (their slides in the same window steps): steps
# over 400 ms, each step's slide share against the re-prefill budget, each slide's cost per session
# and per position (docs/lychee_fd.md, "Long conversations"). Two slides: the second's re-prefill runs
# at its steady pace through speaking windows (the first one's mostly through the listening
# fast-forward, about 815 cheap windows).
step bench_slide "$SLIDE_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench slide --size "$SIZE" --device "$DEVICE" \
  --sessions "$SLIDE_SESSIONS" --slides 2 --out "$OUT/bench-slide" "${SLIDE[@]}"

step bench_gpu "$STEP_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench gpu --size "$SIZE" --device "$DEVICE" \
  --windows "$WINDOWS" --concurrency "$CONCURRENCY" --out "$OUT/bench-gpu" "${EXTRA[@]}"

if [[ $DEVICE == cuda ]]; then
  step bench_vocoder "$SMALL_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench vocoder --size full --device cuda \
    --dtype bf16 --concurrency 1 2 4 8 --rounds 30 --json "$OUT/vocoder_bf16.json"
else
  step bench_vocoder "$SMALL_TIMEOUT_S" "$PY" -m lychee_rtc.cli bench vocoder --size tiny --device cpu \
    --concurrency 1 2 --rounds 2 --prompt-seconds 1 --threads 1 --json "$OUT/vocoder.json"
fi

echo "summary: ${SUMMARY[*]} (${SECONDS} s of a ${BUDGET_S} s budget)" | tee "$OUT/summary.txt"
exit $((FAILED > 0))
