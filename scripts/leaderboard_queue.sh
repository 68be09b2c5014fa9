#!/usr/bin/env bash
# The leaderboard's background queue on this machine (2 cores): the suite's cells, one seed after the
# other (so that every method has the same seeds at any moment: paired gains), two cells at once, in
# process (the same metrics.jsonl as `flwr run`). Finished cells are skipped, stopped ones resumed.
#   METHODS=fedavg,fedrs SEEDS="3 4" bash scripts/leaderboard_queue.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SUITE=${SUITE:-suites/leaderboard.yaml}
SEEDS=${SEEDS:-"0 1 2 3 4 5 6 7 8 9"}
JOBS=${JOBS:-2}
for seed in $SEEDS; do
    .venv/bin/python benchmarks/suite_in_process.py "$SUITE" --into-suite --jobs "$JOBS" --every 600 \
        --seeds "$seed" ${METHODS:+--methods "$METHODS"} ${PARTITIONS:+--partitions "$PARTITIONS"}
done
