"""Joining a Ray cluster (`--ray-address`): what is refused up front, with one line and exit 2, and
how a client on a node without the data set fails. The cluster itself: tests/test_ray_cluster.py."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from fedskew import cli
from fedskew.config import ConfigError, validate
from fedskew.resources import RayNode, plan_cluster
from fedskew.run.cluster import RayCluster, connect, nodes_from, parse_address
from fedskew.run.launcher import resources_for

CLUSTER = RayCluster("10.0.0.1:6379", (RayNode("10.0.0.1", 2, 0, 2), RayNode("10.0.0.2", 4, 0, 4)))


@pytest.fixture
def no_superlink(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """`fedskew run` records what it would submit instead of starting anything."""
    calls: list[dict] = []
    monkeypatch.setattr(cli, "run_simulation", lambda *a, **k: calls.append(k) or {})
    monkeypatch.setattr(cli, "format_summary", lambda s: "")
    return calls


def one_line_exit_2(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    code = cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    return err[0]


def refused_port() -> int:
    """A localhost port where nothing listens (it was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10.0.0.1:6379", ("10.0.0.1", 6379)), ("head.example.org:1", ("head.example.org", 1)), ("[::1]:80", ("::1", 80))],
)
def test_a_ray_address_is_host_and_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["10.0.0.1", "10.0.0.1:0", "10.0.0.1:65536", "ray://10.0.0.1:10001", ":6379", "a b:1"])
def test_a_malformed_ray_address_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=r"must be HOST:PORT with a port in 1\.\.65535"):
        parse_address(text)


def test_an_unreachable_or_malformed_ray_address_fails_at_once_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_superlink: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before any Ray probe (which could wait `PROBE_TIMEOUT`): a plain TCP connection, at most
    `REACH_TIMEOUT` seconds, tells that nothing answers."""
    import fedskew.run.cluster as cluster

    def no_probe(*a, **k):
        raise AssertionError("a Ray probe was started")

    monkeypatch.setattr(cluster.subprocess, "run", no_probe)
    out = f'out-dir="{tmp_path}"'
    for address, needle in [
        ("nonsense", "--ray-address 'nonsense' is not allowed: must be HOST:PORT"),
        (f"127.0.0.1:{refused_port()}", "nothing answers there (Connection refused after at most 3 s)"),
    ]:
        line = one_line_exit_2(capsys, ["run", "-n", "20", "--ray-address", address, "-c", out])
        assert needle in line, line
    assert no_superlink == []


@pytest.mark.parametrize("command", [["run", "-n", "20"], ["run", "-n", "20", "--engine", "batched"], ["experiment"]])
def test_an_empty_ray_address_is_refused_not_read_as_running_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_superlink: list[dict], command: list[str]
) -> None:
    """`--ray-address ""` (an unset shell variable) names no cluster: refused in one line, nothing run
    here instead."""
    where = [str(tmp_path / "none.yaml")] if command == ["experiment"] else ["-c", f'out-dir="{tmp_path}"']
    line = one_line_exit_2(capsys, [*command, *where, "--ray-address", ""])
    assert "--ray-address '' is not allowed: must be HOST:PORT" in line, line
    assert no_superlink == []


def test_a_cluster_without_free_cpus_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_superlink: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = RayCluster("10.0.0.1:6379", (RayNode("10.0.0.1", 2, 0, 0.5), RayNode("10.0.0.2", 4, 0, 0)))
    monkeypatch.setattr(cli, "connect", lambda address: busy)
    args = ["run", "-n", "20", "--ray-address", busy.address, "-c", f'out-dir="{tmp_path}"']
    line = one_line_exit_2(capsys, args)
    assert "the Ray cluster at 10.0.0.1:6379 has no CPUs free for an actor (1 CPU each;" in line, line
    assert "10.0.0.1 0.5 of 2, 10.0.0.2 0 of 4" in line and no_superlink == []
    # with room for some actors: a note, and the run goes ahead on the cluster
    half = RayCluster(busy.address, (RayNode("10.0.0.1", 2, 0, 2), RayNode("10.0.0.2", 4, 0, 0)))
    monkeypatch.setattr(cli, "connect", lambda address: half)
    assert cli.main([*args[:-1], f'out-dir="{tmp_path}" run-name="r"']) == 0
    printed = capsys.readouterr().out
    assert "simulated on the Ray cluster at 10.0.0.1:6379 with 6 actors x 1 torch thread" in printed
    assert "note: 4 of the 6 actors wait for CPUs that other jobs on the cluster hold" in printed
    assert no_superlink[0]["cluster"] is half and no_superlink[0]["resources"].actors == 6


def test_actors_are_the_clusters_own() -> None:
    cfg = validate({"device": "cpu"})
    assert resources_for(cfg, cluster=CLUSTER) == plan_cluster(CLUSTER.nodes, 1, use_gpu=False)
    with pytest.raises(ConfigError, match="--actors 3 is not allowed with --ray-address"):
        resources_for(cfg, 3, CLUSTER)


def test_the_probes_node_list_is_checked() -> None:
    rows = [{"address": "10.0.0.2", "cpus": 4, "gpus": 0, "free-cpus": 3.5, "free-gpus": 0}]
    assert nodes_from(rows) == (RayNode("10.0.0.2", 4, 0, 3.5, 0),)
    for bad in ([{"cpus": 4}], {"address": "a"}, [{"address": "a", "cpus": -1}], [{"address": "a", "cpus": "4"}]):
        with pytest.raises(ConfigError):
            nodes_from(bad)
    with pytest.raises(ConfigError, match="not a count"):
        nodes_from([{"address": "a", "cpus": float("nan")}])


def test_a_server_that_is_no_ray_cluster_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Something answers at the address, but the probe joins no cluster there: one line naming why."""
    import fedskew.run.cluster as cluster

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setattr(cluster.sys, "executable", "false")  # a probe that fails at once
        with pytest.raises(ConfigError, match=f"--ray-address {address}: no Ray cluster joined: no answer"):
            connect(address)


