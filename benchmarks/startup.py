"""Benchmark: where a simulation's start-up goes, and an experiment suite's wall time per cell.

1. Start-up: one run as `fedskew run` makes it (config and data check, private SuperLink,
   `flwr run`, waiting for the end), `--clients` clients, `--rounds` rounds. A timeline of when each
   process of the run started (read from /proc: SuperLink, the `flwr run` CLI, SuperExec,
   flwr-simulation, Ray's GCS and raylet, the first Ray worker) and, from the ServerApp's own
   records (`summary.json`, `timings.jsonl`), when it started, loaded the test set, discovered the
   nodes, wrote the partition files and began round 1. Start-up = command start to round 1; the
   tail = last round's end to the command's return.
2. Suite: `--cells` cells (FedAvg, one seed each) of the same job run by `fedskew experiment`'s
   `run_suite`; wall time per cell, and per cell minus its rounds.

To measure the code before a change with the same script, point `FEDSKEW_CHECKOUT` at an export of
that commit (`git archive <rev> | tar -x -C /tmp/before`); records it lacks print as "-".

    .venv/bin/python benchmarks/startup.py [--clients 20] [--rounds 2] [--cells 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from _common import ROOT, read_jsonl, tree_pids

from fedskew.run.experiments import load_suite, run_suite
from fedskew.run.launcher import app_defaults, prepare_config, run_simulation

PROCESSES = {  # timeline label -> a piece of the command line
    "SuperLink process": "flower-superlink",
    "`flwr run` CLI": "bin/flwr run",
    "SuperExec": "flower-superexec",
    "flwr-simulation (ServerApp + Ray driver)": "flwr-simulation",
    "fedskew's warm executor (its forks: ServerApp + Ray driver)": "fedskew.run.clientexec",
    "Ray GCS": "gcs_server",
    "Ray raylet": "raylet/raylet",
    "Ray workers (the ClientApp actors)": "default_worker.py",
    "Ray's Python helpers (dashboard, agents, monitors)": "site-packages/ray/",
    "`flwr log` CLI": "bin/flwr log",
    "`flwr ls` CLI": "bin/flwr ls",
}


class ProcessStarts(threading.Thread):
    """Every 0.5 s, each process under this one: its start time (epoch, 10 ms resolution, from
    /proc), command line and CPU seconds so far; a process living less than 0.5 s may be missed."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done, self.started = threading.Event(), {}
        self.cpu: dict[int, list[tuple[float, float]]] = {}  # pid -> (epoch, CPU seconds so far)
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        self.boot, self.ticks = time.time() - uptime, os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.done.wait(0.5):
            for pid in tree_pids(os.getpid(), include_root=False):
                with contextlib.suppress(OSError, IndexError, ValueError):
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    if pid not in self.started:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                        self.started[pid] = (self.boot + int(stat[19]) / self.ticks, cmd)
                    self.cpu.setdefault(pid, []).append((time.time(), (int(stat[11]) + int(stat[12])) / self.ticks))

    def first(self, piece: str) -> float | None:
        return min((t for t, cmd in self.started.values() if piece in cmd), default=None)

    def cpu_by_kind(self, until: float) -> dict[str, float]:
        """CPU seconds used before `until` (epoch) per kind of process (`PROCESSES`, else its command)."""
        kinds: dict[str, float] = {}
        for pid, samples in self.cpu.items():
            before = [c for t, c in samples if t <= until]
            cmd = self.started[pid][1]
            kind = next((label for label, piece in PROCESSES.items() if piece in cmd), "other: " + cmd[-50:])
            kinds[kind] = kinds.get(kind, 0.0) + (before[-1] if before else 0.0)
        return kinds


