"""Benchmark: the time of one train message in deployment, broken into process start, imports,
data load and training.

In deployment a SuperNode starts a fresh `flwr-clientapp` process for every message. This script
runs what that process does in fresh interpreters (`benchmarks/_one_message.py`): interpreter
start and exit, `import torch`, `import flwr`, `import fedskew.client_app.app` (and the method's
trainer), the node's data load, and one round of local training through the real ClientApp. The
data load is measured twice: the node's first message (partition computed from the whole data set
and cached as .npz, `fedskew.data.node`) and every later one (slice read from the cache). A bare
`python -c pass` is timed for reference. Then (unless `--no-e2e`) one real message end to end:
a local insecure SuperLink and one SuperNode (`flower-supernode --insecure`), `--rounds` rounds of
FedAvg; a round's send-to-reply time is one message (round 1: cold cache, later rounds: warm).
Prints each part's share of the message's total and the ratio of the end-to-end time to the parts
up to the reply (a `flwr-clientapp` pushes its reply before the interpreter exits).

    .venv/bin/python benchmarks/deploy_breakdown.py [--partitions 20] [--repeats 3] [--rounds 3] [--quick]
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
import time
from collections.abc import Iterator
from pathlib import Path

from _common import ROOT, median, private_cache, read_jsonl

from fedskew.launcher import PrivateSuperLink, flower_env, flwr_bin, free_port, submit

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


@contextlib.contextmanager
def supernode(link: PrivateSuperLink, node_config: str) -> Iterator[subprocess.Popen]:
    """One insecure SuperNode (subprocess isolation: a fresh flwr-clientapp per message)."""
    log = open(link.home / f"supernode-{link.port}.log", "w")
    cmd = [flwr_bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link.port}"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(free_port()), "--node-config", node_config],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=link.env,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


def end_to_end(pid: int, num: int, rounds: int) -> list[float]:
    """Send-to-reply seconds of each round's single message through a local SuperLink + SuperNode."""
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
        with supernode(link, f"partition-id={pid} num-partitions={num}"):
            submit(ROOT, link, overrides, [], stream=False)
        return [t["clients-seconds"] for t in read_jsonl(Path(out) / "bench" / "timings.jsonl")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="fedavg")
    ap.add_argument("--partitions", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="warm-cache messages (and bare starts) to time")
    ap.add_argument("--rounds", type=int, default=3, help="end-to-end rounds (one message each)")
    ap.add_argument("--no-e2e", action="store_true", help="skip the SuperLink + SuperNode run")
    ap.add_argument("--quick", action="store_true", help="tiny: 200 partitions, 1 repeat, no end-to-end run")
    args = ap.parse_args()
    if args.quick:
        args.partitions, args.repeats, args.no_e2e = 200, 1, True
    pid = 0
    with private_cache():  # a node's very first message computes its slice
        cold = one_message(args.method, pid, args.partitions)
        warm = [one_message(args.method, pid, args.partitions) for _ in range(args.repeats)]
        bare = median(t1 - t0 for t0, t1, _ in (timed_run([sys.executable, "-c", "pass"]) for _ in range(args.repeats)))
    with private_cache():  # the SuperNode starts with an empty cache too
        e2e = [] if args.no_e2e else end_to_end(pid, args.partitions, args.rounds)
    print(f"{args.method}, partition {pid} of {args.partitions}, torch threads 1; bare `python -c pass` {bare:.3f} s")
    cold_total = print_breakdown("first message on a node (partition computed and cached)", [cold])
    warm_total = print_breakdown("later messages (slice from the .npz cache)", warm)
    print(f"  ratio first / later message {cold_total / warm_total:.3f}")
    if e2e:
        later = median(e2e[1:]) if len(e2e) > 1 else e2e[0]
        print(f"end to end through SuperLink + SuperNode, send to reply per round: {[round(s, 2) for s in e2e]} s")
        print(f"  ratio first message e2e / its parts to the reply   {e2e[0] / cold_total:.3f}")
        print(f"  ratio later messages e2e / their parts to the reply {later / warm_total:.3f}")
        print(f"  the rest (Flower: SuperLink, SuperNode, FAB, context transfer), later  {later - warm_total:.3f} s")


if __name__ == "__main__":
    main()
