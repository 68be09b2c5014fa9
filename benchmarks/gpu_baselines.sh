#!/bin/bash
# The papers' baselines on a GPU machine lent for minutes (docs/benchmarks.md, "GPU: the baselines");
# run from the checkout's root. Three steps at once, each its own processes on the one GPU:
#  1. fedrs: FedRS Table 1's other methods on C10-100-2 at 150 rounds (`suites/paper-fedrs.yaml`,
#     `c10-100-2-r150`: SCAFFOLD, SCAFFOLD + restricted softmax, FedAwS; 3 seeds), the 9 cells at once
#     (`benchmarks/suite_in_process.py`), stopped at $END s; a cell stopped part-way keeps its
#     checkpoint (every 50 rounds), which travels back in runs.tgz;
#  2. paths: every baseline added after the seed methods through its CUDA path and its CPU path
#     (`benchmarks/cuda_paths.py`, LeNet, 5 clients of 2 classes, 2 rounds): finite metrics, wall,
#     peak GPU memory;
#  3. leaderboard: `suites/leaderboard.yaml` with the papers' network (`model=resnet18`), every
#     method on the 2-classes setting, seed 0, 2 rounds of 1 local epoch, 4 cells at once: each
#     method's ResNet-18 path and the seconds a round costs.
# $STEPS picks among them (default "fedrs paths leaderboard"); $LB_SET adds run-config overrides to
# step 3 and $LB_TAG names its folder (the second call: `state-max-mb=128 fedgen-alpha=1.0
# fedgen-beta=1.0` for FedDC's 85 MB client state and FedGen's divergence at alpha = beta = 10).
# $CELLS adds paper cells (see below; the second call: FedMMD on FedRS's protocol, CReFF on MuPFL's).
# Writes $OUT/{fedrs,paths,leaderboard}.log, $OUT/smi.csv and $OUT/runs.tgz; exits non-zero if a
# step failed. PY=.venv/bin/python DEVICE=cpu END=120 FEDRS_ROUNDS=2 METHODS=fedavg,scaffold checks
# LEADERBOARD_METHODS=fedavg LB_MODEL=lenet the script on a machine without a GPU.
set -u
DEVICE=${DEVICE:-cuda} END=${END:-450} OUT=${OUT:-outputs/gpu} PY=${PY:-python3}
FEDRS_ROUNDS=${FEDRS_ROUNDS:-150} METHODS=${METHODS:-all} STEPS=${STEPS:-fedrs paths leaderboard}
LB_TAG=${LB_TAG:-resnet18} LB_SET=${LB_SET:-}
B=benchmarks/suite_in_process.py
mkdir -p "$OUT" outputs/gpu
. "$(dirname "$0")/_gpu.sh"
start_smi
# the seed methods' CUDA paths were measured by an earlier lending (docs/benchmarks.md, "GPU")
seeds="fedavg fedprox fedrs fedmr mupfl map fedgela"
if [ "$METHODS" = all ]; then
  METHODS=$($PY -c "from fedskew.registry import METHODS; print(','.join(m for m in METHODS if m not in '$seeds'.split()))")
fi
step() { [[ " $STEPS " == *" $1 "* ]]; }
status=0 FEDRS= PATHS=
if step fedrs; then
  $PY $B suites/paper-fedrs.yaml --partitions c10-100-2-r150 --methods scaffold,scaffold-rs-0.5,fedaws --seeds 0,1,2 \
    --jobs 9 --deadline "$END" --set device="$DEVICE" num-server-rounds="$FEDRS_ROUNDS" \
    --tag gpu --out-dir outputs/gpu --every 60 > "$OUT/fedrs.log" 2>&1 &
  FEDRS=$!
fi
# $CELLS: more paper cells on the GPU, each "suite:partitions:methods" (3 seeds, all at once, tag gpu)
for spec in ${CELLS:-}; do
  IFS=: read -r suite parts methods <<< "$spec"
  $PY $B "suites/$suite.yaml" --partitions "$parts" --methods "$methods" --seeds 0,1,2 --jobs 16 --deadline "$END" \
    --set device="$DEVICE" --tag gpu --out-dir outputs/gpu --every 60 > "$OUT/$suite.log" 2>&1 &
  EXTRA="${EXTRA:-} $!"
done
if step paths; then
  timeout $((END + 30)) $PY benchmarks/cuda_paths.py --devices "cpu,$DEVICE" --models lenet --methods "$METHODS" \
    > "$OUT/paths.log" 2>&1 &
  PATHS=$!
fi
if step leaderboard; then
  # shellcheck disable=SC2086  # LB_SET: several k=v words
  $PY $B suites/leaderboard.yaml --partitions c2 --seeds 0 --methods "${LEADERBOARD_METHODS:-$METHODS,${seeds// /,}}" \
    --jobs 4 --deadline "$END" --set model="${LB_MODEL:-resnet18}" device="$DEVICE" num-server-rounds=2 local-epochs=1 \
    checkpoint-every=0 $LB_SET --tag "$LB_TAG" --out-dir outputs/gpu --every 60 > "$OUT/leaderboard.log" 2>&1 || status=1
fi
[ -n "$PATHS" ] && { wait "$PATHS" || status=1; }
[ -n "$FEDRS" ] && { wait "$FEDRS" || status=1; }
for pid in ${EXTRA:-}; do wait "$pid" || status=1; done
stop_smi
tail -n 40 "$OUT"/*.log
# the FedRS cells' metrics and checkpoints travel back (a cell stopped part-way resumes from it)
tar czf "$OUT/runs.tgz" --exclude='*.png' --exclude='model.pt' --ignore-failed-read outputs/gpu/paper-*-gpu "outputs/gpu/leaderboard-$LB_TAG"
ls -la "$OUT"
exit $status
