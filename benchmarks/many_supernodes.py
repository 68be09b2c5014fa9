"""Benchmark: a deployment of 2 and of 20 SuperNodes on this machine, as docs/deployment.md sets one
up: memory per SuperNode and the round's overhead.

For each node count, in a fresh folder, with the project's scripts and nothing else: credentials
(`deploy/make-certs.sh`), a trusted app store holding this checkout's FAB (`deploy/trust-app.sh`),
the SuperLink with TLS and SuperNode authentication on the loopback (`deploy/superlink.sh`), the
gateway in front of it (`deploy/gateway.sh`), every node key registered (`flwr supernode register`,
on the SuperLink machine over TLS), a FedAvg job submitted with `flwr run`, and the SuperNodes
started with `deploy/supernode.sh` (as `nobody`, through the gateway, each with its own key and
fedskew's warm ClientApp executor, the default). All on 127.0.0.1, on ports the OS picks.

The job: `--rounds` rounds, every node each round (`fraction-train=1`, `min-nodes` = the nodes),
LeNet, 1 local epoch, node i serving partition i of 20 in both deployments, so that each client's
work is the same (about 2,400 training images) and only the number of nodes changes; the central
evaluation runs once, after the last round, so that it does not compete with the rounds.

Memory and CPU: every 0.5 s, the proportional set size (PSS: shared pages split between the
processes that map them), the resident set size (RSS) and the CPU time (user and system, the ended
forks' included) of each SuperNode's process tree (`flower-supernode`, its warm executor and the
per-message forks) and of the SuperLink's (with its ServerApp process). Printed per node: the
median over nodes of each node's peak memory and of its last sample (idle, `IDLE` seconds after the
job), and the CPU each of an idle node's processes uses in those seconds.

The round's overhead: per round, the time from sending the messages to the last reply
(`clients-seconds` in timings.jsonl) less the slowest client's own ClientApp call
(`client-seconds-max`, measured in the client), i.e. what messaging, polling and process forks add
to the round; round 1 (each node's data cache filled) apart, the median of the later rounds. On this
machine's 2 cores, 20 clients of one round share the CPU, so their calls take about ten times as
long as one client's, and so does everything else the nodes do: the figure that does not depend on
the load is the CPU a round costs each SuperNode and the SuperLink (from round 1's messages to the
last reply, over the rounds).

    .venv/bin/python benchmarks/many_supernodes.py [--nodes 2,20] [--rounds 3]

Needs root (the SuperNodes run as `nobody`), openssl, ssh-keygen, nginx and Fashion-MNIST.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from _common import ROOT, median, read_jsonl, tree_pids

from fedskew.run.launcher import FLWR_ENV, free_ports, stage_app
from tests.multihost import AS_NOBODY

BIN = Path(sys.executable).parent
PARTITIONS = 20
TICK = os.sysconf("SC_CLK_TCK")
IDLE = 10.0  # s sampled after the job: the nodes' idle memory and CPU


def usage(root_pid: int) -> tuple[float, int, int, float]:
    """(epoch seconds, PSS and RSS in bytes, CPU seconds) of a process and all its descendants;
    the CPU of descendants that ended and were waited for counts with their parent's."""
    pss = rss = ticks = 0
    for pid in tree_pids(root_pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
            ticks += sum(map(int, Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:15]))
    return time.time(), pss, rss, ticks / TICK


class Sampler(threading.Thread):
    """Samples `usage` of each of `roots` (a SuperNode's process tree, the SuperLink's) every 0.5 s."""

    def __init__(self, roots: list[int]) -> None:
        super().__init__(daemon=True)
        self.roots, self.samples = roots, {r: [] for r in roots}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            for r in self.roots:
                self.samples[r].append(usage(r))