def one_run(clients: int, rounds: int) -> None:
    """Part 1: one run, its timeline from the command's start."""
    with tempfile.TemporaryDirectory() as out:
        watch = ProcessStarts()
        watch.start()
        t0 = time.time()
        _, subm = prepare_config(ROOT, _job(rounds, out, "startup"), clients)
        t_config = time.time()
        summary = run_simulation(ROOT, subm, clients, [], stream=False)
        t_end = time.time()
        watch.done.set()
        watch.join()
        timings = read_jsonl(Path(out) / "startup" / "timings.jsonl")
    events = {"config and data checked": t_config}
    events.update({label: watch.first(piece) for label, piece in PROCESSES.items()})
    server = summary.get("started_at")
    events["ServerApp main entered"] = server
    if server is not None:
        parts = summary["start_seconds"]
        events["config read, test set loading"] = server + parts["config"]
        discovered = events["config read, test set loading"] + parts["node_discovery_and_test_set"]
        events["nodes discovered and test set loaded"] = discovered
        events["partition files written"] = discovered + parts["partition_files"]
    events["round 1 begins"] = timings[0].get("started-at")
    last = timings[-1].get("started-at")
    events["last round ends"] = None if last is None else last + timings[-1]["seconds"]
    events["command returns"] = t_end
    print(f"start-up of one run: {clients} clients, {rounds} rounds (seconds from the command's start)")
    for label, t in sorted(events.items(), key=lambda kv: kv[1] or float("inf")):
        print(f"  {label:<44} {'-' if t is None else f'{t - t0:7.2f}'}")
    rounds_s = sum(t["seconds"] for t in timings)
    until = events["round 1 begins"] or events["last round ends"] or t_end
    cpu = watch.cpu_by_kind(until)
    print(f"  CPU seconds before round 1, by process ({sum(cpu.values()):.1f} s in all):")
    for kind, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        print(f"    {kind:<58} {seconds:6.2f}")
    if events["round 1 begins"] is not None:
        print(f"  start-up: command start to round 1          {events['round 1 begins'] - t0:7.2f} s")
        print(f"  tail: last round's end to the return        {t_end - events['last round ends']:7.2f} s")
    print(f"  wall - rounds (the measure used before)     {t_end - t0 - rounds_s:7.2f} s")


def suite_cells(clients: int, rounds: int, cells: int) -> None:
    """Part 2: a suite of `cells` cells; wall time per cell."""
    with tempfile.TemporaryDirectory() as out:
        path = Path(out) / "bench.yaml"
        job = {k: v for k, v in _job(rounds, out, "").items() if k not in ("out-dir", "run-name")}
        suite_text = {"name": "bench", "num-supernodes": clients, "seeds": list(range(cells)), "out-dir": out}
        path.write_text(json.dumps({**suite_text, "base": job, "methods": {"fedavg": {}}}))  # JSON is YAML
        suite = load_suite(path, app_defaults(ROOT))
        t0 = time.perf_counter()
        run_suite(suite, ROOT)
        wall = time.perf_counter() - t0
        rounds_s = sum(
            sum(t["seconds"] for t in read_jsonl(suite.folder / c.run_name / "timings.jsonl")) for c in suite.cells
        )
    print(f"suite of {cells} cells ({clients} clients, {rounds} rounds each): wall {wall:.1f} s")
    print(f"  wall per cell                               {wall / cells:7.2f} s")
    print(f"  wall per cell minus its rounds              {(wall - rounds_s) / cells:7.2f} s")


def _job(rounds: int, out: str, name: str) -> dict:
    return {
        "method": "fedavg",
        "num-server-rounds": rounds,
        "checkpoint-every": 0,
        "out-dir": out,
        "run-name": name,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cells", type=int, default=3, help="suite cells (0: skip the suite)")
    ap.add_argument("--quick", action="store_true", help="tiny: 10 clients, 1 round, 2 cells")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.rounds, args.cells = 10, 1, 2
    print(f"checkout {ROOT}")
    one_run(args.clients, args.rounds)
    if args.cells:
        suite_cells(args.clients, args.rounds, args.cells)


if __name__ == "__main__":
    main()
