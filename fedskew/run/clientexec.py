"""A warm ClientApp executor for a SuperNode started with `--isolation process`.

By default (`--isolation subprocess`) a SuperNode starts `flower-superexec`, which asks it for a
task every second and then starts a fresh `flwr-clientapp` interpreter for every message: about
1 s to import torch, Flower and the app before the message is read, and 0.8 s of interpreter exit
(torch's teardown) after the reply. With `--isolation process` the SuperNode only serves its
Runtime API and leaves that job to a separate process: this one. It imports torch, Flower's
ClientApp runtime and the app's third-party modules once, asks the SuperNode for a task every
`--poll` seconds, and runs each task in a fork of itself with Flower's own `run_clientapp` (pull
message, context and FAB, install the FAB, load the ClientApp from it, run it, push the reply and
the context). The fork then ends with `os._exit`, skipping the interpreter's teardown.

Each message still runs in a process of its own, as in Flower's default: the ClientApp's module
globals never carry over between messages, only `context.state` does (kept by the SuperNode). The
app's own package is imported afresh in every fork from the run's FAB, so a node always runs the
code that the run was submitted with, never a stale copy from this process; only third-party
modules (torch, numpy, Flower) come preloaded. The connection to the SuperLink (TLS, node
authentication) is the SuperNode's and is unchanged.

    flower-supernode ... --isolation process --port 9094 &
    python -m fedskew.run.clientexec --runtime-api-address 127.0.0.1:9094 --parent-pid $!

`deploy/supernode.sh` starts both.

`--task simulation` does the same for a simulation SuperLink (`flower-superlink --simulation
--isolation process`): it preloads torch, Ray and Flower's simulation runtime and runs each
simulation task in a fork with Flower's own `flwr-simulation` entry point (its arguments, log
upload and exit), instead of the SuperExec starting a fresh `flwr-simulation` interpreter (about 2 s
of imports on the path to round 1, and again for every cell of a suite). The ServerApp and the
ClientApps are loaded from the run's FAB as before; the ClientApps still run in Ray's actors,
on fedskew's Ray backend (`fedskew.run.actor_pool`: an actor that died leaves the pool).
`fedskew.run.launcher.PrivateSuperLink` starts it for every simulation.

Started by hand, a mistake is one line on stderr and a non-zero exit, before anything is served:
an address that is not HOST:PORT (port 1..65535) or a `--parent-pid` that is no running process
(exit 2); nothing answering at the address as a Flower Runtime API within `--connect-timeout`
seconds (default 60, as long as the launcher waits for its SuperLink), or a server there that
answers with an HTTP error (exit 1). Once it has been served, connection errors are retried as
Flower's own executor retries them, until the parent is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

WARM_MODULES = ("torch", "flwr.supernode.runtime.run_clientapp", "fedskew.client_app.app")
SIMULATION_MODULES = ("torch", "ray", "flwr.simulation.app", "fedskew.server_app.app", "fedskew.run.actor_pool")
ADDRESS = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})")  # ASCII digits only


class ExecutorError(RuntimeError):
    """The executor cannot serve: one line for its user, and the exit status (2: the arguments)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def check_arguments(address: str, parent_pid: int | None, poll: float, connect_timeout: float) -> None:
    """Raise `ExecutorError` (status 2) for an address that is not HOST:PORT with a port in 1..65535,
    a parent pid that is not a running process, or a poll or connect timeout that is not a positive
    number of seconds."""
    match = ADDRESS.fullmatch(address)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise ExecutorError(f"--runtime-api-address {address!r} is not HOST:PORT with a port in 1..65535", 2)
    if parent_pid is not None and (parent_pid < 1 or not parent_alive(parent_pid)):
        raise ExecutorError(f"--parent-pid {parent_pid} is not a running process", 2)
    for flag, value in (("--poll", poll), ("--connect-timeout", connect_timeout)):
        if not (math.isfinite(value) and value > 0):
            raise ExecutorError(f"{flag} {value} must be a positive number of seconds", 2)


