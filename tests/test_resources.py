"""How a simulation fills the machine: actors x torch threads (and GPU shares), as Flower reads them."""

from __future__ import annotations

import os
import sys

import pytest
from flwr.common.config import parse_config_args
from flwr.supercore.utils import simulation_config_from_json

from fedskew.config import ConfigError, validate
from fedskew.resources import RayNode, SimResources, free_actors, plan_cluster, plan_resources
from fedskew.run.launcher import federation_config, free_ports, resources_for


def ray_pool_size(fed: dict[str, float]) -> int:
    """The actor count Flower's Ray backend derives (`pool_size_from_resources`, one Ray node)."""
    actors = int(fed["init-args-num-cpus"] / fed["client-resources-num-cpus"])
    if fed.get("client-resources-num-gpus", 0.0) > 0:
        actors = min(actors, int(fed.get("init-args-num-gpus", 0) / fed["client-resources-num-gpus"]))
    return actors


@pytest.mark.parametrize(
    ("threads", "actors", "cores", "gpus", "expected"),
    [
        (1, None, 2, 0, (2, 1, 0.0)),  # this machine: both cores train a client each
        (2, None, 2, 0, (1, 2, 0.0)),
        (0, None, 16, 0, (1, 16, 0.0)),  # torch-threads 0 (torch's default): one actor, every core
        (3, None, 16, 0, (5, 3, 0.0)),
        (1, 6, 2, 0, (6, 1, 0.0)),  # asked for more actors than cores: Ray is told 6 CPUs
        (1, None, 16, 1, (16, 1, 0.0625)),  # 16 actors share one GPU
        (1, None, 12, 1, (12, 1, 0.0833)),  # a share rounded down, so 12 of them fit
        (2, None, 8, 2, (4, 2, 0.5)),
        (1, None, 2, 4, (2, 1, 1.0)),  # more GPUs than actors: one whole GPU each
    ],
)
def test_plan_fills_the_cores_and_shares_gpus(threads, actors, cores, gpus, expected) -> None:
    res = plan_resources(threads, actors, cores=cores, gpus=gpus)
    assert (res.actors, res.threads, res.gpus_per_actor) == expected
    fed = {k: float(v) for k, v in res.federation_config().items()}
    assert ray_pool_size(fed) == res.actors
    assert res.actors * res.gpus_per_actor <= max(gpus, 0)


def test_cpu_device_reserves_no_gpu() -> None:
    assert plan_resources(1, cores=4, gpus=2, use_gpu=False) == SimResources(4, 1, 0.0, cores=4, gpus=0)
    res = resources_for(validate({"device": "cpu", "torch-threads": 2}))
    assert res.gpus_per_actor == 0.0 and res.threads == 2


def test_actors_must_be_positive() -> None:
    with pytest.raises(ValueError, match="actors=0"):
        plan_resources(1, 0, cores=2, gpus=0)


def test_federation_config_is_what_flower_accepts_and_user_keys_win() -> None:
    res = plan_resources(1, cores=2, gpus=0)
    text = federation_config(20, res, ["client-resources-num-cpus=2 verbose=true", "init-args-num-cpus=2"])
    parsed = parse_config_args([text])  # a key given twice would raise here
    assert parsed == {
        "num-supernodes": 20,
        "client-resources-num-cpus": 2,
        "init-args-num-cpus": 2,
        "client-resources-num-gpus": 0.0,
        "verbose": True,
    }
    sim = simulation_config_from_json({k.replace("-", "_"): v for k, v in parsed.items()})  # as `flwr run` does
    assert sim.num_supernodes == 20 and sim.client_resources_num_cpus == 2 and sim.init_args_num_cpus == 2


def test_runs_joining_a_ray_head_leave_rays_init_args_to_it() -> None:
    res = plan_resources(1, cores=4, gpus=1)
    parsed = parse_config_args([federation_config(8, res, ray_head=True)])
    assert parsed == {"num-supernodes": 8, "client-resources-num-cpus": 1, "client-resources-num-gpus": 0.25}


def test_fedskews_ray_head_starts_without_ray_clients_server_or_the_autoscaler(tmp_path) -> None:
    """`lean_ray_head` (RAY_START_HOOK) acts: the head runs GCS, raylet and the agents, not Ray
    Client's server nor the autoscaler's monitor, and a run joining it still gets its CPUs."""
    import ray

    from fedskew.run.launcher import RayHead, _descendants, flower_env

    env = {**flower_env(tmp_path), "FLWR_HOME": str(tmp_path / "home")}
    with RayHead(SimResources(actors=2, threads=1), tmp_path / "home", env) as head:
        head.wait_ready()
        procs = " ".join(_descendants(head.proc.pid).values())
        assert "raylet" in procs and "gcs_server" in procs
        assert "ray.util.client.server" not in procs and "autoscaler/_private/monitor.py" not in procs
        ray.init(address=head.address, log_to_driver=False)
        try:
            assert ray.cluster_resources()["CPU"] == 2
        finally:
            ray.shutdown()


