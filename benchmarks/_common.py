"""Helpers shared by the benchmark scripts: the checkout on `sys.path`, configs, a private data
cache, timed in-process ClientApp calls, real `flwr run` simulations, memory of a process tree and
ratio tables. Every benchmark prints ratios measured within one run (the machines are noisy)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

# The checkout under test: this one, or `FEDSKEW_CHECKOUT` (e.g. an export of an older commit, to
# measure "before" with the same script).
ROOT = Path(os.environ.get("FEDSKEW_CHECKOUT") or Path(__file__).resolve().parent.parent).resolve()
if str(ROOT) not in sys.path:  # that checkout's fedskew and tests.harness, not an installed copy
    sys.path.insert(0, str(ROOT))

from flwr.app import Message  # noqa: E402

from fedskew.config import validate  # noqa: E402
from fedskew.run.launcher import FLWR_ENV, app_defaults, prepare_config, run_simulation  # noqa: E402
from fedskew.server_app.results import read_jsonl  # noqa: E402
from tests.harness import InProcessGrid  # noqa: E402


def in_process_setup() -> None:
    """Flower's offline settings, and a task identity so that `Message`s can be built in-process."""
    os.environ.update(FLWR_ENV)
    logging.getLogger("flwr").setLevel(logging.ERROR)  # the in-process ServerApp's round log
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1


def run_config(**overrides: Any) -> dict[str, Any]:
    """The app's default run config with `overrides` (keys with '-', as in pyproject.toml)."""
    return {**app_defaults(ROOT), **overrides}


def config(**overrides: Any) -> dict[str, Any]:
    """`run_config` validated (typed values, method keys checked)."""
    return validate(run_config(**overrides))


@contextlib.contextmanager
def private_cache() -> Iterator[Path]:
    """Node data cache in a fresh temporary folder (`$FEDSKEW_CACHE`): first loads are real misses,
    and nothing is added to the user's cache. Child processes inherit it."""
    old = os.environ.get("FEDSKEW_CACHE")
    with tempfile.TemporaryDirectory(prefix="fedskew-bench-cache-") as d:
        os.environ["FEDSKEW_CACHE"] = d
        try:
            yield Path(d)
        finally:
            if old is None:
                os.environ.pop("FEDSKEW_CACHE", None)
            else:
                os.environ["FEDSKEW_CACHE"] = old


class TimedGrid(InProcessGrid):
    """The tests' in-process Grid (real ClientApp, per-node contexts that keep state), timing every
    ClientApp call; `visible` limits the nodes the server sees to the first ones."""

    def __init__(self, num_nodes: int, run_config: dict[str, Any], visible: int | None = None) -> None:
        super().__init__(num_nodes, run_config)
        self.visible = list(self.contexts)[: visible or num_nodes]
        self.calls: list[tuple[str, int, float]] = []  # (message type, partition id, seconds)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.visible)

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            t0 = time.perf_counter()
            replies.extend(super().send_and_receive([msg], timeout))
            pid = int(self.contexts[msg.metadata.dst_node_id].node_config["partition-id"])
            self.calls.append((msg.metadata.message_type, pid, time.perf_counter() - t0))
        return replies

    def seconds(self, message_type: str) -> float:
        return sum(s for t, _, s in self.calls if t == message_type)


def simulate(
    overrides: dict[str, Any], num_clients: int, **run_kwargs: Any
) -> tuple[dict[str, Any], float, dict, list[dict], list[dict]]:
    """One real `flwr run` simulation (private SuperLink, Ray); returns (config, wall seconds,
    summary.json, timings.jsonl rows, metrics.jsonl rows). `run_kwargs` go to `run_simulation`
    (e.g. `resources`)."""
    with tempfile.TemporaryDirectory() as out:
        cfg, subm = prepare_config(ROOT, {**overrides, "out-dir": out, "run-name": "bench"}, num_clients)
        t0 = time.perf_counter()
        summary = run_simulation(ROOT, subm, num_clients, [], stream=False, **run_kwargs)
        wall = time.perf_counter() - t0
        run_dir = Path(out) / "bench"
        timings, metrics = (read_jsonl(run_dir / f) for f in ("timings.jsonl", "metrics.jsonl"))
    return cfg, wall, summary, timings, metrics


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    return children


