"""The launcher: validate a run's config, start a private SuperLink, submit the app with `flwr run`,
follow the run to its end and return its summary. Used by the CLI (`fedskew run`) and by the
experiment suites (`fedskew.run.experiments`); it prints nothing but the run's own log stream.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TextIO

import tomllib

from fedskew.config import ConfigError, all_params, parse_overrides, validate
from fedskew.data import is_hf
from fedskew.resources import SimResources, plan_cluster, plan_resources
from fedskew.run.cluster import RayCluster
from fedskew.schema import RunFailed

STOP_GRACE = 1.5  # s between SIGTERM and SIGKILL when a SuperLink or Ray head is stopped
FLWR_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_DEDUP_LOGS": "0",
    # a Ray that Flower starts itself: workers on ports the OS picks (as `RayHead`'s), not Ray's
    # default range from 10002, which clashes between Ray instances started at once on one machine
    "RAY_USE_RANDOM_PORTS": "1",
    # SuperExec asks the SuperLink for new runs every second by default; 0.25 s starts a run
    # sooner for about 1 % more of one core while idle.
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.25",
}
POLL = FLWR_ENV["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"]  # the warm executor's too: 0.1 s doubled the idle CPU


def find_app_dir(explicit: str | None) -> Path:
    """The Flower app folder: --app, else the cwd or the checkout holding this package."""
    candidates = [Path(explicit)] if explicit else [Path.cwd(), Path(__file__).resolve().parent.parent]
    for c in candidates:
        pp = c / "pyproject.toml"
        if pp.is_file() and "app" in tomllib.loads(pp.read_text()).get("tool", {}).get("flwr", {}):
            return c.resolve()
    raise ConfigError(f"no Flower app (pyproject.toml with [tool.flwr.app]) in {', '.join(map(str, candidates))}")


def app_defaults(app_dir: Path) -> dict[str, Any]:
    return tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def read_overrides(items: list[str]) -> dict[str, Any]:
    """Merge `--run-config` arguments: 'k=v k2="s"' strings or paths to TOML files."""
    out: dict[str, Any] = {}
    for item in items:
        path = Path(item)
        if item.endswith(".toml") and path.is_file():
            out.update(tomllib.loads(path.read_text()))
        else:
            out.update(parse_overrides(item))
    return out


def prepare_config(app_dir: Path, overrides: dict[str, Any], num_clients: int) -> tuple[dict, dict]:
    """Validate defaults + overrides and check data and partition; return (validated, overrides
    to submit) with `out-dir`/`data-root` (and an `hf:` folder) absolute, `run-name` filled in and
    `num-partitions` set to the number of simulated clients (the count the server trusts)."""
    overrides = dict(overrides)
    cfg = validate({**app_defaults(app_dir), **overrides})
    if cfg["num-partitions"] not in (0, num_clients):  # the server takes the count from here, not from the nodes
        raise ConfigError(
            f"num-partitions={cfg['num-partitions']} is not allowed: the simulation has {num_clients} clients "
            "(-n / num-supernodes); leave num-partitions out"
        )
    overrides["num-partitions"] = num_clients
    overrides["out-dir"] = str(Path(cfg["out-dir"]).expanduser().absolute())
    if cfg["data-root"]:
        overrides["data-root"] = str(Path(cfg["data-root"]).expanduser().absolute())
    hf_folder = Path(cfg["dataset"][3:]).expanduser()
    if is_hf(cfg["dataset"]) and hf_folder.is_dir():  # the clients run elsewhere: an absolute folder
        overrides["dataset"] = f"hf:{hf_folder.absolute()}"
    if not cfg["run-name"]:
        from fedskew.server_app.results import default_run_name

        overrides["run-name"] = default_run_name(cfg, datetime.now().strftime("%Y%m%d-%H%M%S"))
    cfg = validate({**app_defaults(app_dir), **overrides})
    if cfg["min-nodes"] > num_clients:  # the server would wait round-timeout for nodes that never come
        raise ConfigError(f"min-nodes={cfg['min-nodes']} is not allowed: the simulation has {num_clients} clients (-n)")
    from fedskew.data import dataset_info
    from fedskew.data.clients import client_indices
    from fedskew.models import check_input
    from fedskew.server_app.results import check_run_folder
    from fedskew.training import pick_device

    pick_device(cfg["device"])  # the simulated clients run here
    # earlier results without resume or overwrite, or a damaged or foreign checkpoint, refused now
    check_run_folder(Path(overrides["out-dir"]) / overrides["run-name"], cfg)
    client_indices(cfg, num_clients)  # raises DataMissingError / PartitionError early
    check_input(cfg["model"], dataset_info(cfg))  # the model takes the data set's images
    from fedskew.client_app.state import state_bound_problem

    if problem := state_bound_problem(cfg):  # its simulated clients would each fail every round they train
        raise ConfigError(problem)
    return cfg, overrides


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free localhost ports: all held bound until every one is picked (ports picked one
    at a time may repeat, and Ray refuses to start when two of its components share one)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def flwr_bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def warm_exec_default() -> bool:
    """Whether simulations run in the warm executor (`FEDSKEW_WARM_EXEC`, default on; 0 turns it off)."""
    return os.environ.get("FEDSKEW_WARM_EXEC", "1") != "0"


class PrivateSuperLink:
    """A SuperLink on a free localhost port, owned (and killed) by this process: a simulation one,
    or (`simulation=False`) a deployment one that SuperNodes connect to without TLS.

    A simulation SuperLink runs in `--isolation process` beside fedskew's warm executor
    (`python -m fedskew.run.clientexec --task simulation`), which has torch, Ray and Flower's
    simulation runtime imported before the first run is submitted and runs each run in a fork of
    itself, instead of Flower's SuperExec starting a fresh `flwr-simulation` for each;
    `warm_exec=False` (or `FEDSKEW_WARM_EXEC=0`) keeps Flower's default."""

    def __init__(self, home: Path, env: dict[str, str], simulation: bool = True, warm_exec: bool | None = None) -> None:
        self.home, self.env, self.simulation = home, env, simulation
        self.warm_exec = simulation and (warm_exec_default() if warm_exec is None else warm_exec)
        self.port = free_port()
        self.connection = f"fedskew-{self.port}"
        self.log_path = home / f"superlink-{self.port}.log"
        self.exec_log_path = home / f"simexec-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.exec_proc: subprocess.Popen | None = None  # the warm executor, if any
        self.ray: RayHead | RayCluster | None = None  # the Ray its simulations join, if any (`simulation_link`)

    @property
    def _block(self) -> str:
        return f'\n[superlink.{self.connection}]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'

    def _edit_config(self, edit: Callable[[str], str]) -> None:
        """Rewrite FLWR_HOME's config.toml under a lock: concurrent fedskew commands sharing one
        FLWR_HOME each add and drop their own connection without losing another's."""
        self.home.mkdir(parents=True, exist_ok=True)
        cfg = self.home / "config.toml"
        with open(self.home / "config.toml.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            default = '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
            cfg.write_text(edit(cfg.read_text() if cfg.is_file() else default))

    def __enter__(self) -> PrivateSuperLink:
        self._edit_config(lambda text: text + self._block)
        self.proc = subprocess.Popen(
            [
                flwr_bin("flower-superlink"),
                "--insecure",
                *(["--simulation"] if self.simulation else []),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
                *(["--isolation", "process"] if self.warm_exec else []),
            ],
            stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        if self.warm_exec:  # its imports overlap the SuperLink's start
            runtime = ["--runtime-api-address", f"127.0.0.1:{self.port}", "--parent-pid", str(self.proc.pid)]
            self.exec_proc = subprocess.Popen(
                [sys.executable, "-m", "fedskew.run.clientexec", "--task", "simulation", "--poll", POLL, *runtime],
                stdout=open(self.exec_log_path, "w"),
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=Path(__file__).resolve().parent.parent,  # this fedskew, whatever the caller's folder
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RunFailed(f"flower-superlink exited at start; see {self.log_path}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return self
            time.sleep(0.1)
        raise RunFailed(f"flower-superlink did not answer in 60 s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        with signals_deferred():
            for proc in (self.exec_proc, self.proc):  # results are on disk by now: a short grace
                if proc:
                    stop_process_tree(proc, grace=STOP_GRACE)
            self._drop_connection()

    def check_executor(self) -> None:
        """Raise RunFailed if the warm executor has died (no run would ever start)."""
        if self.exec_proc and self.exec_proc.poll() is not None:
            code = self.exec_proc.returncode
            raise RunFailed(f"fedskew's simulation executor exited ({code}); see {self.exec_log_path}")

    def _drop_connection(self) -> None:
        self._edit_config(lambda text: text.replace(self._block, ""))


class RayHead:
    """A Ray head node (`ray start --head --block` on free localhost ports) that the simulations of
    one command join (`RAY_ADDRESS`) instead of each starting Ray: Ray's own start (GCS, raylet,
    dashboard, agents: seconds of CPU) then runs beside the SuperLink's, once per suite, without the
    Ray Client server and autoscaler monitor it would otherwise start (`resources.lean_ray_head`).
    It owns the CPUs (and GPUs) of `resources`, so the runs pass Flower no `init-args-*`."""

    def __init__(self, resources: SimResources, home: Path, env: dict[str, str]) -> None:
        self.resources, self.env = resources, dict(env)
        self.port, *self.component_ports = free_ports(3)  # the head, its dashboard and its agent
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = home / f"ray-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.temp_dir = ""

    def __enter__(self) -> RayHead:
        # a private Ray folder: `ray start` records its address in <temp-dir>/ray_current_cluster,
        # which a later plain `ray.init()` (e.g. a user's `flwr run`) would otherwise try to join
        self.temp_dir = tempfile.mkdtemp(prefix="fedskew-ray-")
        r = self.resources
        names = ("dashboard-port", "dashboard-agent-listen-port")
        ports = [f"--{name}={port}" for name, port in zip(names, self.component_ports, strict=True)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                flwr_bin("ray"),
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={self.port}",
                f"--num-cpus={r.actors * r.threads}",
                f"--num-gpus={r.gpus if r.gpus_per_actor else 0}",
                "--include-dashboard=false",
                "--min-worker-port=0",  # workers bind ports the OS picks: Ray's default range (from
                "--max-worker-port=0",  # 10002) clashes between Ray instances started at once
                "--disable-usage-stats",
                f"--temp-dir={self.temp_dir}",
                *ports,  # free ones: Ray's defaults would collide with other Ray instances on this machine
            ],
            stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT,
            env={**self.env, "RAY_START_HOOK": "fedskew.resources.lean_ray_head"},
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log_path.read_text(errors="replace"):
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise RunFailed(f"the Ray head did not start; see {self.log_path}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        with signals_deferred():
            if self.proc:
                stop_process_tree(self.proc, grace=STOP_GRACE)
            shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """A second Ctrl-C or SIGTERM must not cut a clean-up short: it takes effect afterwards."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _descendants(*roots: int) -> dict[int, str]:
    """The live processes the `roots` started, and theirs, with their command lines; zombies (ended,
    not yet reaped by their parent) are left out. Read from /proc on Linux, so that stopping a run
    needs no new process (it must work when the process table is full); `ps` elsewhere (macOS)."""
    children, command_line = _proc_table() if Path("/proc/self/stat").is_file() else _ps_table()
    found, todo = {}, list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = command_line(child)
            todo.append(child)
    return found


def _proc_table() -> tuple[dict[int, list[int]], Callable[[int], str]]:
    """(parent pid -> its live children, pid -> command line) from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:  # `pid (comm) state ppid ...`; comm may hold spaces and parentheses
            state, ppid = (Path(entry.path) / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError, IndexError):  # ended meanwhile
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry.name))

    def command_line(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return ""

    return children, command_line


def _ps_table() -> tuple[dict[int, list[int]], Callable[[int], str]]:
    """(parent pid -> its live children, pid -> command line) from one `ps` (macOS)."""
    # -ww: whole command lines; otherwise ps cuts them at $COLUMNS (80 under pytest), and a deep
    # venv path loses the program name that `RunWatch` looks for
    res = subprocess.run(["ps", "-A", "-ww", "-o", "pid=,ppid=,stat=,args="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    args: dict[int, str] = {}
    for line in res.stdout.splitlines():
        pid, ppid, state, *rest = line.split(maxsplit=3)
        if not state.startswith("Z"):
            children.setdefault(int(ppid), []).append(int(pid))
            args[int(pid)] = rest[0] if rest else ""
    return children, lambda pid: args.get(pid, "")


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def stop_process_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop `proc` and everything it started, also what left its process group: the SuperLink's
    SuperExec opens a session of its own, in which `flwr-simulation`, Ray and the ClientApp actors
    run, so signalling the SuperLink's group alone leaves the run going (and writing results).
    Every group in the tree gets SIGTERM, then SIGKILL for whatever still runs after `grace` s."""
    try:
        pids = [proc.pid, *_descendants(proc.pid)]
    except OSError:  # e.g. `ps` could not start (macOS, a full process table): the process's own group at least
        pids = [proc.pid]
    groups = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())  # never our own (the CLI's) group

    def signal_groups(sig: signal.Signals) -> None:
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)

    signal_groups(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (proc.poll() is None or any(map(_running, pids[1:]))):
        time.sleep(0.1)
    signal_groups(signal.SIGKILL)
    proc.wait()


def _flwr_json(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    res = subprocess.run([flwr_bin("flwr"), *args, "--format", "json"], capture_output=True, text=True, env=env)
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError:
        raise RunFailed(f"`flwr {' '.join(args)}` failed: {(res.stdout + res.stderr).strip()[-2000:]}") from None


def resources_for(cfg: dict[str, Any], actors: int | None = None, cluster: RayCluster | None = None) -> SimResources:
    """The simulation's actors x threads (and GPU share) for a validated run config: every core
    busy unless `actors` says otherwise, on this machine or on each node of `cluster` (see
    `fedskew.resources`; Flower sizes a cluster's actor pool from its nodes, so `actors` cannot
    be chosen there)."""
    use_gpu = cfg["device"] != "cpu"
    if cluster is None:
        return plan_resources(cfg["torch-threads"], actors, use_gpu=use_gpu)
    if actors is not None:
        raise ConfigError(
            f"--actors {actors} is not allowed with --ray-address: on a Ray cluster each node runs its CPUs // "
            "torch-threads actors (`ray start --num-cpus` on a node sets how many CPUs it offers)"
        )
    return plan_cluster(cluster.nodes, cfg["torch-threads"], use_gpu=use_gpu)


_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")  # as `flwr run --federation-config` reads them


def federation_config(
    num_supernodes: int, resources: SimResources, extra: Sequence[str] = (), ray_head: bool = False
) -> str:
    """The `--federation-config` string: the clients, the resources (without Ray's `init-args-*`
    when the run joins a running Ray: a `RayHead` or a cluster), then `extra` 'k=v' items, which win
    (Flower refuses a key given twice)."""
    fed = {"num-supernodes": str(num_supernodes), **resources.federation_config()}
    if ray_head:
        fed = {k: v for k, v in fed.items() if not k.startswith("init-args-")}
    for item in extra:
        fed.update(_PAIR.findall(item))
    return " ".join(f"{k}={v}" for k, v in fed.items())


@contextlib.contextmanager
def simulation_link(
    app_dir: Path, resources: SimResources | None = None, cluster: RayCluster | None = None
) -> Iterator[PrivateSuperLink]:
    """A private simulation SuperLink for one or several runs (a suite submits all its cells to one)
    whose runs join `cluster` (a running Ray cluster) or, with `resources`, a Ray head started beside
    it (`RayHead`); else each run starts Ray itself."""
    env = flower_env(app_dir)
    home = Path(env["FLWR_HOME"])
    with contextlib.ExitStack() as stack:
        head = stack.enter_context(RayHead(resources, home, env)) if resources and not cluster else None
        ray = cluster or head
        if ray:
            env["RAY_ADDRESS"] = ray.address  # flwr-simulation's ray.init joins it
        link = stack.enter_context(PrivateSuperLink(home, env))
        if head:
            head.wait_ready()
        link.ray = ray
        yield link


def run_simulation(
    app_dir: Path,
    overrides: dict[str, Any],
    num_supernodes: int,
    federation_config_items: Sequence[str] = (),
    stream: bool = True,
    resources: SimResources | None = None,
    link: PrivateSuperLink | None = None,
    cluster: RayCluster | None = None,
) -> dict[str, Any]:
    """Run one simulation to its end (on `link`, else on a private SuperLink and Ray head of its
    own, or joining `cluster`); return the summary or raise RunFailed. `resources` default: every
    core busy (`resources_for`). With Flower settings in `federation_config_items` and no
    `cluster`, Flower starts Ray."""
    if resources is None:
        resources = resources_for(validate({**app_defaults(app_dir), **overrides}), cluster=cluster)
    if link is None:
        head = None if federation_config_items else resources
        with simulation_link(app_dir, head, cluster) as own:
            return run_simulation(app_dir, overrides, num_supernodes, federation_config_items, stream, resources, own)
    if isinstance(link.ray, RayHead) and link.ray.resources != resources:
        raise RunFailed(f"the run needs {resources.describe()}, the Ray head has {link.ray.resources.describe()}")
    fed = federation_config(num_supernodes, resources, federation_config_items, ray_head=link.ray is not None)
    return submit(app_dir, link, overrides, ["--federation-config", fed], stream)


def flower_env(app_dir: Path) -> dict[str, str]:
    """This environment with Flower's offline settings, its binaries on PATH and a FLWR_HOME."""
    env = {**os.environ, **FLWR_ENV}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # flower-superexec etc.
    env.setdefault("FLWR_HOME", str(app_dir / ".flwr-home"))
    # a run that joins no RayHead starts its own Ray: without this, ray.init() joins the cluster
    # named in /tmp/ray/ray_current_cluster, which a killed `ray start` leaves behind (a hang)
    env["RAY_ADDRESS"] = "local"
    return env


def submit(
    app_dir: Path, link: PrivateSuperLink, overrides: dict[str, Any], flwr_args: list[str], stream: bool = True
) -> dict[str, Any]:
    """`flwr run` the app on `link` (extra `flwr_args`), wait for its end; the summary or RunFailed."""
    env = link.env
    summary_path = Path(overrides["out-dir"]) / overrides["run-name"] / "summary.json"
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "run-config.toml"
        conf.write_text("".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in overrides.items()))
        app = stage_app(app_dir, Path(tmp) / "app")
        with contextlib.suppress(OSError):  # a FLWR_HOME we cannot write: Flower installs it (or refuses)
            install_fab(app, Path(env["FLWR_HOME"]))
        watch = RunWatch(link, summary_path)
        started = _flwr_json(["run", str(app), link.connection, "--run-config", str(conf), *flwr_args], env)
        if not started.get("success", True) or "run-id" not in started:
            raise RunFailed(f"flwr run refused the job: {started}")
        run_id = started["run-id"]
        # the log stream (a second `flwr` process, about a second of CPU to start) only when shown
        logger = LogStream([flwr_bin("flwr"), "log", str(run_id), link.connection, "--stream"], env) if stream else None
        try:
            status = watch.wait(lambda: _run_status(run_id, link.connection, env))
        finally:
            if logger:
                logger.stop()
    if status != "finished:completed" or not summary_path.is_file():
        app_log = link.exec_log_path if link.exec_proc else link.log_path  # where the ServerApp printed
        raise RunFailed(
            f"run {run_id} ended with status {status!r} (results: {summary_path.parent}; "
            f"SuperLink log: {link.log_path}; app log: {app_log}){last_error(app_log)}"
        )
    return json.loads(summary_path.read_text())


def install_fab(app: Path, flwr_home: Path) -> Path:
    """Install `app`'s FAB into `flwr_home`/apps whole before `flwr run` sends it. Flower's own
    install (`flwr.cli.install.validate_and_install`) creates the app's folder, then copies into it,
    and skips any run whose folder exists: two runs of one FAB starting together (a suite's cells,
    two `fedskew run`s on one machine) could load an app half copied. Here it is installed into a
    private folder and renamed into place (atomic), so every run finds it whole or not at all. The
    FAB is built as `flwr run` builds it (`build_fab_from_disk`, fixed zip dates), so its hash, and
    the folder's name, are the same."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.install import install_from_fab
    from flwr.common.constant import FAB_HASH_TRUNCATION

    apps = flwr_home / "apps"
    apps.mkdir(parents=True, exist_ok=True)
    fab = build_fab_from_disk(app)
    suffix = "." + hashlib.sha256(fab).hexdigest()[:FAB_HASH_TRUNCATION]  # Flower's folder name ends so
    if installed := next((p for p in apps.iterdir() if p.name.endswith(suffix) and p.is_dir()), None):
        return installed  # a suite's later cells: nothing to extract, verify or copy again
    with tempfile.TemporaryDirectory(dir=apps, prefix=".staging-") as tmp, contextlib.redirect_stdout(io.StringIO()):
        staged = install_from_fab(fab, install_dir=Path(tmp), skip_prompt=True)
        final = apps / staged.name
        with contextlib.suppress(OSError):  # already there, whole (or another install landed first)
            os.rename(staged, final)
    return final


def last_error(log: Path, lines: int = 15) -> str:
    """The last traceback (or ERROR line) of a log, indented, to show with a failure; '' if none."""
    try:
        text = ANSI_ESCAPE.sub("", log.read_text(errors="replace")).splitlines()
    except OSError:
        return ""
    marks = [i for i, line in enumerate(text) if "Traceback" in line or "ERROR" in line]
    if not marks:
        return ""
    tail = text[marks[-1] : marks[-1] + lines]
    return "\nits last error:\n" + "\n".join("    " + line for line in tail)


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # CSI sequences: colours, cursor moves


def copy_plain(source: IO[bytes], out: TextIO) -> None:
    """Copy `source` line by line to `out` without terminal escape codes (Flower's console handler
    colours every level name, whatever the output is)."""
    for raw in iter(source.readline, b""):
        out.write(ANSI_ESCAPE.sub("", raw.decode(errors="replace")))
        out.flush()


class LogStream:
    """`flwr log --stream` shown on this process's stdout and stderr: as Flower writes it on a
    terminal, as plain text (`copy_plain`) on each of them that is a file or a pipe."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        plain = [not stream.isatty() for stream in (sys.stdout, sys.stderr)]
        pipe = [subprocess.PIPE if p else None for p in plain]
        self.proc = subprocess.Popen(command, env=env, stdout=pipe[0], stderr=pipe[1])
        self.copiers = [
            threading.Thread(target=copy_plain, args=(source, out), daemon=True)
            for source, out in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))
            if source is not None
        ]
        for copier in self.copiers:
            copier.start()

    def stop(self) -> None:
        """Wait up to 2 s for the stream's last lines (the run has ended), then stop it."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(2.0)
        self.proc.terminate()
        self.proc.wait()
        for copier in self.copiers:
            copier.join(2.0)


def stage_app(app_dir: Path, dest: Path) -> Path:
    """A copy of what the app's FAB needs: `pyproject.toml` and the packages of its ServerApp and
    ClientApp. `flwr run` walks every file under the folder it is given before filtering (a
    checkout holds a virtual environment, data and outputs: some 40,000 files, seconds of start-up)."""
    dest.mkdir(parents=True)
    shutil.copy2(app_dir / "pyproject.toml", dest / "pyproject.toml")
    components = tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["components"]
    for package in sorted({ref.split(".")[0].split(":")[0] for ref in components.values()}):
        source = app_dir / package
        if source.is_dir():
            shutil.copytree(source, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(app_dir / f"{package}.py", dest / f"{package}.py")
    return dest


def _run_status(run_id: int, connection: str, env: dict[str, str]) -> str:
    runs = _flwr_json(["ls", connection, "--run-id", str(run_id)], env).get("runs") or []
    return runs[0].get("status", "") if runs else ""


class RunWatch:
    """Notices a run's end without asking the SuperLink often (each `flwr ls` costs a Python start
    and a second or more of CPU): the run is complete once its `summary.json` appears (the
    ServerApp writes it last); it has ended, maybe failed, once its app process (`flwr-simulation`
    or `flwr-serverapp`, which the SuperLink's SuperExec starts, or a fork of fedskew's warm
    executor) has come and gone. Only then, or once a minute in case the process was never seen,
    is the status asked for; a dead warm executor fails the run."""

    APP_PROCESSES = ("flwr-simulation", "flwr-serverapp", "fedskew.run.clientexec")  # the last: its forks

    def __init__(self, link: PrivateSuperLink, summary: Path) -> None:
        assert link.proc is not None
        self.link, self.summary = link, summary
        self.roots = [p.pid for p in (link.proc, link.exec_proc) if p]  # the app runs under one of them
        self.before = set(_descendants(*self.roots))  # earlier runs' processes are not this run's
        self.since = time.time()
        self.app: int | None = None

    def app_ended(self) -> bool:
        procs = _descendants(*self.roots)
        if self.app is None:
            new = [
                p for p, args in procs.items() if p not in self.before and any(a in args for a in self.APP_PROCESSES)
            ]
            self.app = min(new, default=None)
            return False
        return self.app not in procs

    def wait(self, status: Callable[[], str]) -> str:
        """The run's final status, "finished:completed" as soon as its summary is written."""
        asked = looked = time.monotonic()
        while True:
            time.sleep(0.2)
            if self.summary.is_file() and self.summary.stat().st_mtime >= self.since:  # not an earlier run's
                return "finished:completed"
            now = time.monotonic()
            if now - looked < 1.0:
                continue
            looked = now
            self.link.check_executor()
            if self.app_ended() or now - asked > 60:
                asked, current = now, status()
                if current.startswith("finished"):
                    return current


def resume_overrides(run_dir: Path, changes: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The config of an earlier run with `changes` applied (and resume=true), and its number of
    clients. Raises ConfigError for a folder that is not a stopped fedskew run; what it holds is
    checked by `prepare_config` (`results.check_run_folder`)."""
    run_dir = run_dir.expanduser().absolute()
    if not (run_dir / "checkpoint.pt").is_file():
        raise ConfigError(f"--resume {run_dir}: no checkpoint.pt yet (checkpoint-every rounds must have passed)")
    saved = _read_json(run_dir / "config.json", dict)
    train = _read_json(run_dir / "partition.json", dict).get("train")
    if not isinstance(train, list) or not train:
        raise ConfigError(f"--resume {run_dir / 'partition.json'}: no list of clients under 'train'")
    schema = all_params()
    cfg = {k: v for k, v in saved.items() if k in schema}
    cfg.update(
        {**changes, "resume": True, "overwrite": False, "out-dir": str(run_dir.parent), "run-name": run_dir.name}
    )
    return cfg, len(train)


def _read_json(path: Path, kind: type) -> Any:
    """The JSON value in `path`, which must be a `kind`; ConfigError naming the file otherwise."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume {path}: not readable as JSON ({e})") from None
    if not isinstance(value, kind):
        raise ConfigError(f"--resume {path}: holds a {type(value).__name__}, expected a JSON {kind.__name__}")
    return value
