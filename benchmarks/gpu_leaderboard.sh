#!/bin/bash
# The leaderboard on a GPU in one call of a machine lent for minutes (docs/benchmarks.md, "GPU"); run
# from the checkout's root. Steps:
#  1. sync: the stacked step loop under CUDA's sync debug mode (`benchmarks/batched.py sync`);
#  2. the grid: SUITE's cells (default `suites/leaderboard.yaml`; SEEDS, default each setting's own
#     `seeds:`, METHODS) with `engine=batched device=cuda`,
#     tag `gpu`: the methods the batched engine stacks (`benchmarks/grid.py stacked`) all together,
#     TOGETHER cells a process (`suite_in_process.py --together`), beside the others one process a
#     cell, JOBS at once; both stopped at END seconds after the start, keeping their finished rounds;
#  3. export: the finished cells into results/<suite>-gpu.yaml (the device in each cell), the runs a
#     minute, and every cell against the suite's CPU cells (`benchmarks/grid.py compare`).
# Writes $OUT/leaderboard.log, $OUT/smi.csv (nvidia-smi every 2 s: the GPU's busy fraction and
# memory) and $OUT/leaderboard-gpu.yaml (a copy of the result file); exits non-zero if a step failed.
# DEVICE=cpu SEEDS=0 METHODS=fedavg,scaffold,moon SETS="num-server-rounds=2" END=300 checks the script
# on a machine without a GPU (with OUT=/tmp/x; its result file is moved into $OUT, not kept in results/).
set -u -o pipefail
DEVICE=${DEVICE:-cuda} OUT=${OUT:-outputs/gpu} PY=${PY:-python3} END=${END:-540}
SEEDS=${SEEDS:-} METHODS=${METHODS:-} SETS=${SETS:-} JOBS=${JOBS:-12} TOGETHER=${TOGETHER:-1000}
SUITE=${SUITE:-suites/leaderboard.yaml}; EXPORT=${EXPORT:-$(basename "$SUITE" .yaml)-gpu}
REFERENCE=${REFERENCE:-results/$(basename "$SUITE" .yaml).yaml}  # the suite's CPU cells
mkdir -p "$OUT"
. "$(dirname "$0")/_gpu.sh"
start_smi
status=0
{
  [ "$DEVICE" = cpu ] || $PY benchmarks/batched.py sync --device "$DEVICE" || status=1
  stacked=$($PY benchmarks/grid.py stacked "$SUITE" $METHODS) || status=1
  others=$($PY - "$SUITE" "$stacked" $METHODS <<'PY'
import sys, yaml
suite = yaml.safe_load(open(sys.argv[1]))
chosen = sys.argv[3].split(",") if len(sys.argv) > 3 else list(suite["methods"])
print(",".join(m for m in chosen if m not in sys.argv[2].split(",")))
PY
)
  echo "stacked together: ${stacked:-none}; one process a cell: ${others:-none}"
  common=(${SEEDS:+--seeds "$SEEDS"} --tag gpu --every 60 --set engine=batched device="$DEVICE" $SETS)
  t0=$SECONDS
  left=$((END - 60 - SECONDS))  # a minute for the export and the comparison
  pids=()
  if [ -n "$stacked" ]; then
    $PY benchmarks/suite_in_process.py "$SUITE" --methods "$stacked" --together "$TOGETHER" --jobs 1 \
      --deadline "$left" "${common[@]}" > "$OUT/stacked.log" 2>&1 &
    pids+=($!)
  fi
  if [ -n "$others" ]; then
    $PY benchmarks/suite_in_process.py "$SUITE" --methods "$others" --jobs "$JOBS" \
      --deadline "$left" "${common[@]}" > "$OUT/per-cell.log" 2>&1 &
    pids+=($!)
  fi
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done  # our groups only, not the sampler
  wall=$((SECONDS - t0))
  tail -n 40 "$OUT/stacked.log" "$OUT/per-cell.log" 2>/dev/null
  $PY benchmarks/suite_in_process.py "$SUITE" ${SEEDS:+--seeds "$SEEDS"} --tag gpu --export "$EXPORT" \
    --set engine=batched device="$DEVICE" $SETS || status=1
  cp "results/$EXPORT.yaml" "$OUT/" 2>/dev/null
  [ "$DEVICE" != cpu ] || mv "results/$EXPORT.yaml" "$OUT/$EXPORT.yaml.check"  # a check's cells: not results
  result="results/$EXPORT.yaml"; [ -f "$result" ] || result="$OUT/$EXPORT.yaml.check"
  $PY - "$result" "$wall" <<'PY'
import sys
from fedskew.reports.resultfile import load_results
cells = load_results(sys.argv[1]).cells
runs = sum(len(c.seeds) for c in cells)
print(f"{runs} runs ({len(cells)} cells) finished in {sys.argv[2]} s: {60 * runs / max(int(sys.argv[2]), 1):.1f} runs a minute")
PY
  if [ -f "$REFERENCE" ]; then $PY benchmarks/grid.py compare "$result" "$REFERENCE" || status=1; fi
  exit $status
} 2>&1 | tee "$OUT/leaderboard.log"
status=$?
stop_smi
exit $status
