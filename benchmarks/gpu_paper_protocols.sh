#!/bin/bash
# The papers' own protocols on a GPU machine lent for minutes (docs/notes/fedrs.md, "FedRS with its TFCNN
# on a GPU" and "FedGELA ... full participation at the paper's 50 rounds" in docs/notes/fedgela.md; docs/benchmarks.md, "GPU");
# run from the checkout's root. $STEPS picks among five steps (default "fedmr fedrs", the second
# lending's), each `benchmarks/suite_in_process.py`:
#  1. FedMR's ResNet-18 on P5C2 (FedAvg, FedMR), 2 rounds of 1 local epoch each, one after the
#     other: the seconds a round costs (the paper's round is 10 epochs) and so what a 100-round run
#     costs;
#  2. FedRS's TFCNN on C10-100-2 (FedAvg, alpha 0.9, alpha 0.5; 3 seeds): the 9 cells at once, up to
#     300 rounds, stopped at $END seconds after the start; each keeps the rounds it finished;
#  3. fedgela: FedGELA's full participation at Dirichlet 0.1 (`full-a01`: 10 clients, all of them
#     every round, 10 local epochs) at the paper's 50 rounds, FedAvg and FedGELA, 3 seeds, the 6
#     cells at once (LeNet, as on the CPU), stopped at $END; a cell stopped part-way keeps its
#     checkpoint (every 5 rounds), which travels back in runs-<partition>.tgz, so the CPU can finish it;
#  4. fedgela-ew: FedGELA's E_W in the paper's range (1e3 to 1e6, then 1e7) on the same cell, 3 seeds,
#     50 rounds, on the batched engine (`engine=batched`: the 10 clients as one stacked LeNet, uploads
#     equal to the per-client path's, `tests/test_batched.py`), $EW_JOBS cells at once, stopped at $END;
#  5. mupfl-tau: MuPFL's classifier fine-tune at tau = 0 and 10 epochs with the extractor start
#     (`suites/paper-mupfl.yaml`, IF 10 x Dir 0.5, `mupfl-tau0` and `mupfl-extractor-tau10`, 3 seeds),
#     the suite's own cells (`--into-suite`: its folder, its config, device auto), all at once, stopped
#     at $END; each keeps its checkpoint (every 5 rounds), so the CPU resumes it there. $MUPFL_CELLS
#     picks other cells: space-separated PARTITIONS:METHODS (the second call: "if10-a1,if100-a05,if100-a1:
#     mupfl-extractor if10-a05:mupfl-extractor-no-acmu,mupfl-extractor-no-pkcf", today's defaults).
# Writes outputs/gpu/ and, where $OUT is set, $OUT/<step>.log (mupfl-tau: mupfl-<partition>.log), $OUT/smi.csv
# and $OUT/runs-<partition>.tgz.
# PY=.venv/bin/python DEVICE=cpu END=200 ROUNDS=2 FEDGELA_ROUNDS=2 checks the script on a machine without a GPU.
set -u
DEVICE=${DEVICE:-cuda} END=${END:-530} ROUNDS=${ROUNDS:-300} OUT=${OUT:-outputs/gpu}
PY=${PY:-python3} B=benchmarks/suite_in_process.py STEPS=${STEPS:-fedmr fedrs}
mkdir -p "$OUT" outputs/gpu
. "$(dirname "$0")/_gpu.sh"
start_smi
step() { [[ " $STEPS " == *" $1 "* ]]; }
pack() {  # the cells of each partition named, one archive each (a file that comes back holds at most 16 MiB)
  for part in "$@"; do
    tar czf "$OUT/runs-$part.tgz" --exclude='*.png' --exclude='model.pt' outputs/gpu/paper-*/"$part"--* \
      outputs/suites/paper-*/"$part"--* 2>/dev/null
  done
}
step fedmr && $PY $B suites/paper-fedmr.yaml --partitions p5c2 --methods fedavg,fedmr --seeds 0 --jobs 1 --deadline 120 \
  --set model=resnet18 device="$DEVICE" num-server-rounds=2 local-epochs=1 checkpoint-every=0 \
  --tag resnet18-e1 --out-dir outputs/gpu --every 20 2>&1 | tee "$OUT/fedmr.log"
step fedrs && $PY $B suites/paper-fedrs.yaml --partitions c10-100-2 --methods fedavg,fedrs-0.9,fedrs-0.5 --seeds 0,1,2 \
  --jobs 9 --deadline $((END - SECONDS)) --set model=tfcnn device="$DEVICE" num-server-rounds="$ROUNDS" \
  --tag tfcnn --out-dir outputs/gpu --every 30 2>&1 | tee "$OUT/fedrs.log"
step fedgela && $PY $B suites/paper-fedgela.yaml --partitions full-a01 --methods fedavg,fedgela --seeds 0,1,2 \
  --jobs 6 --deadline $((END - SECONDS)) --set device="$DEVICE" num-server-rounds="${FEDGELA_ROUNDS:-50}" \
  --tag gpu --out-dir outputs/gpu --every 30 2>&1 | tee "$OUT/fedgela.log"
step fedgela-ew && $PY $B suites/paper-fedgela.yaml --partitions full-a01 \
  --methods fedgela-ew1e3,fedgela-ew1e4,fedgela-ew1e5,fedgela-ew1e6,fedgela-ew1e7 --seeds 0,1,2 \
  --jobs "${EW_JOBS:-12}" --deadline $((END - SECONDS)) --set device="$DEVICE" engine=batched \
  num-server-rounds="${FEDGELA_ROUNDS:-50}" --tag batched-gpu --out-dir outputs/gpu --every 30 2>&1 | tee "$OUT/fedgela-ew.log"
if step mupfl-tau; then  # each PARTITIONS:METHODS of $MUPFL_CELLS its own call, all its cells at once
  groups=()
  for c in ${MUPFL_CELLS:-if10-a05:mupfl-tau0,mupfl-extractor-tau10}; do
    IFS=, read -ra m <<< "${c#*:}"; IFS=, read -ra p <<< "${c%%:*}"
    (  # archived as soon as its cells end, each log named in the letters a returned file may have
      $PY $B suites/paper-mupfl.yaml --into-suite --partitions "${c%%:*}" --methods "${c#*:}" --seeds 0,1,2 \
        --jobs $((3 * ${#m[@]} * ${#p[@]})) --deadline $((END - SECONDS)) --every 30 > "$OUT/mupfl-${p[0]}.log" 2>&1
      pack "${p[@]}"
    ) &
    groups+=($!)
  done
  wait "${groups[@]}"  # these alone: a bare `wait` waits for the nvidia-smi sampler too, which never ends
  cat "$OUT"/mupfl-*.log
fi
stop_smi
# the cells' checkpoints travel back (a cell stopped part-way resumes from it): one archive a partition
# (a file that comes back holds at most 16 MiB; a MuPFL checkpoint is 1 MB)
pack $(ls -d outputs/gpu/paper-*/* outputs/suites/paper-*/* 2>/dev/null | sed 's|.*/||; s|--.*||' | sort -u)
ls -la "$OUT"
