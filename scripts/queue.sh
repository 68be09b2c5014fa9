#!/usr/bin/env bash
# The project's background queue on a CPU machine (2 cores): the suites that the leaderboard and
# the peers' tables need, in their order, one seed after the other, two cells at once, in process
# (`benchmarks/suite_in_process.py --into-suite`: the same metrics.jsonl as `flwr run`). After each
# seed the suite's finished cells are exported into results/<suite>.yaml, which keeps their per-seed
# values: a later session (another machine, no outputs/) skips every seed recorded there with the
# same config and method revision ('recorded') and adds its own seeds to them on export. So the queue
# resumes across sessions from the committed result files: commit them before a session ends.
#   bash scripts/queue.sh                      # everything, in order
#   QUEUE="leaderboard:0-16" bash scripts/queue.sh   # a seed no setting runs is refused
# Order: the leaderboard's first 10 seeds at 40 rounds (the floor its page holds to); niid_bench (the
# first peer's protocol); the leaderboard's seeds 10-16 (dir01 runs 13, c2 17: the suite's `seeds:`,
# what its measured spread asks; about 6 h here, so before the day-long suites); the rounds the
# leaderboard's leading methods need to converge (`suites/leaderboard-long.yaml`, read by
# `benchmarks/convergence.py`); PFLlib (the second peer, about 20 h here); the papers' suites again,
# cheapest first, for the claims' paired intervals (a cell recorded without per-seed values, or under
# an earlier config, is not skipped, so these run exactly those); the leaderboard at a converged
# budget (`suites/leaderboard-converged.yaml`, about 32 h here: a GPU's job).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python} FEDSKEW=${FEDSKEW:-.venv/bin/fedskew}
JOBS=${JOBS:-2}
PAPERS="fmnist-skew:0-2 fmnist-pcdd:0-2 fmnist-map:0-2 fmnist-map50:0-2 paper-fedmr:0-2 paper-mupfl:0-2"
PAPERS+=" paper-fedgela:0-2 paper-map:0-2 paper-fedrs:0-2"
QUEUE=${QUEUE:-"leaderboard:0-9 peer-niid-bench:0-2 leaderboard:10-16 leaderboard-long:0-0 peer-pfllib:0-2 $PAPERS leaderboard-converged:0-4"}
for item in $QUEUE; do
    suite=${item%%:*} range=${item#*:}
    for seed in $(seq "${range%-*}" "${range#*-}"); do
        echo "== $suite, seed $seed: $(date -u +%H:%M)"
        $PY benchmarks/suite_in_process.py "suites/$suite.yaml" --into-suite --jobs "$JOBS" --every 600 \
            --seeds "$seed" ${METHODS:+--methods "$METHODS"} ${RERUN:+--rerun-changed} || true
        $FEDSKEW experiment "suites/$suite.yaml" --export || true
    done
done
