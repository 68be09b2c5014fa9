#!/usr/bin/env bash
# The project's background queue on a CPU machine (2 cores): the suites that the leaderboard and
# the peers' tables need, in their order, one seed after the other, two cells at once, in process
# (`benchmarks/suite_in_process.py --into-suite`: the same metrics.jsonl as `flwr run`). Each cell is
# exported into results/<suite>.yaml as soon as it finishes (`--export-each`), which keeps the per-seed
# values: a later session (another machine, no outputs/) skips every seed recorded there with the
# same config and method revision ('recorded') and adds its own seeds to them on export. So the queue
# resumes across sessions from the committed result files: commit them before a session ends.
#   bash scripts/queue.sh                      # everything, in order
#   QUEUE="leaderboard:0-16" bash scripts/queue.sh   # a seed no setting runs is refused
#   QUEUE="rerun/paper-mupfl,paper-map:0-2" bash scripts/queue.sh
# An item `rerun/<suites>:<seeds>` runs, suite by suite, only the cells the pages need again
# (`scripts/rerun_cells.py`: those recorded under an earlier config, and those a claim's gain needs
# for its paired interval), two cells with all their seeds at a time, each pair exported when done.
# An item `each/<suite>:<seeds>` runs a seed's pending cells (`rerun_cells.py --pending`) in one call,
# two at a time, each cell exported as soon as it finishes (`--export-each`): for the suites whose
# cells take an hour, so that a session's machine that goes away mid-seed loses at most the two cells
# it was running (where outputs/ stays, only the rounds since their last checkpoint: a stopped cell
# resumes, clients' states included), and no core waits for a slower partner. `each/<suite>@A,B:<seeds>`
# runs only methods A and B (`rerun_cells.py --methods`): a suite too long for one machine runs its key
# methods at every seed first, so that what finishes holds paired seeds.
# Order: the leaderboard's first 10 seeds at 40 rounds (the floor its page holds to); niid_bench (the
# first peer's protocol); the leaderboard's seeds 10-16 (dir01 runs 13, c2 17: the suite's `seeds:`,
# what its measured spread asks; about 6 h here, so before the day-long suites); MuPFL's, MAP's and
# FedRS's 41 cells the pages need again (about 9 h here, from the run times the notes record); the
# rounds the leaderboard's leading methods need to converge (`suites/leaderboard-long.yaml`, read by
# `benchmarks/convergence.py`); PFLlib (the second peer, about 25 h here); FedGELA's and FedMR's 57
# cells the pages need again (about a day here); the leaderboard at a converged budget
# (`suites/leaderboard-converged.yaml`, 500 rounds, about 80 h here: a GPU's job), FedAvg and the four
# methods whose verdicts the convergence runs found to move with the budget (FedRS, FedLC, FedRoD,
# CReFF) at all 5 seeds first (75 cells, about 19 h here), then the rest; last, the papers' suites
# whole, cheapest first (a cell recorded without per-seed values, or under an earlier config, is not
# skipped, so these run exactly those: the reference rows beside the claims).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python} FEDSKEW=${FEDSKEW:-.venv/bin/fedskew}
JOBS=${JOBS:-2}
PAPERS="fmnist-skew:0-2 fmnist-pcdd:0-2 fmnist-map:0-2 fmnist-map50:0-2 paper-fedmr:0-2 paper-mupfl:0-2"
PAPERS+=" paper-fedgela:0-2 paper-map:0-2 paper-fedrs:0-2"
EARLY="rerun/paper-mupfl,paper-map,paper-fedrs:0-2" LATE="rerun/paper-fedgela,paper-fedmr:0-2"
ORDER="leaderboard:0-9 each/peer-niid-bench:0-2 leaderboard:10-16 $EARLY each/leaderboard-long:0-0"
ORDER+=" each/peer-pfllib:0-2 $LATE"
CONVERGED="each/leaderboard-converged@fedavg,fedrs,fedlc,fedrod,creff:0-4 each/leaderboard-converged:0-4"
QUEUE=${QUEUE:-"$ORDER $CONVERGED $PAPERS"}
# Each line `<suite> <partition/method>,...` on stdin: run those cells for the seeds $1 (two at once,
# further options such as --rerun-changed after it), then export them.
run_batches() {
    local seeds=$1 name cells
    shift
    while read -r name cells; do
        echo "== $name, cells $cells, seeds $seeds: $(date -u +%H:%M)"
        $PY benchmarks/suite_in_process.py "suites/$name.yaml" --into-suite --jobs "$JOBS" --every 600 \
            --seeds "$seeds" --cells "$cells" "$@" || true
        $FEDSKEW experiment "suites/$name.yaml" --export --seeds "$seeds" --cells "$cells" || true
    done
}
for item in $QUEUE; do
    suite=${item%%:*} range=${item#*:}
    if [[ $suite == rerun/* ]]; then
        seeds=$(seq -s, "${range%-*}" "${range#*-}")
        $PY scripts/rerun_cells.py --suites "${suite#rerun/}" --group "$JOBS" | run_batches "$seeds" --rerun-changed \
            || echo "== $item: its cells could not be listed, skipped"
        continue
    fi
    if [[ $suite == each/* ]]; then
        name=${suite#each/} methods=
        [[ $name == *@* ]] && methods=${name#*@} name=${name%%@*}
        for seed in $(seq "${range%-*}" "${range#*-}"); do
            $PY scripts/rerun_cells.py --suites "$name" --pending "$seed" --group 0 ${methods:+--methods "$methods"} \
                ${RERUN:+--rerun-changed} | run_batches "$seed" --export-each ${RERUN:+--rerun-changed} \
                || echo "== $item, seed $seed: its cells could not be listed, skipped"
        done
        continue
    fi
    for seed in $(seq "${range%-*}" "${range#*-}"); do
        echo "== $suite, seed $seed: $(date -u +%H:%M)"
        $PY benchmarks/suite_in_process.py "suites/$suite.yaml" --into-suite --jobs "$JOBS" --every 600 \
            --seeds "$seed" ${METHODS:+--methods "$METHODS"} ${RERUN:+--rerun-changed} --export-each || true
        $FEDSKEW experiment "suites/$suite.yaml" --export || true
    done
done
