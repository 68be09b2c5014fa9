"""An in-process Grid: runs the real ServerApp `main` against the real ClientApp, node by node,
without Ray or a SuperLink (fast, deterministic), with optional fault injection per
(partition, round)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch
from flwr.app import Context, Error, Message, RecordDict

from fedskew.client_app.app import app as client_app
from fedskew.server_app.app import main as server_main

ROOT = Path(__file__).resolve().parent.parent
Fault = Callable[[Message, Message], Message | None]  # (request, reply) -> replacement reply, or None to drop


def app_defaults() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


class InProcessGrid:
    """`get_node_ids` / `send_and_receive` over `num_nodes` ClientApp contexts that keep state."""

    def __init__(
        self,
        num_nodes: int,
        run_config: dict[str, Any],
        faults: dict[tuple[int, int], Fault] | None = None,
        num_partitions: int | None = None,
        extra_nodes: dict[int, dict[str, Any]] | None = None,
        node_config: dict[str, Any] | None = None,
    ):
        """Node i serves partition i of `num_partitions` (default: one partition per node); every
        such node's config adds `node_config` (e.g. a `state-dir` that outlives the grid);
        `extra_nodes` adds nodes by id with their own node config (ids below 1000 answer first)."""
        self.run_config = run_config
        self.faults = faults or {}
        configs = {
            1000 + 17 * i: {"partition-id": i, "num-partitions": num_partitions or num_nodes, **(node_config or {})}
            for i in range(num_nodes)
        }
        configs = dict(sorted({**configs, **(extra_nodes or {})}.items()))
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config=nc, state=RecordDict(), run_config=run_config)
            for nid, nc in configs.items()
        }
        self.sent: list[Message] = []
        self._ids = itertools.count(1)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"  # normally set by the SuperLink
            self.sent.append(msg)
            ctx = self.contexts[msg.metadata.dst_node_id]
            try:
                reply = client_app(msg, ctx)
            except Exception as e:  # what the runtime does with a ClientApp exception
                reply = Message(Error(code=0, reason=f"{type(e).__name__}: {e}"), reply_to=msg)
            if msg.metadata.message_type == "train":
                key = (int(ctx.node_config["partition-id"]), int(msg.content["config"]["server-round"]))
                if key in self.faults:
                    reply = self.faults[key](msg, reply)
            if reply is not None:
                replies.append(reply)
        return replies


def run_in_process(
    overrides: dict[str, Any],
    num_nodes: int,
    faults: dict | None = None,
    num_partitions: int | None = None,
    extra_nodes: dict[int, dict[str, Any]] | None = None,
    node_config: dict[str, Any] | None = None,
) -> InProcessGrid:
    """Run the whole ServerApp main in this process; returns the grid (its contexts hold client state)."""
    cfg = {**app_defaults(), **overrides}
    grid = InProcessGrid(num_nodes, cfg, faults, num_partitions, extra_nodes, node_config)
    server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    return grid


def crash(msg: Message, reply: Message) -> Message:
    """A fault: the client's reply becomes an error (the round's work is lost)."""
    return Message(Error(code=0, reason="RuntimeError: injected client crash"), reply_to=msg)


def resumed_run_equals_full_run(
    out: Path, overrides: dict[str, Any], num_nodes: int = 4, num_partitions: int = 50, state_dir: bool = False
) -> Path:
    """Run `overrides` for 3 rounds at once ('full'), and again with every client crashing in round 3
    after the round-2 checkpoint ('cut'), then resume 'cut'; assert both end with the same
    metrics.jsonl and model.pt. `state_dir`: the nodes keep client state on disk (one directory per
    run, kept across the crash), so that it outlives the grid as a SuperNode's state-dir does.
    Returns the full run's directory."""
    cfg = {
        "model": "mlp",
        "partition": "iid",
        "fraction-train": 1.0,
        "num-server-rounds": 3,
        "checkpoint-every": 1,
        "round-retries": 0,
        "out-dir": str(out),
        **overrides,
    }

    def run(name: str, faults: dict | None = None, **extra: Any) -> None:
        node_config = {"state-dir": str(out / f"{name}-state")} if state_dir else None
        run_in_process({**cfg, "run-name": name, **extra}, num_nodes, faults, num_partitions, node_config=node_config)

    run("full")
    with pytest.raises(RuntimeError):
        run("cut", {(p, 3): crash for p in range(num_nodes)})
    run("cut", resume=True)
    full, cut = out / "full", out / "cut"
    assert (cut / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    a, b = torch.load(full / "model.pt", weights_only=True), torch.load(cut / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return full
