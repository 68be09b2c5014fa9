"""SIGTERM or Ctrl-C to `fedskew run` stops the whole job: when the command has exited, no process of
the run is left (SuperLink, SuperExec, flwr-simulation, Ray, ClientApp actors) and nothing more is
written to the run's folder, so a `--resume` started afterwards does not race it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


pytestmark = pytest.mark.slow


def processes_with(marker: str) -> dict[int, str]:
    """Live processes whose environment holds `marker` (zombies excluded): the job's processes."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if marker.encode() in (proc / "environ").read_bytes().split(b"\0"):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except (OSError, IndexError):
            continue
    return found


def rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="needs Linux /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_interrupt_stops_the_whole_job(tmp_path: Path, small_data: str, how: str) -> None:
    home = tmp_path / "flwr-home"  # every process of the job inherits it: how we find them
    marker = f"FLWR_HOME={home}"
    run_dir = tmp_path / "out" / "job"
    cmd = [sys.executable, "-m", "fedskew.cli", "run", "-n", "5", "-c"]
    cmd.append(
        f'num-server-rounds=100 fraction-train=1.0 checkpoint-every=0 out-dir="{tmp_path / "out"}" run-name="job" '
        f'data-root="{small_data}"'
    )
    try:
        with open(tmp_path / "fedskew.log", "w") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**os.environ, "FLWR_HOME": str(home)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group, as a shell job: Ctrl-C signals the whole group
                # a foreground job's default Ctrl-C: under `make test &` the test inherits SIGINT ignored
                # (a shell ignores it in background jobs), and Python then never raises KeyboardInterrupt
                preexec_fn=_default_sigint,
            )
            try:
                deadline = time.monotonic() + 300
                while rows(run_dir / "metrics.jsonl") < 1:
                    assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "fedskew.log").read_text()
                    time.sleep(0.5)
                if how == "SIGTERM":
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGINT)
                assert proc.wait(60) == 130
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        left = processes_with(marker)
        written = rows(run_dir / "metrics.jsonl")
        time.sleep(5)
        grew = rows(run_dir / "metrics.jsonl") > written
    finally:  # this test started them: leave none to the next one, also when an assert above failed
        for pid, cmdline in processes_with(marker).items():
            print("left running:", pid, cmdline)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} processes of the job still run after `fedskew run` exited"
    assert not grew, "the job went on writing rounds"
    assert not (run_dir / "summary.json").exists()
