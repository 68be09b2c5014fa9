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
    python -m fedskew.clientexec --runtime-api-address 127.0.0.1:9094 --parent-pid $!

`deploy/supernode.sh` starts both.

`--task simulation` does the same for a simulation SuperLink (`flower-superlink --simulation
--isolation process`): it preloads torch, Ray and Flower's simulation runtime and runs each
simulation task in a fork with Flower's own `flwr-simulation` entry point (its arguments, log
upload and exit), instead of the SuperExec starting a fresh `flwr-simulation` interpreter (about 2 s
of imports on the path to round 1, and again for every cell of a suite). The ServerApp and the
ClientApps are loaded from the run's FAB as before; the ClientApps still run in Ray's actors.
`fedskew.launcher.PrivateSuperLink` starts it for every simulation.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass

WARM_MODULES = ("torch", "flwr.supernode.runtime.run_clientapp", "fedskew.client_app.app")
SIMULATION_MODULES = ("torch", "ray", "flwr.simulation.app", "fedskew.server_app.app")


def preload(modules: Iterable[str], fresh_package: str = "fedskew") -> None:
    """Import `modules` (and so all they import), then forget `fresh_package`'s own modules: every
    task imports those again from its run's FAB, as a fresh `flwr-clientapp` would."""
    for name in modules:
        importlib.import_module(name)
    for name in [m for m in sys.modules if m == fresh_package or m.startswith(fresh_package + ".")]:
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
    gives it; its exit code."""
    from flwr.simulation.app import flwr_simulation

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
                f"fedskew.clientexec: task in process {pid} ended ({code}) after {time.monotonic() - started:.2f} s",
                flush=True,
            )


def parent_alive(parent_pid: int | None) -> bool:
    if parent_pid is None:
        return True
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    return True


def serve(
    address: str, insecure: bool, root_certificates: str | None, poll: float, parent_pid: int | None, task: str
) -> None:
    """Ask the Runtime API at `address` for `task` tasks and fork one warm process per task, until
    its server (`parent_pid`) is gone."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    task_type, run, _ = TASKS[task]
    certificates = validate_and_resolve_root_certificates(root_certificates, insecure)
    conn = Connection(address, insecure, root_certificates, certificates)
    client = RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    request = AcquireTaskRequest(supported_task_types=[getattr(TaskType, task_type)])
    children: dict[int, float] = {}  # running forks and when each started
    print(f"fedskew.clientexec: warm, serving {task} tasks of {address}", flush=True)
    try:
        while parent_alive(parent_pid):
            reap(children)
            res = client.AcquireTask(request)
            if res.HasField("task") and res.token:
                children[fork_task(run, conn, res.token)] = time.monotonic()
                continue  # a next task may be waiting already
            time.sleep(poll)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fedskew.clientexec", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runtime-api-address", default="127.0.0.1:9094", help="the SuperNode's (or SuperLink's) Runtime API"
    )
    ap.add_argument("--root-certificates", help="CA of the Runtime API when its server serves it over TLS")
    ap.add_argument("--poll", type=float, default=0.05, help="seconds between task requests (flower-superexec: 1)")
    ap.add_argument("--parent-pid", type=int, help="exit when this process (the SuperNode or SuperLink) is gone")
    ap.add_argument("--task", choices=sorted(TASKS), default="clientapp", help="the tasks to run (default: clientapp)")
    ap.add_argument("--preload", action="append", help="modules to import up front (default: the task's)")
    args = ap.parse_args(argv)
    preload(args.preload or TASKS[args.task][2])
    serve(
        args.runtime_api_address,
        args.root_certificates is None,
        args.root_certificates,
        args.poll,
        args.parent_pid,
        args.task,
    )


if __name__ == "__main__":
    main()