def preload(modules: Iterable[str], fresh_package: str = "fedskew") -> None:
    """Import `modules` (and so all they import) and tqdm when installed (`keep_tqdm_lock`), then
    forget `fresh_package`'s own modules: every task imports those again from its run's FAB, as a
    fresh `flwr-clientapp` would."""
    for name in modules:
        importlib.import_module(name)
    with contextlib.suppress(ImportError):
        importlib.import_module("tqdm.std")
    forget(fresh_package)


def keep_tqdm_lock() -> None:
    """Give tqdm's bars their class-wide write lock at the start of a task, when tqdm is loaded.
    `tqdm.contrib.concurrent.ensure_lock`, which `datasets` runs around its thread pools, deletes
    the lock it created when there was none, and a bar of another thread then fails with "type
    object 'tqdm' has no attribute '_lock'" (seen loading an `hf:` data set in a task fork). With
    the lock there first, it is only ever swapped and restored. Made in the fork, not shared
    between tasks (its multiprocessing lock would be)."""
    if (std := sys.modules.get("tqdm.std")) is not None:
        std.tqdm.get_lock()


def forget(package: str) -> None:
    """Drop `package`'s modules from `sys.modules`, so that the next import reads them anew."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]


@dataclass(frozen=True)
class Connection:
    """How a task process reaches the Runtime API (the SuperNode's, or the SuperLink's)."""

    address: str
    insecure: bool
    root_certificates: str | None  # the CA file's path
    certificates: bytes | None  # its contents


def exit_code(body: Callable[[], object]) -> int:
    """Run a Flower task process body; its exit code (Flower's processes end with `flwr_exit`)."""
    try:
        body()
    except SystemExit as e:  # flwr_exit ends every task this way, after pushing its results
        return e.code if isinstance(e.code, int) else 1
    except BaseException:  # report anything, then leave the fork
        traceback.print_exc()
        return 1
    return 0


def run_clientapp_task(conn: Connection, token: str) -> int:
    """Flower's ClientApp process body for one task (in a fork); its exit code."""
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    return exit_code(
        lambda: run_clientapp(
            runtime_api_address=conn.address,
            token=token,
            insecure=conn.insecure,
            certificates=conn.certificates,
            parent_pid=os.getppid(),
        )
    )


def run_simulation_task(conn: Connection, token: str) -> int:
    """Flower's `flwr-simulation` command for one task (in a fork), with the arguments a SuperExec
    gives it, on fedskew's Ray backend (`fedskew.run.actor_pool`: an actor that died, e.g. on a lost
    node of a Ray cluster, leaves the pool); its exit code."""
    from flwr.simulation.app import flwr_simulation

    from fedskew.run import actor_pool

    actor_pool.install()
    forget("fedskew")  # the run's own fedskew comes from its FAB

    tls = ["--insecure"] if conn.insecure else ["--root-certificates", str(conn.root_certificates)]
    sys.argv = ["flwr-simulation", "--runtime-api-address", conn.address, "--token", token, *tls]
    sys.argv += ["--parent-pid", str(os.getppid())]
    return exit_code(flwr_simulation)


TASKS = {  # --task -> (Flower's TaskType name, the fork's body, the modules to preload)
    "clientapp": ("CLIENT_APP", run_clientapp_task, WARM_MODULES),
    "simulation": ("SIMULATION", run_simulation_task, SIMULATION_MODULES),
}


def fork_task(run: Callable[[Connection, str], int], conn: Connection, token: str) -> int:
    """Run one task in a fork of this warm process; returns the fork's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            keep_tqdm_lock()
            code = run(conn, token)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)  # no interpreter teardown: that is the 0.8 s a fresh process spends exiting
    return pid


def reap(children: dict[int, float]) -> None:
    """Collect the forks that have ended (no zombies), logging each one's exit status and time."""
    for pid, started in list(children.items()):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            del children[pid]
            code = os.waitstatus_to_exitcode(status)
            print(
                f"fedskew.run.clientexec: task in process {pid} ended ({code}) "
                f"after {time.monotonic() - started:.2f} s",
                flush=True,
            )


def parent_alive(parent_pid: int | None) -> bool:
    if parent_pid is None:
        return True
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    return True


def first_contact(acquire: Callable[[], Any], address: str, timeout: float, parent_pid: int | None) -> Any:
    """The first answer of the Runtime API at `address` (`acquire`, a request with no retries of its
    own), waiting up to `timeout` seconds while nothing answers there (its server may be starting);
    raises `ExecutorError` when nothing does, or when what answers is not a Runtime API."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            return acquire()
        except httpx.HTTPStatusError as e:
            raise ExecutorError(
                f"{address} answers HTTP {e.response.status_code}, not as a Flower Runtime API: "
                "check --runtime-api-address (the SuperNode's or SuperLink's Runtime API port)"
            ) from None
        except httpx.TransportError as e:  # refused, cut, not HTTP, a name that does not resolve
            if not parent_alive(parent_pid):
                raise ExecutorError(f"--parent-pid {parent_pid} ended before {address} answered") from None
            if time.monotonic() >= deadline:
                raise ExecutorError(
                    f"nothing answers as a Flower Runtime API at {address} after {timeout:g} s "
                    f"({type(e).__name__}: {str(e)[:100]}): check --runtime-api-address"
                ) from None
        time.sleep(0.2)


def serve(
    address: str,
    insecure: bool,
    root_certificates: str | None,
    poll: float,
    parent_pid: int | None,
    task: str,
    connect_timeout: float = 60.0,
) -> None:
    """Ask the Runtime API at `address` for `task` tasks and fork one warm process per task, until
    its server (`parent_pid`) is gone; the first contact waits at most `connect_timeout` seconds."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    task_type, run, _ = TASKS[task]
    certificates = validate_and_resolve_root_certificates(root_certificates, insecure)
    conn = Connection(address, insecure, root_certificates, certificates)

    def client(retries: bool) -> RuntimeHttpClient:
        return RuntimeHttpClient.from_server_address(
            server_address=address,
            insecure=insecure,
            root_certificates=certificates,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
            retry_invoker=make_simple_http_retry_invoker() if retries else None,
        )

    request = AcquireTaskRequest(supported_task_types=[getattr(TaskType, task_type)])
    probe = client(retries=False)
    try:
        res = first_contact(lambda: probe.AcquireTask(request), address, connect_timeout, parent_pid)
    finally:
        probe.close()
    runtime = client(retries=True)
    children: dict[int, float] = {}  # running forks and when each started
    print(f"fedskew.run.clientexec: warm, serving {task} tasks of {address}", flush=True)
    try:
        while True:
            if res.HasField("task") and res.token:
                children[fork_task(run, conn, res.token)] = time.monotonic()
            else:  # else a next task may be waiting already
                time.sleep(poll)
            if not parent_alive(parent_pid):
                break
            reap(children)
            res = runtime.AcquireTask(request)
    finally:
        runtime.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fedskew.run.clientexec", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runtime-api-address", default="127.0.0.1:9094", help="the SuperNode's (or SuperLink's) Runtime API"
    )
    ap.add_argument("--root-certificates", help="CA of the Runtime API when its server serves it over TLS")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between task requests (flower-superexec: 1)")
    ap.add_argument("--parent-pid", type=int, help="exit when this process (the SuperNode or SuperLink) is gone")
    ap.add_argument(
        "--connect-timeout", type=float, default=60.0, help="seconds to wait for the Runtime API to answer at start"
    )
    ap.add_argument("--task", choices=sorted(TASKS), default="clientapp", help="the tasks to run (default: clientapp)")
    ap.add_argument("--preload", action="append", help="modules to import up front (default: the task's)")
    args = ap.parse_args(argv)
    try:
        check_arguments(args.runtime_api_address, args.parent_pid, args.poll, args.connect_timeout)
        preload(args.preload or TASKS[args.task][2])
        serve(
            args.runtime_api_address,
            args.root_certificates is None,
            args.root_certificates,
            args.poll,
            args.parent_pid,
            args.task,
            args.connect_timeout,
        )
    except ExecutorError as e:
        print(f"fedskew.run.clientexec: {e}", file=sys.stderr, flush=True)
        sys.exit(e.status)


if __name__ == "__main__":
    main()