def test_a_node_without_the_data_set_fails_its_client_with_a_clear_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task_identity: None
) -> None:
    """On a Ray cluster each node reads the data set from its own disk. A node that lacks it fails
    each client it trains with a reason naming the machine and the files; the run goes on."""
    from fedskew.client_app.app import this_machine
    from fedskew.data import readers
    from fedskew.server_app.results import read_jsonl
    from tests.harness import run_in_process

    debian = readers.DEBIAN_FMNIST
    if not debian.is_dir():
        pytest.skip("Debian's Fashion-MNIST is needed")
    data = tmp_path / "data" / "fashion-mnist"
    data.mkdir(parents=True)
    for f in debian.iterdir():
        (data / f.name).symlink_to(f)
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(readers, "DEBIAN_FMNIST", tmp_path / "nowhere")  # the node's only place is its own
    monkeypatch.delenv("FEDSKEW_DATA", raising=False)
    monkeypatch.chdir(tmp_path / "empty")
    lacking = {5: {"partition-id": 2, "num-partitions": 30, "data-root": str(tmp_path / "empty")}}
    run = {"model": "mlp", "partition": "iid", "fraction-train": 1.0, "num-server-rounds": 1}
    run |= {"data-root": str(data.parent), "out-dir": str(tmp_path / "out"), "run-name": "r"}
    run_in_process(run, 2, num_partitions=30, extra_nodes=lacking)
    (row,) = read_jsonl(tmp_path / "out" / "r" / "metrics.jsonl")
    assert (row["replies"], row["failures"]) == (2, 1)
    (failure,) = read_jsonl(tmp_path / "out" / "r" / "failures.jsonl")
    assert failure["partition"] == 2
    assert failure["reason"].startswith(f"DataMissingError: on {this_machine()}: fashion-mnist not found: put ")
    assert this_machine() == f"host {socket.gethostname()}"  # outside Ray; a Ray actor names its node


def test_a_suite_runs_every_cell_on_the_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedskew.run import experiments
    from tests.test_experiments import SUITE, fake_simulation, write

    path = write(tmp_path, SUITE.format(out=tmp_path / "out"))
    links: list = []
    calls: list = []
    monkeypatch.setattr(cli, "connect", lambda address: CLUSTER)
    monkeypatch.setattr(
        experiments,
        "simulation_link",
        lambda app_dir, head, cluster: (
            links.append((head, cluster)) or contextlib.nullcontext("one link for the suite")
        ),
    )
    monkeypatch.setattr(experiments, "run_simulation", fake_simulation(calls))
    assert cli.main(["experiment", str(path), "--ray-address", CLUSTER.address, "--partitions", "iid"]) == 0
    assert links == [(None, CLUSTER)] and len(calls) == 4  # no Ray head of its own: the cluster's nodes
    out = capsys.readouterr().out
    assert "suite t: on the Ray cluster at 10.0.0.1:6379: 6 actors x 1 torch thread (2 Ray nodes" in out
    line = one_line_exit_2(capsys, ["experiment", str(path), "--ray-address", CLUSTER.address, "-j", "2"])
    assert "--actors 2 is not allowed with --ray-address" in line
