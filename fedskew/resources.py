"""How many clients a simulation trains at once, and with how many torch threads and how much GPU.

Flower's Ray backend starts as many ClientApp actors as fit its resources: Ray's CPUs divided by
each actor's `client-resources-num-cpus` (and GPUs divided by `client-resources-num-gpus`). Left
alone, it gives every actor 2 CPUs, so a 2-core machine trains one client at a time with one torch
thread: half the machine idles. fedskew instead fills every core: `actors` ClientApp actors of
`threads` torch threads each (the run config's `torch-threads`, default 1), Ray told exactly
`actors x threads` CPUs. With CUDA present (and `device` not "cpu"), every actor also reserves a
fraction of a GPU, so several actors share one GPU (measured on an H100: docs/benchmarks.md, "GPU").

Ray is told at most `OVERSUBSCRIPTION` x cores CPUs (actors x threads): each actor is a process
with `threads` threads, and Ray starts a worker process per CPU it is told of, so a mistyped
`torch-threads=1000000` or `--actors 100000` would fill the host's process table. A few times the
cores still allows more actors than cores (docs/benchmarks.md runs 4 actors on 2 cores) and a
`torch-threads` above the cores (to reproduce a run made on a larger machine).

On a Ray cluster that fedskew joins (`--ray-address`, `plan_cluster`) the same rule holds per node:
each node runs `CPUs // threads` actors of the CPUs its `ray start` announced (by default all its
cores), which is the count Flower's Ray backend derives from the same `client-resources-num-cpus`
(`pool_size_from_resources` in `flwr/simulation/ray_transport/ray_actor.py`, node by node). Where
every such node has GPUs each actor also reserves a share, the smallest of `GPUs / actors` over the
nodes, so that it fits on each; a cluster in which only some nodes have GPUs runs CPU actors (Flower
gives a GPU-reserving actor no place on a node without a GPU, so the CPU nodes would idle). Ray told
the cluster its CPUs, so the `OVERSUBSCRIPTION` bound (this machine's process table) does not apply.

Results do not depend on the number of actors: clients are seeded by (seed, partition, round) and
the server sorts replies by partition. They do depend on `torch-threads` (float sums split across
threads round differently), which is why that, not the actor count, is a run-config key.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedskew.schema import ConfigError

# Ray divides GPU shares in units of 1/10,000; a share rounded down always fits `actors` times.
_GPU_SHARE_UNIT = 10_000
OVERSUBSCRIPTION = 4  # Ray's CPUs (actors x torch threads) are at most this many times the cores


@dataclass(frozen=True)
class SimResources:
    """Ray actors (parallel clients), torch threads per actor and the GPU share of each actor."""

    actors: int
    threads: int
    gpus_per_actor: float = 0.0
    cores: int = 0
    gpus: int = 0
    nodes: tuple[tuple[str, int], ...] = ()  # on a Ray cluster: (node address, its actors)

    def federation_config(self) -> dict[str, str]:
        """The `flwr run --federation-config` keys that make Ray start exactly `actors` actors."""
        fed = {
            "client-resources-num-cpus": str(self.threads),
            "init-args-num-cpus": str(self.actors * self.threads),
            "client-resources-num-gpus": repr(self.gpus_per_actor),
        }
        if self.gpus_per_actor:
            fed["init-args-num-gpus"] = str(self.gpus)
        return fed

    def describe(self) -> str:
        gpu = f", {self.gpus_per_actor:g} of a GPU each ({self.gpus} GPU)" if self.gpus_per_actor else ", CPU only"
        thread = "thread" if self.threads == 1 else "threads"
        if self.nodes:
            spread = ", ".join(f"{address}: {n}" for address, n in self.nodes)
            where = f"{len(self.nodes)} Ray nodes, actors per node {spread}; {self.cores} CPUs"
            return f"{self.actors} actors x {self.threads} torch {thread} ({where}{gpu})"
        return f"{self.actors} actors x {self.threads} torch {thread} ({self.cores} cores{gpu})"


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


MAX_PROCESSOR_NAME = 200  # characters of a processor's name, as runs and result files record it


def processor_name() -> str:
    """This machine's CPU model (`/proc/cpuinfo`'s model name, else `platform.processor()`), at most
    MAX_PROCESSOR_NAME characters: float32 sums differ between CPUs (AVX2 against AVX-512 kernels)."""
    import platform

    info = Path("/proc/cpuinfo")
    try:
        lines = info.read_text().splitlines() if info.is_file() else []
    except OSError:
        lines = []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    return " ".join((name or platform.processor() or platform.machine() or "unknown").split())[:MAX_PROCESSOR_NAME]


def available_gpus() -> int:
    """CUDA GPUs as torch sees them; without an NVIDIA driver, 0 without importing torch (1 s)."""
    if not (Path("/proc/driver/nvidia/gpus").is_dir() or shutil.which("nvidia-smi")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_resources(
    torch_threads: int,
    actors: int | None = None,
    *,
    cores: int | None = None,
    gpus: int | None = None,
    use_gpu: bool = True,
) -> SimResources:
    """Actors x threads that fill `cores` (default: all of this machine's), or `actors` if given.

    `torch_threads` 0 means torch's default, i.e. one actor using every core. With `gpus` > 0 and
    `use_gpu`, each actor gets an equal share of the GPUs (at most one whole GPU). Raises
    ConfigError when actors x threads exceed `OVERSUBSCRIPTION` x cores.
    """
    cores = available_cores() if cores is None else cores
    threads = torch_threads if torch_threads > 0 else cores
    limit = OVERSUBSCRIPTION * cores
    why = f"at most {limit} in a simulation ({OVERSUBSCRIPTION} x the {cores} cores this process may use)"
    if threads > limit:
        raise ConfigError(f"torch-threads={torch_threads} is not allowed: must be {why}")
    if actors is None:
        actors = max(1, cores // threads)
    if actors < 1:
        raise ConfigError(f"actors={actors} must be >= 1")
    if actors * threads > limit:
        raise ConfigError(
            f"--actors {actors} is not allowed with torch-threads={threads}: actors x threads must be {why}"
        )
    gpus = (available_gpus() if use_gpu else 0) if gpus is None else gpus
    share = 0.0
    if use_gpu and gpus > 0:
        share = min(1.0, math.floor(gpus / actors * _GPU_SHARE_UNIT) / _GPU_SHARE_UNIT)
    return SimResources(actors=actors, threads=threads, gpus_per_actor=share, cores=cores, gpus=gpus if share else 0)


@dataclass(frozen=True)
class RayNode:
    """A live node of a Ray cluster as its GCS reports it: its address, and its CPUs and GPUs in all
    and free now (others' actors hold the rest)."""

    address: str
    cpus: float
    gpus: float = 0.0
    free_cpus: float = 0.0
    free_gpus: float = 0.0


def plan_cluster(nodes: Sequence[RayNode], torch_threads: int, use_gpu: bool = True) -> SimResources:
    """Actors on a Ray cluster's `nodes`: `cpus // threads` on each (see the module docstring).

    `torch_threads` 0 (torch's default, every core) reserves the smallest node's CPUs per actor.
    Raises ConfigError when no node has the CPUs for one actor."""
    most = max((int(n.cpus) for n in nodes), default=0)
    if most < 1:
        raise ConfigError(f"the Ray cluster has no node with a CPU for an actor ({len(nodes)} live nodes)")
    threads = torch_threads if torch_threads > 0 else min(int(n.cpus) for n in nodes if n.cpus >= 1)
    if threads > most:
        raise ConfigError(
            f"torch-threads={torch_threads} is not allowed on this Ray cluster: must be at most {most}, "
            "the CPUs of its largest node"
        )
    per_node = [(n, int(n.cpus // threads)) for n in nodes]
    hosting = [(n, k) for n, k in per_node if k > 0]
    share = 0.0
    if use_gpu and all(n.gpus > 0 for n, _ in hosting):
        share = min(1.0, min(math.floor(n.gpus / k * _GPU_SHARE_UNIT) / _GPU_SHARE_UNIT for n, k in hosting))
    return SimResources(
        actors=sum(k for _, k in hosting),
        threads=threads,
        gpus_per_actor=share,
        cores=int(sum(n.cpus for n in nodes)),
        gpus=int(sum(n.gpus for n in nodes)) if share else 0,
        nodes=tuple((n.address, k) for n, k in per_node),
    )


def free_actors(nodes: Sequence[RayNode], resources: SimResources) -> int:
    """How many of `resources`' actors the `nodes`' free CPUs (and GPUs) can start now."""
    free = 0
    for n in nodes:
        k = int(n.free_cpus // resources.threads)
        if resources.gpus_per_actor:
            k = min(k, int(n.free_gpus / resources.gpus_per_actor))
        free += k
    return free


def lean_ray_head(ray_params: Any, head: bool) -> None:
    """`RAY_START_HOOK` for fedskew's own `ray start --head` (`launcher.RayHead`): leave out the two
    head processes a local simulation never uses, Ray Client's server (the runs join by the GCS
    address) and the autoscaler's monitor (a fixed one-node cluster), 1.3 s of CPU at start-up."""
    if head:
        ray_params.ray_client_server_port = None
        ray_params.no_monitor = True
