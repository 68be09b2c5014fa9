"""fedskew's Ray backend: an actor that died leaves the pool (Flower's keeps it, and it fails every
client sent to it). Both backends on a local Ray of 2 CPUs, 2 actors, one of them killed."""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest


def client_app():
    """A ClientApp that answers a train message with its partition id (built inside the actor)."""
    from flwr.app import Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg, context):
        pid = int(context.node_config["partition-id"])
        return Message(RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)

    return app


def message_and_context(partition_id: int):
    """A train message to the node of `partition_id`, and that node's context."""
    from flwr.app import Context, Message, RecordDict

    msg = Message(RecordDict(), dst_node_id=partition_id + 1, message_type="train")
    msg.metadata.__dict__["_message_id"] = f"m{partition_id}"
    ctx = Context(
        run_id=1,
        node_id=partition_id + 1,
        node_config={"partition-id": partition_id, "num-partitions": 8},
        state=RecordDict(),
        run_config={},
    )
    return msg, ctx


def send(backend, partition_id: int) -> int | str:
    """One train message through `backend`: the partition id it answers, or the error's type."""
    try:
        reply, _ = backend.process_message(*message_and_context(partition_id))
    except Exception as e:
        return type(e).__name__
    return int(reply.content["metrics"]["partition-id"])


@pytest.fixture
def local_ray(monkeypatch: pytest.MonkeyPatch):
    """A Ray of this process's own: files in a private folder (short: Ray's sockets are there)."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "local")  # never a cluster this machine happens to know
    monkeypatch.setenv("RAY_USE_RANDOM_PORTS", "1")
    folder = tempfile.mkdtemp(prefix="fsk-ray-")
    yield folder
    ray.shutdown()
    shutil.rmtree(folder, ignore_errors=True)


def one_actor_killed(backend_class, temp_dir: str):
    """A backend of 2 actors (1 CPU each of 2) with the actor it would use next killed."""
    import ray

    init = {"num_cpus": 2, "_temp_dir": temp_dir}
    backend = backend_class({"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": init})
    backend.build(client_app)
    assert backend.pool.num_actors == 2
    dead = backend.pool.pool[-1]  # the pool hands out its last idle actor first
    ray.kill(dead, no_restart=True)
    return backend


def test_a_dead_actor_leaves_the_pool_and_the_rest_serve_every_later_client(local_ray, task_identity) -> None:
    import ray
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    from fedskew.run.actor_pool import SurvivingRayBackend

    flowers = one_actor_killed(RayBackend, local_ray)
    answers = [send(flowers, pid) for pid in range(4)]
    assert answers == ["ActorDiedError"] * 4  # Flower's: the dead actor goes back, and takes every client
    for actor in flowers.pool.pool:
        ray.kill(actor)  # its CPUs to the next backend

    ours = one_actor_killed(SurvivingRayBackend, local_ray)
    with ThreadPoolExecutor(4) as threads:  # as Flower's simulation engine: a worker thread per actor, and more
        answers = list(threads.map(lambda pid: send(ours, pid), range(6)))
    assert all(answer == pid for pid, answer in enumerate(answers) if answer != "ActorLost")
    assert answers.count("ActorLost") == 1 and ours.pool.num_actors == 1
    assert [send(ours, pid) for pid in range(6, 9)] == [6, 7, 8]  # the survivor serves every later one


def test_a_pool_with_no_actor_left_fails_at_once(local_ray, task_identity) -> None:
    import ray

    from fedskew.run.actor_pool import SurvivingRayBackend

    backend = one_actor_killed(SurvivingRayBackend, local_ray)
    ray.kill(backend.pool.pool[0], no_restart=True)
    assert [send(backend, pid) for pid in range(3)] == ["ActorLost", "ActorLost", "ActorLost"]
    assert backend.pool.num_actors == 0


def test_an_actor_ray_reports_unavailable_leaves_the_pool_named_by_its_node(
    local_ray, task_identity, monkeypatch
) -> None:
    """A lost machine first shows as ActorUnavailableError (its node stopped answering): the actor
    is retired at once, the client's failure names the node from Ray's actor table."""
    import ray

    from fedskew.run import actor_pool
    from fedskew.run.actor_pool import SurvivingRayBackend

    init = {"num_cpus": 2, "_temp_dir": local_ray}
    backend = SurvivingRayBackend({"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": init})
    backend.build(client_app)
    real_get, calls = ray.get, []

    def unavailable_once(future):
        calls.append(future)
        if len(calls) == 1:
            raise ray.exceptions.ActorUnavailableError("RpcError: Socket closed rpc_code: 14", None)
        return real_get(future)

    monkeypatch.setattr(actor_pool.ray, "get", unavailable_once)
    lost = backend.pool.pool[-1]
    real_get(lost.__ray_ready__.remote())  # placed on its node, as an actor that ran a client is
    node = actor_pool.actor_node_ip(lost)
    assert node
    with pytest.raises(actor_pool.ActorLost, match=f"partition 0 on node {node} died before it replied"):
        backend.process_message(*message_and_context(0))
    assert backend.pool.num_actors == 1 and lost not in backend.pool.pool
    assert [send(backend, pid) for pid in range(1, 4)] == [1, 2, 3]
