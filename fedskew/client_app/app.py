"""The fedskew ClientApp: one `train` message per round, dispatched to the method's trainer.

Node config (simulation sets the first two): `partition-id`, `num-partitions`; optional in
deployment: `data-root` (this node's data files; without `num-partitions` they are the node's own
local data), `cache-dir` (where the node's slice is cached, see `fedskew.data.node`), `device`
("cpu", "cuda", "cuda:1"), `state-dir` (keep client state on disk). The same code runs in
simulation and deployment.

Every train reply also reports `participations`: how many rounds this client has trained in this
run, counted in its persistent state (a cheap check that the state survives between messages): the
rounds it trained in, each from 1 to this round, at most one per message the run can have sent it
before (`most_trainings`); a record of another form counts as lost and the count starts again.
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedskew.client_app.base import BaseTrainer, TrainerContext
from fedskew.client_app.state import ClientState, ListOf, most_trainings
from fedskew.config import validate
from fedskew.data.clients import load_test_set
from fedskew.data.node import load_node_data, node_data_spec
from fedskew.records import Number, check_config
from fedskew.registry import get_method
from fedskew.training import pick_device, round_lr, seed_everything
from fedskew.wire import CONFIG, round_config

log = logging.getLogger("fedskew.client")
app = ClientApp()


PARTICIPATION = "fedskew-participation"


def node_partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config (num-partitions 0: the node's own data)."""
    spec = node_data_spec(context.node_config, validate(dict(context.run_config)))
    return spec.partition_id, spec.num_partitions


def make_state(context: Context, cfg: dict[str, Any], partition_id: int) -> ClientState:
    state_dir = context.node_config.get("state-dir")
    directory = f"{state_dir}/run-{context.run_id}/partition-{partition_id}" if state_dir else None
    return ClientState(context.state, cfg["state-max-mb"], partition_id, directory)


def this_machine() -> str:
    """Where this client runs, for the reason the server logs when it fails: its Ray node's address
    in a simulation (on a Ray cluster, each node reads the data set from its own disk), else the
    host's name (a SuperNode)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return f"Ray node {ray.util.get_node_ip_address()}"
    return f"host {socket.gethostname()}"


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node serves (node IDs are random per run)."""
    pid, num = node_partition(context)
    return Message(RecordDict({"info": ConfigRecord({"partition-id": pid, "num-partitions": num})}), reply_to=msg)


def client_trainer(msg: Message, context: Context, set_threads: bool = True) -> BaseTrainer:
    """The method's trainer for a train message, after the checks and the seeding of the round: the
    run config, the node's data, the round config (before the round seeds anything), the round's lr,
    `seed_everything(seed, partition, round)` (its generator orders the mini-batches) and, with
    `set_threads`, `torch-threads` (the batched engine keeps its own)."""
    cfg = validate(dict(context.run_config))
    try:
        spec, data = load_node_data(cfg, context.node_config)
    except FileNotFoundError as e:  # the data set is not on this machine: say which one (first: reasons are cut)
        raise type(e)(f"on {this_machine()}: {e}") from None
    pid = spec.partition_id
    check_config(msg.content.get(CONFIG), round_config(cfg), CONFIG)  # before the round seeds anything
    server_round = msg.content[CONFIG]["server-round"]
    cfg["lr"] = round_lr(cfg, server_round)  # every method's local lr
    generator = seed_everything(cfg["seed"], pid, server_round)
    if set_threads and cfg["torch-threads"] > 0:
        torch.set_num_threads(cfg["torch-threads"])
    device = pick_device(str(context.node_config.get("device", cfg["device"])))
    ctx = TrainerContext(
        cfg=cfg,
        data=data,
        device=device,
        state=make_state(context, cfg, pid),
        partition_id=pid,
        server_round=server_round,
        generator=generator,
        central_test=load_test_set(cfg, spec.data_root) if cfg["personalized-central-eval"] else None,
    )
    return get_method(cfg["method"]).trainer_class()(ctx)


def train_reply(trainer: BaseTrainer, msg: Message, content: RecordDict) -> Message:
    """The reply to `msg` with the trained `content`, after counting this round among the client's
    participations (`participations`, module docstring)."""
    ctx = trainer.ctx
    most = most_trainings(ctx.cfg, ctx.server_round) - 1  # before this round's training
    seen = ctx.state.load_values(PARTICIPATION, {"rounds": ListOf(Number(int, 1, ctx.server_round), most)})
    seen = seen or {"rounds": []}
    seen["rounds"] = [*seen.get("rounds", []), ctx.server_round]
    ctx.state.save_values(PARTICIPATION, seen)
    content["metrics"]["participations"] = len(seen["rounds"])
    return Message(content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    trainer = client_trainer(msg, context)
    return train_reply(trainer, msg, trainer.fit(msg.content))
