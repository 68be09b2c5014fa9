#!/bin/bash
# The batched engine on a GPU, in one call of a machine lent for minutes (docs/benchmarks.md,
# "Batched engine"); run from the checkout's root. Three steps, each `benchmarks/batched.py`:
#  1. sync: the stacked step loop under CUDA's sync debug mode (no host synchronisation inside it);
#  2. speed, LeNet on Fashion-MNIST, 100 clients, 10 and 50 a round (`lenet-10`, `lenet-50`): clients
#     and SGD steps a second, the GPU's busy fraction, for the batched engine, today's per-client
#     path in one process, and `flwr run` with 1 and the default number of Ray actors (skipped, and
#     said, where Ray is not installed) on the same card, one engine after the other;
#  3. speed, pfl-research's CIFAR-10 benchmark shape on Fashion-MNIST (`pfl`: 1,200 clients of 50
#     images, 50 a round, 1 epoch at batch 10, `pfl-cnn`): rounds a second of the same engines.
# Steps 2 and 3 stop at $END seconds after the start (default 540, inside a 600 s command); a
# scenario's lines are printed as soon as it is done, so a stopped run keeps the finished ones.
# Writes $OUT/batched.log and $OUT/smi.csv (nvidia-smi every 2 s); exits non-zero if a step failed.
# PY=.venv/bin/python DEVICE=cpu ROUNDS=2 SCENARIOS=quick ENGINES=batched,per-client checks the
# script on a machine without a GPU.
set -u -o pipefail
DEVICE=${DEVICE:-cuda} ROUNDS=${ROUNDS:-4} OUT=${OUT:-outputs/gpu} PY=${PY:-python3} END=${END:-540}
SCENARIOS=${SCENARIOS:-lenet-10,lenet-50,pfl} ENGINES=${ENGINES:-batched,per-client,flower:1,flower:default}
mkdir -p "$OUT"
. "$(dirname "$0")/_gpu.sh"
start_smi
status=0
{
  $PY benchmarks/batched.py sync --device "$DEVICE" || status=1
  for scenario in ${SCENARIOS//,/ }; do
    left=$((END - SECONDS))
    if [ "$left" -le 10 ]; then echo "$scenario: not run, $END s reached"; status=1; continue; fi
    timeout "$left" $PY benchmarks/batched.py speed --device "$DEVICE" --rounds "$ROUNDS" --scenarios "$scenario" \
      --engines "$ENGINES" || { echo "$scenario: stopped or failed (exit $?)"; status=1; }
  done
  exit $status
} 2>&1 | tee "$OUT/batched.log"
status=$?
stop_smi
exit $status
