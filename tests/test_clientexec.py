"""The warm executor (`fedskew.run.clientexec`): behind a SuperNode in `--isolation process`, as
`deploy/supernode.sh` starts it by default, and (`--task simulation`) beside every simulation
SuperLink the launcher starts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fedskew.run.clientexec import preload
from fedskew.run.launcher import (
    PrivateSuperLink,
    RunFailed,
    federation_config,
    flower_env,
    free_port,
    prepare_config,
    resources_for,
    submit,
)
from fedskew.server_app.results import read_jsonl
from tests.conftest import ROOT, SMALL_JOB


def test_preload_keeps_third_party_modules_and_forgets_the_app(monkeypatch) -> None:
    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # the test's own modules stay as they were
    preload(["fedskew.training"])
    assert "torch" in sys.modules and "numpy" in sys.modules
    assert not [m for m in sys.modules if m == "fedskew" or m.startswith("fedskew.")]


def _hand_started(*args: str, timeout: float = 60) -> tuple[int, list[str]]:
    """`python -m fedskew.run.clientexec ARGS` as a user starts it: its exit status and stderr lines."""
    cmd = [sys.executable, "-m", "fedskew.run.clientexec", "--preload", "json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=flower_env(ROOT))
    return done.returncode, done.stderr.strip().splitlines()


def _ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_task_fork_keeps_tqdm_s_lock_through_a_thread_pool_s_ensure_lock() -> None:
    """`datasets` wraps its thread pools in tqdm's `ensure_lock`, which deletes the class's lock when
    there was none before; a bar of another thread then fails on the missing `_lock`. A task fork
    starts with the lock, so it stays; the same code outside a task fork (control) loses it."""
    script = textwrap.dedent(
        """
        import os
        from tqdm.contrib.concurrent import ensure_lock
        from fedskew.run.clientexec import fork_task, preload
        preload([])
        from tqdm.std import tqdm

        def task(conn, token):
            with ensure_lock(tqdm):
                pass
            return 0 if hasattr(tqdm, "_lock") else 3

        in_fork = os.waitstatus_to_exitcode(os.waitpid(fork_task(task, None, ""), 0)[1])
        with ensure_lock(tqdm):
            pass
        print(in_fork, hasattr(tqdm, "_lock"))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["0", "False"], out.stderr


@pytest.mark.parametrize(
    "address", ["not an address", "127.0.0.1", "localhost:", "127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:abc"]
)
def test_a_malformed_address_is_one_line_and_exit_2(address: str) -> None:
    rc, err = _hand_started("--runtime-api-address", address, timeout=20)
    line = f"fedskew.run.clientexec: --runtime-api-address {address!r} is not HOST:PORT with a port in 1..65535"
    assert rc == 2 and err == [line]


@pytest.mark.parametrize("pid", ["ended", "0", "-1"])
def test_a_parent_pid_that_is_no_process_is_one_line_and_exit_2(pid: str) -> None:
    pid = str(_ended_pid()) if pid == "ended" else pid
    rc, err = _hand_started("--runtime-api-address", f"127.0.0.1:{free_port()}", "--parent-pid", pid, timeout=20)
    assert rc == 2 and err == [f"fedskew.run.clientexec: --parent-pid {pid} is not a running process"]


def test_nothing_listening_at_the_port_is_one_line_and_exit_1() -> None:
    address = f"127.0.0.1:{free_port()}"
    rc, err = _hand_started("--runtime-api-address", address, "--connect-timeout", "1")
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith(f"fedskew.run.clientexec: nothing answers as a Flower Runtime API at {address} after 1 s")


def test_a_port_where_another_http_server_answers_is_one_line_and_exit_1() -> None:
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    server = HTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc, err = _hand_started("--runtime-api-address", f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 1 and len(err) == 1 and "answers HTTP 501, not as a Flower Runtime API" in err[0], err


@pytest.mark.slow
def test_warm_supernode_runs_every_message_in_a_fork(tmp_path: Path) -> None:
    env = flower_env(ROOT)
    with PrivateSuperLink(tmp_path / "flwr-home", {**env, "FLWR_HOME": str(tmp_path / "flwr-home")}, False) as link:
        log = tmp_path / "supernode.log"
        cmd = [str(ROOT / "deploy/supernode.sh"), "--insecure", "-s", f"127.0.0.1:{link.port}", "-p", str(free_port())]
        node_config = f'partition-id=1 num-partitions=20 cache-dir="{tmp_path / "cache"}"'
        with open(log, "w") as out:
            node = subprocess.Popen(
                [*cmd, "--", node_config], stdout=out, stderr=subprocess.STDOUT, env=link.env, start_new_session=True
            )
        try:
            overrides = {
                "num-server-rounds": 2,
                "fraction-train": 1.0,
                "min-nodes": 1,
                "eval-every": 2,
                "checkpoint-every": 0,
                "out-dir": str(tmp_path / "out"),
                "run-name": "warm",
            }
            summary = submit(ROOT, link, overrides, [], stream=False)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
            node.wait(30)
    text = log.read_text()
    assert summary["rounds"] == 2 and 0.0 <= summary["final_global_accuracy"] <= 1.0
    # the client state lives on in the SuperNode between the forks: participations 1, then 2
    timings = read_jsonl(tmp_path / "out" / "warm" / "timings.jsonl")
    assert [t["participations"] for t in timings] == [[1], [2]]
    # query.info and two train messages, each in a fork of the warm process that exited cleanly
    tasks = re.findall(r"fedskew.run.clientexec: task in process (\d+) ended \((-?\d+)\)", text)
    assert len(tasks) == 3 and {code for _, code in tasks} == {"0"}, text[-3000:]
    assert len({pid for pid, _ in tasks}) == 3
    assert "flwr-clientapp" not in text


@pytest.mark.slow
def test_simulations_run_in_forks_of_the_warm_executor(tmp_path: Path, small_data: str) -> None:
    """Two runs on one simulation SuperLink (a suite's cells): each ServerApp in a fork of the one
    warm process, none in a fresh `flwr-simulation`; a dead executor fails the next run at once."""
    env = {**flower_env(ROOT), "FLWR_HOME": str(tmp_path / "flwr-home")}
    env.pop("FEDSKEW_WARM_EXEC", None)
    job = {**SMALL_JOB, "num-server-rounds": 1, "fraction-train": 0.4, "checkpoint-every": 0, "data-root": small_data}
    with PrivateSuperLink(tmp_path / "flwr-home", env) as link:
        assert link.exec_proc is not None and link.warm_exec
        for name in ("one", "two"):
            cfg, overrides = prepare_config(ROOT, {**job, "out-dir": str(tmp_path / "out"), "run-name": name}, 5)
            fed = ["--federation-config", federation_config(5, resources_for(cfg, 1), (), ray_head=False)]
            summary = submit(ROOT, link, overrides, fed, stream=False)
            assert summary["rounds"] == 1
        ended = r"fedskew.run.clientexec: task in process (\d+) ended \((-?\d+)\)"
        for _ in range(300):  # a run is complete once its summary is written; its fork ends after that
            text = link.exec_log_path.read_text()
            if len(tasks := re.findall(ended, text)) == 2:
                break
            time.sleep(0.1)
        assert len(tasks) == 2 and {code for _, code in tasks} == {"0"}, text[-3000:]
        assert "serving simulation tasks" in text
        link.exec_proc.kill()
        link.exec_proc.wait()
        with pytest.raises(RunFailed, match="simulation executor exited"):
            submit(ROOT, link, {**overrides, "run-name": "three"}, fed, stream=False)
