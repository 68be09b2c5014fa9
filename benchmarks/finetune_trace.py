"""Diagnostic (not a timing): one client's last-round later phases of a finished run, step by step.

A personalized model that is the last iterate of a local phase (FedBABU's fine-tuning, FedRep's head
epochs, Ditto's personal steps: `BaseTrainer.later_phases`) can end on a bad step. This replays the
run in this process from its `config.json` (the in-process engine, as the suites run it: the same
seed gives the same run, which the script checks against the run's own last `metrics.jsonl` row) and,
in the last round only, instruments the phases of one client (`--partition`): its local test
accuracy before every `--every`-th step and before each of the last `--tail` steps, each step's batch
labels and loss, and the accuracy and confusion matrix after the phase. Evaluating between steps
draws nothing from the round's generator, so the traced run is the run.

Writes `<out>/trace.jsonl` (a row a traced step, one a phase end) and `<out>/summary.json`, prints
the summary. The replay takes as long as the run (a 50-round PFLlib cell: about 45 minutes here).

    .venv/bin/python benchmarks/finetune_trace.py outputs/suites/peer-pfllib/pat2--fedbabu--s1 \\
        --partition 7 --out outputs/finetune-trace [--summary results/peers/<name>.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

import torch
from _common import in_process_setup

from fedskew.client_app.base import BaseTrainer, Phase
from fedskew.config import ConfigError, validate
from fedskew.reports.resultfile import read_rounds
from fedskew.server_app.results import read_saved
from fedskew.training import confusion
from tests.harness import app_defaults, run_in_process

ACCURACIES = ("global-accuracy", "personalized-accuracy", "personalized-pooled-accuracy")


def traced_loss(trainer: BaseTrainer, number: int, phase: Phase, every: int, tail: int, log: Any) -> Any:
    """`phase.loss`, logging to `log` before the step: the client's local test accuracy (every
    `every`-th step and each of the last `tail`), the batch labels and the loss; `.steps` counts."""

    def loss(m: Any, x: Any, y: Any) -> Any:
        row: dict[str, Any] = {"phase": number, "step": loss.steps}
        if loss.steps % every == 0 or loss.steps >= phase.steps - tail:
            row["accuracy"] = trainer.evaluate_local(m)[1]
            m.train()  # evaluate_local leaves the model in eval mode
        value = phase.loss(m, x, y)
        descended = value if isinstance(value, torch.Tensor) else value[0]  # (loss, reported): as train_steps
        row |= {"labels": y.tolist(), "loss": float(descended.detach())}
        if "accuracy" in row:
            log.write(json.dumps(row) + "\n")
        loss.steps += 1
        return value

    loss.steps = 0
    return loss


def instrument(partition: int, last_round: int, every: int, tail: int, log: Any) -> None:
    """Wrap `BaseTrainer.run_later_phases` so that client `partition`'s phases of `last_round` log
    their steps (`traced_loss`) and their end (accuracy, test loss, confusion) to `log`."""
    plain = BaseTrainer.run_later_phases

    def traced(self: BaseTrainer, model: Any, stats: dict[str, float]) -> dict[str, float]:
        if self.ctx.partition_id != partition or self.ctx.server_round != last_round:
            return plain(self, model, stats)
        for number, phase in enumerate(self.later_phases(model)):
            loss = traced_loss(self, number, phase, every, tail, log)
            tuned = self.run_steps(phase.model, phase.optimizer, phase.steps, loss)
            # evaluate_local's pass, keeping its confusion matrix
            x, y = self.data.x_test, self.data.y_test
            test_loss, cm = confusion(phase.model, x, y, self.cfg["eval-batch-size"], self.device)
            end = {"phase": number, "end": True, "steps": loss.steps, "accuracy": int(cm.trace()) / int(cm.sum())}
            log.write(json.dumps({**end, "test-loss": test_loss, "confusion": cm.tolist(), "phase-metrics": tuned}))
            log.write("\n")
            log.flush()
            stats = phase.end(stats, tuned)
        return stats

    BaseTrainer.run_later_phases = traced


def summarise(rows: list[dict[str, Any]], run_last: dict[str, Any], replay_last: dict[str, Any]) -> dict[str, Any]:
    """The trace's verdict: per phase, the accuracy before its last step and after it, the last
    batch, and the traced accuracies' min and median; whether the replay reproduced the run."""
    phases = []
    for end in (r for r in rows if r.get("end")):
        steps = [r for r in rows if r["phase"] == end["phase"] and not r.get("end")]
        last = steps[-1] if steps else {}
        traced = [r["accuracy"] for r in steps if r["step"] > 0]
        phases.append(
            {
                "phase": end["phase"],
                "steps": end["steps"],
                "accuracy-at-start": steps[0]["accuracy"] if steps else None,
                "accuracy-before-last-step": last.get("accuracy"),
                "accuracy-after": end["accuracy"],
                "last-batch": {
                    "size": len(last.get("labels", [])),
                    "labels": last.get("labels"),
                    "loss": last.get("loss"),
                },
                "traced-accuracy-min": min(traced, default=None),
                "traced-accuracy-median": statistics.median(traced) if traced else None,
                "confusion-after": {  # true class -> {predicted class: count}, the nonzero cells
                    str(t): {str(q): n for q, n in enumerate(row) if n}
                    for t, row in enumerate(end["confusion"])
                    if any(row)
                },
            }
        )
    same = {k: (run_last.get(k), replay_last.get(k)) for k in ACCURACIES if k in run_last}
    reproduced = bool(same) and all(a == b for a, b in same.values())  # no accuracy to compare: not shown
    return {"reproduced": reproduced, "last-round": same, "phases": phases}


