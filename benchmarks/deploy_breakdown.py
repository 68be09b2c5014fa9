"""Benchmark: the time of one train message in deployment, broken into process start, imports,
data load and training.

In deployment a SuperNode starts a fresh `flwr-clientapp` process for every message. This script
runs what that process does in fresh interpreters (`benchmarks/_one_message.py`): interpreter
start and exit, `import torch`, `import flwr`, `import fedskew.client_app.app` (and the method's
trainer), the node's data load, and one round of local training through the real ClientApp. The
data load is measured twice: the node's first message (partition computed from the whole data set
and cached as .npz, `fedskew.data.node`) and every later one (slice read from the cache). A bare
`python -c pass` is timed for reference.

Then (unless `--no-e2e`) real messages end to end, for each of `--modes`: a local insecure
SuperLink and one SuperNode started by `deploy/supernode.sh --insecure`, `--rounds` rounds of
FedAvg, one message each (round 1 fills the node's data cache). `cold` is Flower's default
isolation (`--cold`: a fresh `flwr-clientapp` process per message), `warm` the default of
`supernode.sh` (`--isolation process` with `fedskew.run.clientexec`, which forks a process that has
torch and Flower imported). Each message's send-to-reply time (as the ServerApp sees it) is split
with the SuperNode's log lines (stamped as they arrive) and the ClientApp process's lifetime
(watched every 10 ms): the SuperNode's idle poll of the SuperLink, the message download, the task
pickup and process start, the ClientApp process until its reply reaches the SuperNode, the reply
upload, and the ServerApp's poll. The overhead is the send-to-reply time minus the ClientApp call
measured in process.

    .venv/bin/python benchmarks/deploy_breakdown.py [--partitions 20] [--repeats 3] [--rounds 4] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from _common import ROOT, median, private_cache, read_jsonl, tree_pids

from fedskew.run.launcher import PrivateSuperLink, flower_env, free_port, submit

CHILD = Path(__file__).resolve().parent / "_one_message.py"
PARTS = ("import torch", "import flwr", "import ClientApp", "data load", "train (ClientApp call)")


def timed_run(cmd: list[str]) -> tuple[float, float, str]:
    """(epoch seconds before the start, after the exit) of a fresh process, and its stdout."""
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ""})
    return t0, time.time(), res.stdout


def one_message(method: str, pid: int, num: int) -> dict[str, float]:
    """The parts of one message in a fresh process, from interpreter start to its exit."""
    t0, t1, out = timed_run([sys.executable, str(CHILD), method, str(pid), str(num)])
    parts = json.loads(out.strip().splitlines()[-1])
    return {
        "interpreter start": parts["wall at start"] - t0,
        **{p: parts[p] for p in PARTS},
        "interpreter exit": t1 - parts["wall at end"],
    }


def print_breakdown(title: str, runs: list[dict[str, float]]) -> float:
    """Median of each part, its share of the total; returns the time to the reply (total - exit)."""
    parts = {k: median(r[k] for r in runs) for k in runs[0]}
    total = sum(parts.values())
    to_reply = total - parts["interpreter exit"]
    print(f"{title} (median of {len(runs)}): total {total:.3f} s, to the reply (without exit) {to_reply:.3f} s")
    for k, v in parts.items():
        print(f"  {k:<26} {v:8.3f} s   share {v / total:6.1%}")
    return to_reply


class Stamped(threading.Thread):
    """Reads a process's output line by line, keeping each line with the epoch time it arrived."""

    def __init__(self, stream: IO[str], log: IO[str]) -> None:
        super().__init__(daemon=True)
        self.stream, self.log, self.lines = stream, log, []

    def run(self) -> None:
        for line in self.stream:
            self.lines.append((time.time(), line))
            self.log.write(line)

    def times(self, text: str) -> list[float]:
        return [t for t, line in self.lines if text in line]


class ChildWatch(threading.Thread):
    """Every 10 ms, the children of the first process under `root` whose command line holds
    `spawner` (flower-superexec, or fedskew.run.clientexec): when each ClientApp process started and
    was last seen running."""

    def __init__(self, root: int, spawner: str) -> None:
        super().__init__(daemon=True)
        self.root, self.spawner, self.done = root, spawner, threading.Event()
        self.seen: dict[int, list[float]] = {}

    def find(self) -> int | None:
        for pid in tree_pids(self.root):
            with contextlib.suppress(OSError):
                if self.spawner in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                    return pid
        return None

    def run(self) -> None:
        spawner = None
        while spawner is None and not self.done.wait(0.1):
            spawner = self.find()
        while spawner and not self.done.wait(0.01):
            with contextlib.suppress(OSError):
                for pid in Path(f"/proc/{spawner}/task/{spawner}/children").read_text().split():
                    now = time.time()
                    self.seen.setdefault(int(pid), [now, now])[1] = now

    def lifetimes(self) -> list[tuple[float, float]]:
        return sorted((a, b) for a, b in self.seen.values())


@contextlib.contextmanager
def supernode(link: PrivateSuperLink, node_config: str, warm: bool) -> Iterator[tuple[Stamped, ChildWatch]]:
    """One insecure SuperNode started with the project's `deploy/supernode.sh`: warm (a
    fedskew.run.clientexec fork per message) or cold (`--cold`: Flower's fresh flwr-clientapp per message)."""
    log = open(link.home / f"supernode-{link.port}.log", "w")
    script = ROOT / "deploy" / "supernode.sh"
    cold = ["--cold"] if "--cold" in script.read_text() and not warm else []  # an older checkout: always cold
    cmd = [str(script), "--insecure", "-s", f"127.0.0.1:{link.port}", "-p", str(free_port()), *cold]
    proc = subprocess.Popen(
        [*cmd, "--", node_config],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=link.env,
        start_new_session=True,
    )
    stamps = Stamped(proc.stdout, log)
    watch = ChildWatch(proc.pid, "fedskew.run.clientexec" if warm else "flower-superexec")
    stamps.start()
    watch.start()
    try:
        yield stamps, watch
    finally:
        watch.done.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        stamps.join(5)
        log.close()


