"""The warm ClientApp executor (`fedskew.clientexec`) behind a SuperNode in `--isolation process`,
as `deploy/supernode.sh` starts it by default."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedskew.clientexec import preload
from fedskew.launcher import PrivateSuperLink, flower_env, free_port, submit
from fedskew.server_app.results import read_jsonl
from tests.conftest import ROOT


def test_preload_keeps_third_party_modules_and_forgets_the_app(monkeypatch) -> None:
    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # the test's own modules stay as they were
    preload(["fedskew.training"])
    assert "torch" in sys.modules and "numpy" in sys.modules
    assert not [m for m in sys.modules if m == "fedskew" or m.startswith("fedskew.")]


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
    tasks = re.findall(r"fedskew.clientexec: task in process (\d+) ended \((-?\d+)\)", text)
    assert len(tasks) == 3 and {code for _, code in tasks} == {"0"}, text[-3000:]
    assert len({pid for pid, _ in tasks}) == 3
    assert "flwr-clientapp" not in text
