"""A simulation on a Ray cluster of two machines, run as docs/usage.md ("Ray cluster") says.

Two network namespaces of this machine are the machines (`tests.multihost.NetLab`, as root):
`head` (10.99.S.1) and `worker` (10.99.S.2). The docs' three commands run as written there, with
`$HEAD_IP` filled in, `.venv/bin/` this test's environment, and the short job's `-n` and `-c` in
place of the example's on the `fedskew run` line: `ray start --head` in `head`, `ray start
--address` in `worker` (each node offers its 2 CPUs: 2 actors of 1 torch thread), then
`fedskew run --ray-address` in `head`. Only the head's environment differs from a user's: Ray's
health checks every 0.5 s, so that the killed worker is noticed in seconds rather than 15-30 s.

1. The run completes; its plan names both nodes with 2 actors each, and Ray's actor table (read
   by a driver in `head`) holds ClientApp actors on both nodes.
2. Its `metrics.jsonl` equals that of a run on one machine (fedskew's own Ray head, `-j 4`: the
   same 4 actors) with the same seed; that run goes on beside the cluster's start.
3. A second run on the cluster, whose worker is killed (every process in its namespace, as when a
   machine dies) once round 1 is logged, completes: each client lost is in `failures.jsonl` as an
   `ActorLost` on the worker's address (one per actor the worker had at most), no other reply is
   lost, and every round aggregates the rest.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedskew.server_app.results import read_jsonl
from tests.multihost import NetLab, NetLabUnavailable

# one machine's network namespaces and blackhole routes: never beside another test that makes them
pytestmark = pytest.mark.xdist_group("netns")

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CLIENTS = 40
JOB = 'seed=3 fraction-train=0.1 partition="classes-per-client" classes-per-client=2 local-epochs=1'
FAST_HEALTH_CHECKS = {  # read by the head's GCS: a node missing 3 checks 0.5 s apart is dead
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
# Ray's actor table, as the cluster's GCS keeps it (also the actors of finished jobs): node addresses
ACTOR_NODES = """
import json, logging, sys, ray
from ray._private.state import actors
ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
print(json.dumps([a["Address"]["IPAddress"] for a in actors().values() if "ClientAppActor" in a["ActorClassName"]]))
"""


def documented_commands() -> list[str]:
    """The commands of the first bash block of docs/usage.md's "Ray cluster" section."""
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text.split("\n## Ray cluster", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block, "docs/usage.md: no bash block in the Ray cluster section"
    return [line for line in block[1].splitlines() if line.strip() and not line.lstrip().startswith("#")]


def as_run_here(command: str, head_ip: str) -> list[str]:
    """A documented command with $HEAD_IP filled in and `.venv/bin/` this test's environment."""
    words = shlex.split(command.replace("$HEAD_IP", head_ip))
    return [str(BIN / words[0].removeprefix(".venv/bin/")), *words[1:]]


def short_job(command: list[str], out: Path, name: str, rounds: int) -> list[str]:
    """The documented `fedskew run` with the short job's clients and run config for its example's."""
    cut = command.index("-n")
    config = f'{JOB} num-server-rounds={rounds} eval-every={rounds} out-dir="{out}" run-name="{name}"'
    return [*command[:cut], "-n", str(CLIENTS), "-c", config]


def lab_or_skip() -> NetLab:
    try:
        from fedskew.data import load_dataset

        load_dataset("fashion-mnist", "")
    except FileNotFoundError as e:
        pytest.skip(f"Fashion-MNIST is needed: {e}")
    try:
        return NetLab()
    except NetLabUnavailable as e:
        pytest.skip(f"no network namespaces here, so no Ray cluster of two hosts: {e}")


def kill_host(lab: NetLab, host: str) -> int:
    """Kill every process in `host`'s namespace, as when its machine dies; how many there were."""
    pids = subprocess.run(["ip", "netns", "pids", lab.ns(host)], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


@pytest.mark.slow
def test_a_simulation_on_a_ray_cluster_of_two_hosts(tmp_path: Path) -> None:
    t_start = time.monotonic()
    phases: dict[str, float] = {}  # seconds from the start at which each step ended, printed at the end
    lab = lab_or_skip()
    out = tmp_path / "out"
    env = {
        **os.environ,
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    # Ray's files (and the `ray_current_cluster` that `ray start` leaves) in a folder of the test's,
    # not /tmp/ray, where a later plain `ray.init()` on this machine would find them; a short path:
    # Ray's sockets live there, and a socket's path has at most 107 characters
    ray_tmp = Path(tempfile.mkdtemp(prefix="fsk-ray-"))
    env["RAY_TMPDIR"] = str(ray_tmp)
    reference = None
    try:
        lab.add_host("head", 1)
        lab.add_host("worker", 2)
        head_ip = lab.hosts["head"]
        start_head, join, run = (as_run_here(c, head_ip) for c in documented_commands())
        assert start_head[1:3] == ["start", "--head"] and join[1:3] == ["start", f"--address={head_ip}:6379"]
        assert run[1:4] == ["run", "--ray-address", f"{head_ip}:6379"]

        # 2. (started first, beside the cluster's start) the same job on one machine, with 4 actors
        one_machine = short_job(run, out, "one-machine", 2)
        one_machine[2:4] = ["-j", "4"]  # in place of --ray-address: fedskew's own Ray head, 4 actors
        reference = subprocess.Popen(
            one_machine,
            stdout=open(tmp_path / "one-machine.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        started = lab.run("head", start_head, {**env, **FAST_HEALTH_CHECKS}, ROOT)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        phases["head"] = time.monotonic() - t_start
        joined = lab.run("worker", join, env, ROOT)
        assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-2000:]
        phases["worker"] = time.monotonic() - t_start
        # 1. the documented run on the cluster
        res = lab.run("head", short_job(run, out, "cluster", 2), env, ROOT, timeout=300)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        plan = res.stdout.splitlines()[0]
        assert f"on the Ray cluster at {head_ip}:6379 with 4 actors x 1 torch thread" in plan, plan
        assert f"2 Ray nodes, actors per node {head_ip}: 2, {lab.hosts['worker']}: 2;" in plan, plan
        phases["cluster run"] = time.monotonic() - t_start
        table = lab.run("head", [sys.executable, "-c", ACTOR_NODES, f"{head_ip}:6379"], env, ROOT)
        nodes = json.loads(table.stdout.strip().splitlines()[-1])
        assert sorted(nodes) == sorted([head_ip, head_ip, lab.hosts["worker"], lab.hosts["worker"]]), table

        assert reference.wait(300) == 0, (tmp_path / "one-machine.log").read_text()[-4000:]
        phases["reference"] = time.monotonic() - t_start
        cluster_rows = (out / "cluster" / "metrics.jsonl").read_text()
        assert cluster_rows == (out / "one-machine" / "metrics.jsonl").read_text()
        assert len(cluster_rows.splitlines()) == 2

        # 3. the worker dies once round 1 is logged
        log = tmp_path / "killed.log"
        killed_run = lab.popen("head", short_job(run, out, "killed", 3), log, env, ROOT)
        metrics = out / "killed" / "metrics.jsonl"
        while not (metrics.is_file() and read_jsonl(metrics)):
            assert killed_run.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() - t_start < 400, "round 1 of the second run never ended"
            time.sleep(0.2)
        phases["killed-run round1"] = time.monotonic() - t_start
        assert kill_host(lab, "worker") > 0
        assert killed_run.wait(300) == 0, log.read_text()[-4000:]
        phases["killed-run end"] = time.monotonic() - t_start
        rows = read_jsonl(metrics)
        assert [r["round"] for r in rows] == [1, 2, 3]
        assert all(r["replies"] + r["failures"] == 4 for r in rows), rows
        assert all(r["replies"] >= 2 for r in rows), rows
        failures = read_jsonl(out / "killed" / "failures.jsonl")
        assert 1 <= len(failures) <= 2, failures
        for f in failures:
            assert f["round"] >= 2 and f["reason"].startswith("fedskew.run.actor_pool.ActorLost: "), f
            assert f"on node {lab.hosts['worker']} died before it replied" in f["reason"], f
        steps = ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
        print(f"Ray cluster test: {time.monotonic() - t_start:.1f} s ({steps}); load {os.getloadavg()[0]:.1f}")
    finally:
        if reference is not None and reference.poll() is None:
            reference.terminate()  # `fedskew run` stops its SuperLink and Ray head, then exits
            reference.wait(60)
        lab.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