def compact(text: str) -> str:
    """Indented JSON with each innermost list or object on one line."""
    return re.sub(r"([\[{])([^\[\]{}]*)([\]}])", lambda m: m[1] + " ".join(m[2].split()) + m[3], text)


def load_run(run: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """A finished run's config, last metrics row and node count (a node a partition: as the suites
    save it, or, num-partitions 0, its partition.json's clients); SystemExit naming the file and the
    fault for anything else (files from disk are not trusted)."""
    cfg = read_saved(run)
    if cfg is None:
        raise SystemExit(f"{run}/config.json: missing, not JSON or not an object; a finished run's folder is needed")
    if cfg.get("engine", "flower") != "flower":
        raise SystemExit(f"{run}: engine={cfg['engine']!r}; the trace follows the per-client path ('flower')")
    try:
        cfg = validate({**app_defaults(), **cfg})
        rows = read_rounds(run / "metrics.jsonl")
    except ConfigError as e:
        raise SystemExit(f"{run}: {e}") from None
    if len(rows) != cfg["num-server-rounds"]:
        raise SystemExit(f"{run}: {len(rows)} rounds in metrics.jsonl, not {cfg['num-server-rounds']}")
    if cfg["num-partitions"]:
        return cfg, rows[-1], cfg["num-partitions"]
    try:
        train = json.loads((run / "partition.json").read_text())["train"]
        return cfg, rows[-1], len(train)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise SystemExit(f"{run}/partition.json: no list of clients under 'train' ({e!r})") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished run's folder (config.json, metrics.jsonl)")
    p.add_argument("--partition", type=int, required=True, help="the client (partition id) to trace")
    p.add_argument("--out", type=Path, required=True, help="a folder for the replay and the trace")
    p.add_argument("--every", type=int, default=25, help="trace the accuracy every this many steps")
    p.add_argument("--tail", type=int, default=50, help="and before each of the phase's last this many")
    p.add_argument("--summary", type=Path, help="also write the summary here")
    args = p.parse_args()
    in_process_setup()
    cfg, run_last, nodes = load_run(args.run)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "trace.jsonl", "w") as log:
        instrument(args.partition, cfg["num-server-rounds"], args.every, args.tail, log)
        replay = {**cfg, "out-dir": str(args.out), "run-name": "replay", "overwrite": True, "resume": False}
        run_in_process(replay, nodes, keep_node_states=True)
    rows = [json.loads(line) for line in (args.out / "trace.jsonl").read_text().splitlines()]
    replay_rows = read_rounds(args.out / "replay" / "metrics.jsonl")
    summary = {"run": str(args.run), "partition": args.partition}
    summary |= summarise(rows, run_last, replay_rows[-1])
    text = compact(json.dumps(summary, indent=1)) + "\n"
    (args.out / "summary.json").write_text(text)
    if args.summary:
        args.summary.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
