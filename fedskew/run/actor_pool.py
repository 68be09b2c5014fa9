"""Flower's Ray backend for simulations, except that an actor that died leaves the actor pool.

Flower's `RayBackend.process_message` (`flwr/server/superlink/fleet/vce/backend/raybackend.py`)
puts the actor back into its pool whatever happened to the message, also when the actor died: its
process was killed, or the node it ran on left the cluster (a machine of a Ray cluster that fails).
A dead actor then answers every later message at once with the same `ActorDiedError`, so it takes
the next message and the next: one lost node would fail most clients of every later round.

`SurvivingRayBackend` drops an actor that died (`ray.exceptions.ActorDiedError`) from the pool, and
one Ray reports unavailable (`ActorUnavailableError`: its node stopped answering health checks,
which is how a lost machine first shows; Ray may also raise it for a passing network fault, after
which the actor would be usable again, but fedskew's actors are never restarted, so a retired live
actor costs capacity for the rest of the run, never a result): the message it held fails with
`ActorLost`, naming the node, which the server logs like any lost reply
(`failures.jsonl`), and later messages go to the actors still alive. Flower runs one worker thread
per actor it started, so with fewer actors left a thread waits for an idle one
(`SurvivingActorPool.submit`) instead of popping from an empty list; with none left, a message
fails at once. A dead actor is not replaced: the node it ran on is usually gone, and a replacement
that finds no free CPUs would wait for ever.

fedskew's warm executor (`fedskew.run.clientexec --task simulation`) installs the backend (`install`)
in the fork that runs each simulation, before Flower's simulation engine creates its backend.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import ray
from flwr.app import Context, Message
from flwr.common.constant import PARTITION_ID_KEY
from flwr.server.superlink.fleet.vce.backend import raybackend
from flwr.simulation.ray_transport.ray_actor import BasicActorPool, ClientAppActor

_NODE = re.compile(r"^\s*ip: (\S+)", re.MULTILINE)  # in Ray's text of an ActorDiedError


class ActorLost(RuntimeError):
    """The Ray actor that ran a client died before it replied (its process or its node)."""


def lost_reason(error: BaseException, partition_id: object, node_ip: str | None = None) -> str:
    """One line for `failures.jsonl`: which client, on which node (from Ray's text, else `node_ip`),
    and Ray's last word on why."""
    text = str(error)
    node = _NODE.search(text)
    ip = node[1] if node else node_ip
    where = f" on node {ip}" if ip else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    why = lines[-1] if lines else type(error).__name__
    return f"the Ray actor running partition {partition_id}{where} died before it replied: {why}"


class SurvivingActorPool(BasicActorPool):
    """Flower's `BasicActorPool` whose `submit` waits for an idle actor, and that can `retire` one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle = threading.Condition()

    def submit(self, actor_fn: Any, job: tuple[Any, Message, str, Context]) -> Any:
        """Run `job` on an idle actor (waiting for one while all are busy); its future."""
        with self.idle:
            while not self.pool:
                if self.num_actors == 0:
                    raise ActorLost("no Ray actor is left to run a client: every one has died")
                self.idle.wait()
            actor = self.pool.pop()
            app_fn, message, cid, context = job
            future = actor_fn(actor, app_fn, message, cid, context)
            self._future_to_actor[future] = actor
        return future

    def add_actor_back_to_pool(self, future: Any) -> None:
        with self.idle:
            super().add_actor_back_to_pool(future)
            self.idle.notify()

    def retire(self, future: Any) -> Any:
        """Forget the actor that ran `future` (it died); that actor's handle."""
        with self.idle:
            actor = self._future_to_actor.pop(future)
            self.num_actors -= 1
            self.idle.notify_all()  # a thread waiting while none is left must see it
        return actor


def actor_node_ip(actor: Any) -> str | None:
    """The address of the node Ray placed `actor` on, from the cluster's actor table (None when Ray
    does not say: an unavailable actor's error text names no node)."""
    try:
        from ray._private.state import actors

        return actors(actor._actor_id.hex())["Address"]["IPAddress"] or None
    except Exception:  # a private API: a failure to name the node must not hide the loss
        return None


class SurvivingRayBackend(raybackend.RayBackend):
    """Flower's Ray backend on a `SurvivingActorPool` (see the module docstring)."""

    pool: SurvivingActorPool | None

    def build(self, app_fn: Any) -> None:
        self.pool = SurvivingActorPool(
            actor_type=ClientAppActor, client_resources=self.client_resources, actor_kwargs=self.actor_kwargs
        )
        self.pool.add_actors_to_pool(self.pool.actors_capacity)
        self.app_fn = app_fn

    def process_message(self, message: Message, context: Context) -> tuple[Message, Context]:
        """Flower's, except that an actor that died is retired and the message fails with `ActorLost`."""
        if self.pool is None or self.app_fn is None:
            raise ValueError("the Ray backend was not built: call build() first")
        partition_id = context.node_config[PARTITION_ID_KEY]
        future = self.pool.submit(
            lambda actor, app_fn, msg, cid, ctx: actor.run.remote(app_fn, msg, cid, ctx),
            (self.app_fn, message, str(partition_id), context),
        )
        try:
            _, reply, updated = ray.get(future)
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError) as e:
            actor = self.pool.retire(future)
            raise ActorLost(lost_reason(e, partition_id, actor_node_ip(actor))) from None
        except BaseException:
            self.pool.add_actor_back_to_pool(future)
            raise
        self.pool.add_actor_back_to_pool(future)
        return reply, updated


def install() -> None:
    """Make Flower's simulation engine build `SurvivingRayBackend`: it imports `RayBackend` from
    this module when it starts a run (`start_vce` in `flwr/server/superlink/fleet/vce/vce_api.py`)."""
    raybackend.RayBackend = SurvivingRayBackend  # type: ignore[misc]
