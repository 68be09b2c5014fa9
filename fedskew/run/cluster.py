"""Joining a running Ray cluster: `fedskew run --ray-address HOST:PORT` (and `fedskew experiment`).

Flower's simulation runs its ClientApps in Ray actors; Ray clusters span machines. Instead of
starting its own Ray head, fedskew then points the simulation's `ray.init` at the cluster
(`RAY_ADDRESS`) and asks Flower for `torch-threads` CPUs per actor, so each node runs
`CPUs // torch-threads` actors (`fedskew.resources.plan_cluster`). The SuperLink, the warm
executor, the ServerApp and the Ray driver stay on the machine where fedskew runs, which must be
a node of the cluster (Ray's driver attaches to the raylet of its own machine): run fedskew on the
head, or on a machine started with `ray start --address`.

`connect` checks the address before anything starts, each failure one line (`ConfigError`): a text
that is not HOST:PORT; nothing answering there within `REACH_TIMEOUT` seconds; a server there that
is not a Ray cluster this machine can join (the probe, a fresh `python -m fedskew.run.cluster`
process that joins as a driver, lists the live nodes with their total and free CPUs and GPUs and
leaves, gives up after `PROBE_TIMEOUT` seconds). A separate process, so that a Ray that hangs or
crashes on the way in stops only the probe, and this process never holds a Ray connection of its
own when the simulation (a fork of the warm executor) makes its own.

What every node must hold is in docs/usage.md ("Ray cluster"): the same Python environment
(fedskew, torch, Flower and Ray at the versions of the machine running fedskew), and the data set
where its clients look for it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

from fedskew.resources import RayNode, SimResources, free_actors
from fedskew.run.clientexec import ADDRESS
from fedskew.schema import ConfigError

REACH_TIMEOUT = 3.0  # s for a TCP connection to the head's GCS port
PROBE_TIMEOUT = 30.0  # s for the probe to join the cluster, list its nodes and leave


@dataclass(frozen=True)
class RayCluster:
    """A running Ray cluster at `address` (its head's GCS, HOST:PORT) and its live nodes as the
    probe saw them; fedskew neither starts nor stops it."""

    address: str
    nodes: tuple[RayNode, ...]

    def check_room(self, resources: SimResources) -> str:
        """'' when every actor of `resources` finds free CPUs now; a note saying how many wait for
        CPUs that other jobs hold; ConfigError when not one can start (instead of a run that waits)."""
        free = free_actors(self.nodes, resources)
        if free >= resources.actors:
            return ""
        held = ", ".join(f"{n.address} {n.free_cpus:g} of {n.cpus:g}" for n in self.nodes)
        gpu = f" and {resources.gpus_per_actor:g} GPU" if resources.gpus_per_actor else ""
        if free == 0:
            raise ConfigError(
                f"the Ray cluster at {self.address} has no CPUs free for an actor ({resources.threads} CPU{gpu} "
                f"each; free CPUs per node: {held}): other jobs hold them; wait for them or add nodes"
            )
        return (
            f"note: {resources.actors - free} of the {resources.actors} actors wait for CPUs that other jobs on "
            f"the cluster hold (free CPUs per node: {held})"
        )


def parse_address(text: str) -> tuple[str, int]:
    """(host, port) of a HOST:PORT text; ConfigError otherwise."""
    match = ADDRESS.fullmatch(text)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise ConfigError(
            f"--ray-address {text!r} is not allowed: must be HOST:PORT with a port in 1..65535, the address "
            "`ray start --head` prints (e.g. 10.0.0.1:6379)"
        )
    return match["host"].strip("[]"), int(match["port"])


def connect(text: str) -> RayCluster:
    """The cluster at `text` with its live nodes (see the module docstring); ConfigError if none."""
    host, port = parse_address(text)
    try:
        socket.create_connection((host, port), timeout=REACH_TIMEOUT).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ConfigError(
            f"--ray-address {text}: nothing answers there ({why} after at most {REACH_TIMEOUT:g} s); "
            f"start the cluster's head there first: ray start --head --port={port}"
        ) from None
    try:
        probe = subprocess.run(
            [sys.executable, "-m", "fedskew.run.cluster", text],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            env={**os.environ, "RAY_ADDRESS": text, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--ray-address {text}: no Ray cluster answered within {PROBE_TIMEOUT:g} s") from None
    lines = probe.stdout.strip().splitlines()
    if probe.returncode != 0 or not lines:
        said = [line.strip() for line in (probe.stderr + probe.stdout).splitlines() if line.strip()]
        raise ConfigError(f"--ray-address {text}: no Ray cluster joined: {said[-1] if said else 'no answer'}"[:600])
    return RayCluster(text, nodes_from(json.loads(lines[-1])))


def nodes_from(rows: object) -> tuple[RayNode, ...]:
    """The probe's node list, each field checked (an address, finite counts >= 0); ConfigError else."""

    def count(row: dict, key: str) -> float:
        value = row.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"the Ray cluster reported {key}={value!r} for a node: not a count")
        return float(value)

    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("address"), str) for r in rows):
        raise ConfigError("the Ray cluster's node list is not a list of nodes with addresses")
    return tuple(
        RayNode(r["address"][:100], *(count(r, k) for k in ("cpus", "gpus", "free-cpus", "free-gpus"))) for r in rows
    )


def probe(address: str) -> list[dict[str, object]]:
    """Join the cluster at `address` as a driver, list its live nodes with their total and free CPUs
    and GPUs, leave. Runs in the probe process (`connect`)."""
    import logging

    import ray
    from ray._private.state import available_resources_per_node  # per node; ray.available_resources() sums

    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        free = available_resources_per_node()
        rows = []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            total, now = node.get("Resources", {}), free.get(node["NodeID"], {})
            rows.append(
                {
                    "address": node["NodeManagerAddress"],
                    "cpus": total.get("CPU", 0.0),
                    "gpus": total.get("GPU", 0.0),
                    "free-cpus": now.get("CPU", 0.0),
                    "free-gpus": now.get("GPU", 0.0),
                }
            )
        return sorted(rows, key=lambda r: str(r["address"]))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])), flush=True)