def test_the_ray_heads_ports_are_distinct() -> None:
    """Ports picked one at a time can repeat (a Ray head once got its GCS and dashboard on one port
    and did not start); `free_ports` holds each bound until all are picked."""
    for _ in range(200):
        ports = free_ports(3)
        assert len(set(ports)) == 3 and all(1024 <= p < 65536 for p in ports)


def test_log_stream_to_a_file_or_pipe_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """Flower's console handler colours each level name; `fedskew run > file` gets plain text."""
    from fedskew.run.launcher import LogStream

    line = "\x1b[92mINFO \x1b[0m:      round   1/2 | global acc 0.5000\n"
    code = f"import sys; sys.stdout.write({line!r} * 2); sys.stderr.write({line!r})"
    stream = LogStream([sys.executable, "-c", code], dict(os.environ))
    stream.stop()
    captured = capsys.readouterr()
    assert captured.out == "INFO :      round   1/2 | global acc 0.5000\n" * 2
    assert captured.err == "INFO :      round   1/2 | global acc 0.5000\n"


def flower_pool_size(nodes: list[RayNode], res: SimResources, monkeypatch: pytest.MonkeyPatch) -> int:
    """The actor count Flower's Ray backend derives for `res` on a cluster of `nodes` (its own
    `pool_size_from_resources`, reading the nodes as `ray.nodes()` reports them)."""
    from flwr.simulation.ray_transport import ray_actor

    listed = [{"Resources": {"CPU": n.cpus, **({"GPU": n.gpus} if n.gpus else {})}} for n in nodes]
    monkeypatch.setattr(ray_actor.ray, "nodes", lambda: listed)
    fed = res.federation_config()
    wanted = {"num_cpus": int(fed["client-resources-num-cpus"]), "num_gpus": float(fed["client-resources-num-gpus"])}
    return ray_actor.pool_size_from_resources(wanted)


@pytest.mark.parametrize(
    ("cpus_gpus", "threads", "expected"),
    [
        ([(2, 0), (2, 0)], 1, ([2, 2], 1, 0.0)),  # the test's two hosts
        ([(16, 0), (4, 0), (3, 0)], 2, ([8, 2, 1], 2, 0.0)),  # cores // threads on each node
        ([(8, 1), (16, 2)], 1, ([8, 16], 1, 0.125)),  # the smallest share, so it fits on every node
        ([(8, 1), (8, 0)], 1, ([8, 8], 1, 0.0)),  # GPUs on some nodes only: CPU actors everywhere
        ([(4, 0), (12, 0)], 0, ([1, 3], 4, 0.0)),  # torch-threads 0: the smallest node's CPUs
        ([(2, 0), (8, 0)], 4, ([0, 2], 4, 0.0)),  # a node too small for one actor hosts none
        ([(4, 8), (4, 8)], 1, ([4, 4], 1, 1.0)),  # at most one whole GPU per actor
    ],
)
def test_a_cluster_runs_cores_over_threads_actors_on_each_node(cpus_gpus, threads, expected, monkeypatch) -> None:
    nodes = [RayNode(f"10.0.0.{i}", c, g, c, g) for i, (c, g) in enumerate(cpus_gpus, start=1)]
    res = plan_cluster(nodes, threads)
    assert ([k for _, k in res.nodes], res.threads, res.gpus_per_actor) == expected
    assert [address for address, _ in res.nodes] == [n.address for n in nodes]
    assert res.actors == sum(expected[0]) == flower_pool_size(nodes, res, monkeypatch)
    assert free_actors(nodes, res) == res.actors  # an idle cluster starts every one
    assert f"{len(nodes)} Ray nodes, actors per node 10.0.0.1: {expected[0][0]}," in res.describe()


def test_a_cluster_plan_refuses_what_no_node_can_host() -> None:
    with pytest.raises(ConfigError, match="torch-threads=8 is not allowed on this Ray cluster: must be at most 4"):
        plan_cluster([RayNode("a", 4), RayNode("b", 2)], 8)
    with pytest.raises(ConfigError, match="no node with a CPU"):
        plan_cluster([RayNode("a", 0, 1)], 1)
    with pytest.raises(ConfigError, match="no node with a CPU"):
        plan_cluster([], 1)
    assert plan_cluster([RayNode("a", 4, 2)], 1, use_gpu=False).gpus_per_actor == 0.0  # device="cpu"


def test_free_actors_count_what_other_jobs_leave() -> None:
    nodes = [RayNode("a", 4, 0, free_cpus=1), RayNode("b", 4, 0, free_cpus=3.5)]
    res = plan_cluster(nodes, 1)
    assert (res.actors, free_actors(nodes, res)) == (8, 4)
    assert free_actors(nodes, plan_cluster(nodes, 2)) == 1  # 1 and 3.5 free CPUs: one 2-CPU actor
    gpu = [RayNode("a", 4, 1, free_cpus=4, free_gpus=0.5)]
    assert free_actors(gpu, plan_cluster(gpu, 1)) == 2  # 4 CPUs free, but GPU for 2 shares of 1/4
