"""The fedskew ClientApp: one `train` message per round, dispatched to the method's trainer.

Node config (simulation sets the first two): `partition-id`, `num-partitions`; optional in
deployment: `device` ("cpu", "cuda", "cuda:1"), `state-dir` (keep client state on disk).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedskew.client_app.fedavg import TrainerContext
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.data.clients import load_client_data
from fedskew.registry import get_method
from fedskew.training import pick_device, seed_everything

log = logging.getLogger("fedskew.client")
app = ClientApp()


def node_partition(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config, with a clear error if absent."""
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError as e:
        raise KeyError(
            f"node config lacks {e.args[0]!r}: start the SuperNode with --node-config 'partition-id=0 num-partitions=2'"
        ) from None


def make_state(context: Context, cfg: dict[str, Any], partition_id: int) -> ClientState:
    state_dir = context.node_config.get("state-dir")
    directory = f"{state_dir}/run-{context.run_id}/partition-{partition_id}" if state_dir else None
    return ClientState(context.state, cfg["state-max-mb"], partition_id, directory)


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Tell the server which partition this node serves (node IDs are random per run)."""
    pid, num = node_partition(context)
    return Message(RecordDict({"info": ConfigRecord({"partition-id": pid, "num-partitions": num})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = validate(dict(context.run_config))
    pid, num = node_partition(context)
    server_round = int(msg.content["config"]["server-round"])
    generator = seed_everything(cfg["seed"], pid, server_round)
    if cfg["torch-threads"] > 0:
        torch.set_num_threads(cfg["torch-threads"])
    device = pick_device(str(context.node_config.get("device", cfg["device"])))
    ctx = TrainerContext(
        cfg=cfg,
        data=load_client_data(cfg, pid, num),
        device=device,
        state=make_state(context, cfg, pid),
        partition_id=pid,
        server_round=server_round,
        generator=generator,
    )
    trainer = get_method(cfg["method"]).trainer_class()(ctx)
    return Message(trainer.fit(msg.content), reply_to=msg)