def cpu_by_process(root_pid: int) -> dict[str, float]:
    """CPU seconds of a SuperNode's processes so far: `flower-supernode`, its warm executor (with the
    forks it waited for), the rest (the shell loop that restarts the executor)."""
    out = {"flower-supernode": 0.0, "fedskew.run.clientexec": 0.0, "other": 0.0}
    for pid in tree_pids(root_pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            kind = next((k for k in out if k in command), "other")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[kind] += sum(map(int, stat[11:15])) / TICK
    return out


def cpu_between(samples: list[tuple], start: float, end: float) -> float:
    """CPU seconds a tree used from the last sample before `start` to the first after `end`."""
    before = [s for s in samples if s[0] <= start] or samples[:1]
    after = [s for s in samples if s[0] >= end] or samples[-1:]
    return after[0][3] - before[-1][3]


def wait_for(what: str, done, timeout: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        if dead := [p.args for p in procs if p.poll() is not None]:
            raise RuntimeError(f"{what}: a process ended: {dead[0]}")
        time.sleep(0.5)


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen]]:
    """Processes started in sessions of their own; all stopped (their whole groups) at the end."""
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for p in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        time.sleep(2)
        for p in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def deployment(nodes: int, rounds: int) -> dict:
    """Run the job on `nodes` SuperNodes; its timings and the SuperNodes' memory samples."""
    folder = Path(tempfile.mkdtemp(prefix="fedskew-nodes-"))
    folder.chmod(0o755)  # the nodes (nobody) read the store and their keys below it
    env = {**os.environ, **FLWR_ENV, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    log = folder / "logs"
    log.mkdir()

    def start(name: str, cmd: list[str], procs: list, **extra: str) -> subprocess.Popen:
        p = subprocess.Popen(
            cmd,
            stdout=open(log / f"{name}.log", "w"),
            stderr=subprocess.STDOUT,
            env={**env, **extra},
            cwd=folder,
            start_new_session=True,
        )
        procs.append(p)
        return p

    try:
        certs = folder / "certs"
        subprocess.run([ROOT / "deploy/make-certs.sh", "-o", certs, "-n", str(nodes)], check=True, capture_output=True)
        app = stage_app(ROOT, folder / "operator" / "fedskew")
        subprocess.run([ROOT / "deploy/trust-app.sh", "-s", folder / "store", app], check=True, capture_output=True)
        link_port, gateway_port, *node_ports = free_ports(2 + nodes)
        home = folder / "cli-home"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{link_port}"\n'
            f'root-certificates = "{certs / "ca.crt"}"\n'
        )
        out = folder / "out"
        run_config = folder / "run-config.toml"
        run_config.write_text(
            f"num-server-rounds = {rounds}\nfraction-train = 1.0\nmin-nodes = {nodes}\nnum-partitions = {PARTITIONS}\n"
            f'eval-every = {rounds}\npartition = "iid"\nout-dir = "{out}"\nrun-name = "nodes-{nodes}"\n'
        )
        with processes() as procs:
            t0 = time.monotonic()
            link = start("superlink", [ROOT / "deploy/superlink.sh", "-c", certs, "-p", str(link_port)], procs)
            gateway = [ROOT / "deploy/gateway.sh", "-c", certs, "-H", "127.0.0.1", "-p", str(gateway_port)]
            start("gateway", [*gateway, "-u", f"127.0.0.1:{link_port}"], procs)
            wait_for(
                "the SuperLink and its gateway",
                lambda: (
                    "running on https://" in (log / "superlink.log").read_text()
                    and "start worker process" in (log / "gateway.log").read_text()
                ),
                120,
                procs,
            )
            flwr = [str(BIN / "flwr")]
            registering = [
                subprocess.Popen(
                    [*flwr, "supernode", "register", certs / f"node{i}.pub", "local"],
                    env={**env, "FLWR_HOME": str(home)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for i in range(nodes)
            ]
            for p in registering:
                said = p.communicate(timeout=300)[0]
                assert p.returncode == 0 and "registered" in said.lower(), said
            submitted = subprocess.run(
                [*flwr, "run", app, "local", "--run-config", run_config, "--format", "json"],
                env={**env, "FLWR_HOME": str(home)},
                capture_output=True,
                text=True,
                check=True,
            )
            assert "run-id" in json.loads(submitted.stdout), submitted.stdout
            roots = []
            for i in range(nodes):
                home_i = folder / "nodes" / f"node{i}"
                (home_i / "cache").mkdir(parents=True)
                shutil.copy(certs / f"node{i}", home_i / "key")
                shutil.copy(certs / "ca.crt", home_i / "ca.crt")
                for path in (home_i, home_i / "cache", home_i / "key"):
                    os.chown(path, 65534, 65534)
                node_config = f'partition-id={i} num-partitions={PARTITIONS} cache-dir="{home_i / "cache"}"'
                cmd = [*AS_NOBODY, ROOT / "deploy/supernode.sh", "-s", f"localhost:{gateway_port}"]
                cmd += ["-k", home_i / "key", "-a", folder / "store", "-p", str(node_ports[i]), "--", node_config]
                roots.append(start(f"node{i}", cmd, procs, HOME=str(home_i)).pid)
            sampler = Sampler([*roots, link.pid])
            sampler.start()
            summary = out / f"nodes-{nodes}" / "summary.json"
            wait_for(f"the job on {nodes} nodes", summary.is_file, 3600, procs)
            wall = time.monotonic() - t0
            time.sleep(1)  # the job's end: the nodes idle again
            before = [cpu_by_process(r) for r in roots]
            time.sleep(IDLE)  # their last samples, and their idle CPU
            after = [cpu_by_process(r) for r in roots]
            pairs = list(zip(before, after, strict=True))
            idle = {kind: median((b[kind] - a[kind]) / IDLE for a, b in pairs) for kind in after[0]}
            sampler.stop.set()
            sampler.join()
        timings = read_jsonl(out / f"nodes-{nodes}" / "timings.jsonl")
        failures = read_jsonl(out / f"nodes-{nodes}" / "failures.jsonl")
        samples = [sampler.samples[r] for r in roots]
        return {
            "timings": timings,
            "nodes": samples,
            "link": sampler.samples[link.pid],
            "wall": wall,
            "failures": failures,
            "idle": idle,
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def report(nodes: int, r: dict) -> dict[str, float]:
    mb = 2**20
    peak_pss = median(max(s[1] for s in samples) for samples in r["nodes"]) / mb
    peak_rss = median(max(s[2] for s in samples) for samples in r["nodes"]) / mb
    idle_pss = median(samples[-1][1] for samples in r["nodes"]) / mb
    idle_rss = median(samples[-1][2] for samples in r["nodes"]) / mb
    overheads = [t["clients-seconds"] - t["client-seconds-max"] for t in r["timings"]]
    first, last = r["timings"][0], r["timings"][-1]
    start, end = first["started-at"], last["started-at"] + last["clients-seconds"]
    rounds = len(r["timings"])
    node_cpu = median(cpu_between(samples, start, end) for samples in r["nodes"]) / rounds
    link_cpu = cpu_between(r["link"], start, end) / rounds
    print(
        f"{nodes} SuperNodes: job of {len(r['timings'])} rounds completed, wall {r['wall']:.1f} s (from the "
        f"SuperLink's start), {len(r['failures'])} lost replies"
    )
    print(
        f"  memory per SuperNode (median over nodes): peak PSS {peak_pss:.0f} MB, RSS {peak_rss:.0f} MB; "
        f"idle after the job PSS {idle_pss:.0f} MB, RSS {idle_rss:.0f} MB"
    )
    print(f"  all SuperNodes together: peak PSS {sum(max(s[1] for s in m) for m in r['nodes']) / mb:.0f} MB")
    print(
        f"  CPU a round (from round 1's messages to the last reply): a SuperNode {node_cpu:.2f} s (median over "
        f"nodes; its message, training included), the SuperLink with its ServerApp {link_cpu:.2f} s"
    )
    idle = ", ".join(f"{kind} {100 * rate:.1f} %" for kind, rate in r["idle"].items())
    print(f"  CPU of an idle SuperNode (median over nodes, % of a core): {idle}")
    for t, o in zip(r["timings"], overheads, strict=True):
        print(
            f"  round {t['round']}: send to last reply {t['clients-seconds']:.2f} s, slowest client's call "
            f"{t['client-seconds-max']:.2f} s (mean {t['client-seconds-mean']:.2f} s), overhead {o:.2f} s"
        )
    later = median(overheads[1:]) if len(overheads) > 1 else overheads[0]
    return {
        "peak PSS": peak_pss,
        "overhead round 1": overheads[0],
        "overhead later rounds": later,
        "SuperNode CPU a round": node_cpu,
        "SuperLink CPU a round": link_cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,20", help="node counts, the first the reference (default 2,20)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = {}
    for n in counts:
        rows[n] = report(n, deployment(n, args.rounds))
    base = rows[counts[0]]
    for n in counts[1:]:
        ratios = ", ".join(f"{k} {rows[n][k] / base[k]:.2f}x" for k in base if base[k] > 0)
        print(f"{n} against {counts[0]} SuperNodes: {ratios}")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