def end_to_end(pid: int, num: int, rounds: int, warm: bool) -> list[dict[str, float]]:
    """Each round's single train message through a local SuperLink + SuperNode: send to reply as
    the ServerApp sees it and, where the timings allow, its parts."""
    env = flower_env(ROOT)
    with tempfile.TemporaryDirectory() as out, PrivateSuperLink(Path(env["FLWR_HOME"]), env, simulation=False) as link:
        overrides = {
            "num-server-rounds": rounds,
            "fraction-train": 1.0,
            "min-nodes": 1,
            "checkpoint-every": 0,
            "out-dir": out,
            "run-name": "bench",
        }
        with supernode(link, f"partition-id={pid} num-partitions={num}", warm) as (stamps, watch):
            submit(ROOT, link, overrides, [], stream=False)
        timings = read_jsonl(Path(out) / "bench" / "timings.jsonl")
    return [message_parts(t, stamps, watch, warm) for t in timings]


def message_parts(t: dict, stamps: Stamped, watch: ChildWatch, warm: bool) -> dict[str, float]:
    """One round's message: its send-to-reply time, and its parts from the SuperNode's log lines
    and the ClientApp process's lifetime (a round of an older run, without `started-at`, has only the first)."""
    parts = {"send to reply (ServerApp)": t["clients-seconds"]}
    if "started-at" not in t:
        return parts
    sent, replied = t["started-at"], t["started-at"] + t["clients-seconds"]

    def first(times: list[float], after: float) -> float:
        return min((x for x in times if after <= x <= replied), default=float("nan"))

    received = first(stamps.times("Receiving: train message"), sent)
    stored = first(stamps.times("Received successfully"), received)
    # the ClientApp process may start while the SuperNode still downloads the message
    started, ended = min(
        ((a, b) for a, b in watch.lifetimes() if received <= a <= replied), default=(float("nan"),) * 2
    )
    sending = first(stamps.times("Sending: train message"), started)
    done = first(stamps.times("Sent successfully"), sending)
    parts.update(
        {
            "SuperLink -> SuperNode (node idle poll)": received - sent,
            "message download": stored - received,
            "SuperNode has it -> ClientApp process starts": started - received,
            "process start -> SuperNode sends the reply": sending - started,
            "reply upload": done - sending,
            "SuperLink -> ServerApp (server poll)": replied - done,
            "ClientApp process lifetime": ended - started,
        }
    )
    if warm:  # a fork ends right after pushing reply and context: the rest is the SuperNode's wait
        parts["of which the reply waits in the SuperNode"] = sending - ended
    return parts


def print_e2e(mode: str, runs: list[dict[str, float]], call: float) -> None:
    """Medians over rounds 2..R (round 1 fills the node's data cache) and the overhead beyond the
    ClientApp call (measured in process above)."""
    later = runs[1:] or runs
    parts = {k: median(r[k] for r in later) for k in later[0]}
    total = parts["send to reply (ServerApp)"]
    print(f"end to end, {mode}: send to reply per round {[round(r['send to reply (ServerApp)'], 2) for r in runs]} s")
    for k, v in parts.items():
        print(f"  {k:<42} {v:8.3f} s")
    print(f"  overhead beyond the ClientApp call ({call:.3f} s)  {total - call:8.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="fedavg")
    ap.add_argument("--partitions", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="warm-cache messages (and bare starts) to time")
    ap.add_argument("--rounds", type=int, default=4, help="end-to-end rounds (one message each)")
    ap.add_argument("--no-e2e", action="store_true", help="skip the SuperLink + SuperNode runs")
    ap.add_argument("--modes", default="cold,warm", help="end-to-end SuperNode modes: cold (Flower's), warm")
    ap.add_argument("--quick", action="store_true", help="tiny: 200 partitions, 1 repeat, no end-to-end run")
    args = ap.parse_args()
    if args.quick:
        args.partitions, args.repeats, args.no_e2e = 200, 1, True
    pid = 0
    with private_cache():  # a node's very first message computes its slice
        first = one_message(args.method, pid, args.partitions)
        later = [one_message(args.method, pid, args.partitions) for _ in range(args.repeats)]
        bare = median(t1 - t0 for t0, t1, _ in (timed_run([sys.executable, "-c", "pass"]) for _ in range(args.repeats)))
    e2e = {}
    for mode in [] if args.no_e2e else args.modes.split(","):
        with private_cache():  # the SuperNode starts with an empty cache too
            e2e[mode] = end_to_end(pid, args.partitions, args.rounds, warm=mode == "warm")
    print(f"{args.method}, partition {pid} of {args.partitions}, torch threads 1; bare `python -c pass` {bare:.3f} s")
    first_total = print_breakdown("first message on a node (partition computed and cached)", [first])
    later_total = print_breakdown("later messages (slice from the .npz cache)", later)
    print(f"  ratio first / later message {first_total / later_total:.3f}")
    call = median(r["train (ClientApp call)"] for r in later)
    for mode, runs in e2e.items():
        print_e2e(mode, runs, call)
    if {"cold", "warm"} <= set(e2e):
        per_message = {m: median(r["send to reply (ServerApp)"] for r in e2e[m][1:] or e2e[m]) for m in e2e}
        print(f"  ratio send to reply warm / cold {per_message['warm'] / per_message['cold']:.3f}")


if __name__ == "__main__":
    main()