def tree_pids(root_pid: int, include_root: bool = True) -> list[int]:
    """A process and all its descendants (Linux /proc)."""
    children, found, todo = _children(), [], [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if pid != root_pid or include_root:
            found.append(pid)
    return found


class CpuSampler(threading.Thread):
    """Samples, every `every` s, the CPU seconds (user + system) used so far by this process's
    descendants (each one's last reading is kept after it ends), to get the busy fraction of the
    machine's cores that the run used between two instants (other users' load does not count)."""

    def __init__(self, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every, self.samples, self.done = every, [], threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")
        self.seen: dict[int, float] = {}  # last CPU seconds of every descendant ever seen

    def cpu_seconds(self) -> float:
        for pid in tree_pids(os.getpid(), include_root=False):
            with contextlib.suppress(OSError, IndexError, ValueError):
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                self.seen[pid] = (int(f[11]) + int(f[12])) / self.tick  # utime + stime
        return sum(self.seen.values())

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), self.cpu_seconds()))
            self.done.wait(self.every)

    def busy_fraction(self, start: float, end: float, cores: int) -> float:
        """CPU seconds used between two epoch instants over what `cores` could give."""
        inside = [(t, c) for t, c in self.samples if start <= t <= end]
        if len(inside) < 2:  # a window shorter than the sampling interval
            return float("nan")
        (t0, c0), (t1, c1) = inside[0], inside[-1]
        return (c1 - c0) / ((t1 - t0) * cores)


class GpuSampler(threading.Thread):
    """Every 0.5 s, each GPU's utilization (%) from `nvidia-smi`, when there is one."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, list[float]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while shutil.which("nvidia-smi") and not self.done.wait(0.5):
            out = subprocess.run(query, capture_output=True, text=True).stdout
            with contextlib.suppress(ValueError):
                self.samples.append((time.time(), [float(v) for v in out.split()]))

    def busy(self, start: float, end: float) -> float | None:
        """Mean utilization of all GPUs between two epoch instants (None without nvidia-smi)."""
        values = [statistics.mean(u) for t, u in self.samples if start <= t <= end and u]
        return statistics.mean(values) / 100 if values else None


def measured_simulation(overrides: dict[str, Any], num_clients: int, actors: int | None = None) -> dict[str, Any]:
    """One simulation with `actors` (None: the default, every core busy): the median round and
    clients' part of rounds 2..R, the busy fraction of all cores (and GPUs) over them, the
    start-up (wall time minus the rounds), the config and the metrics rows."""
    from fedskew.resources import available_cores
    from fedskew.run.launcher import resources_for

    resources = resources_for(validate({**app_defaults(ROOT), **overrides}), actors)
    cpu, gpu = CpuSampler(), GpuSampler()
    for sampler in (cpu, gpu):
        sampler.start()
    try:
        cfg, wall, _, timings, metrics = simulate(overrides, num_clients, resources=resources)
    finally:
        for sampler in (cpu, gpu):
            sampler.done.set()
            sampler.join()
    steady = timings[1:]
    start, end = steady[0]["started-at"], steady[-1]["started-at"] + steady[-1]["seconds"]
    return {
        "cfg": cfg,
        "resources": resources,
        "round": median(t["seconds"] for t in steady),
        "clients": median(t["clients-seconds"] for t in steady),
        "busy": cpu.busy_fraction(start, end, available_cores()),
        "gpu busy": gpu.busy(start, end),
        "startup": wall - sum(t["seconds"] for t in timings),
        "timings": timings,
        "metrics": metrics,
    }


def tree_pss(root_pid: int, include_root: bool = True) -> int:
    """Proportional set size (bytes) of a process and all its descendants (Linux /proc): shared
    pages are split between the processes that map them, so the sum is not double counted."""
    total = 0
    for pid in tree_pids(root_pid, include_root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    return total


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def print_ratios(title: str, rows: Sequence[tuple[str, float]], unit: str = "s", base: str | None = None) -> None:
    """One line per (name, value) with its ratio to the row `base` (default: the first)."""
    ref = dict(rows)[base] if base is not None else rows[0][1]
    print(title)
    for name, value in rows:
        print(f"  {name:<34} {value:10.4f} {unit}   ratio {value / ref:7.3f}")


def as_page_names(path: Path) -> str:
    """`path` as a page's command names it: from a checkout's `outputs/` on (as any checkout holds
    it), else as given."""
    parts = path.resolve().parts
    return str(Path(*parts[parts.index("outputs") :])) if "outputs" in parts else str(path.resolve())


def write_block(doc: Path, block: str, command: str, table: list[str]) -> None:
    """`command` (a shell line), the machine and `table` into `doc`'s generated block `block`
    (`<!-- report:<block> begin -->` .. `end`), atomically: a benchmark's table in its reference page."""
    from fedskew.files import write_text
    from fedskew.reports.report import replace_block

    body = ["```bash", command, "```", "", machine(), "", *table]
    write_text(doc, replace_block(doc.read_text(), block, body, str(doc)))


def machine() -> str:
    """'Machine: <CPU model>, N cores, CPU only; load average L at the end.' for a benchmark's table."""
    from fedskew.resources import available_cores, processor_name

    load = os.getloadavg()[0]
    return f"Machine: {processor_name()}, {available_cores()} cores, CPU only; load average {load:.1f} at the end."
