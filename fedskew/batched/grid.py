"""The batched engine's Grid and entry point: the real ServerApp `main` in this process, its messages
answered by `BatchedExecutor` for in-process nodes.

`BatchedGrid` is a Flower `Grid`: `push_messages` hands a round's messages to the executor at once
(a round's train messages are trained together) and keeps the replies, `pull_messages` returns them.
Node i serves partition i of `num_nodes` (node config `partition-id`, `num-partitions`, as Flower's
simulation sets them) and keeps its `Context` (the client state) for the whole run. Nothing waits:
`round-timeout` does not apply, every reply is there when the round's messages have been run.
Flower's console log colours its level names only where it writes to a terminal (`plain_log`): a
log piped into a file or `tee` holds no escape codes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from flwr.app import Context, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedskew.batched.executor import BatchedExecutor
from fedskew.config import ConfigError
from fedskew.resources import available_cores
from fedskew.schema import RunFailed
from fedskew.server_app.app import main
from fedskew.training import torch_threads

FIRST_NODE_ID = 1000  # node i is FIRST_NODE_ID + i (Flower's are random: nothing may depend on them)
RUN_ID = 1


class BatchedGrid(Grid):
    """A Grid over `num_nodes` in-process nodes whose messages `BatchedExecutor` answers."""

    # read by the ServerApp `main` (which does not import this engine): engine='batched' runs here
    batched_engine: ClassVar[bool] = True

    def __init__(self, num_nodes: int, run_config: Mapping[str, Any], executor: BatchedExecutor | None = None) -> None:
        self.executor = executor or BatchedExecutor(run_config)
        self.contexts = {
            FIRST_NODE_ID + i: Context(
                run_id=RUN_ID,
                node_id=FIRST_NODE_ID + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for i in range(num_nodes)
        }
        self._run = Run.create_empty(RUN_ID)
        self._replies: dict[str, Message] = {}
        self._ids = itertools.count(1)

    @property
    def run(self) -> Run:
        return self._run

    def set_run(self, run: Run) -> None:
        self._run = run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run `messages` (all of them together) and keep their replies; their ids."""
        messages = list(messages)
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"batched-{next(self._ids)}"  # as a SuperLink sets it
        for reply in self.executor.run(messages, self.contexts):
            self._replies[reply.metadata.reply_to_message_id] = reply
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


@contextlib.contextmanager
def plain_log() -> Iterator[None]:
    """For the block, Flower's console handlers colour level names only on a terminal (they colour
    them whatever their stream is, and this engine's log is Flower's own, in this process)."""
    from flwr.common.logger import ConsoleHandler

    handlers = [h for h in logging.getLogger("flwr").handlers if isinstance(h, ConsoleHandler)]
    before = [h.colored for h in handlers]
    for h in handlers:
        h.colored = h.colored and callable(getattr(h.stream, "isatty", None)) and h.stream.isatty()
    try:
        yield
    finally:
        for h, colored in zip(handlers, before, strict=True):
            h.colored = colored


def run_batched(
    run_config: Mapping[str, Any], num_nodes: int, quiet: bool = False, threads: int | None = None
) -> dict[str, Any]:
    """Run the ServerApp `main` on a `BatchedGrid` of `num_nodes` nodes with `run_config` (complete,
    with `out-dir` and `run-name`: the app's defaults and the overrides, as
    `fedskew.run.launcher.prepare_config` makes them), with `threads` torch threads (default: one a
    core); its summary, or RunFailed with the reason. `quiet`: only warnings of the run's log."""
    # what Flower's runtime sets in a ServerApp process, so that the strategy can build its messages
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, RUN_ID, SUPERLINK_NODE_ID
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    if quiet:
        flwr_log.setLevel(logging.WARNING)
    try:
        with plain_log(), torch_threads(torch.device("cpu"), threads or available_cores()):
            grid = BatchedGrid(num_nodes, run_config)
            context = Context(run_id=RUN_ID, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config))
            main(grid, context)
    except ConfigError:
        raise
    except Exception as e:  # as a Flower run that failed: its reason, the results kept
        raise RunFailed(f"{type(e).__name__}: {e}") from e
    finally:
        flwr_log.setLevel(level)
    summary = Path(run_config["out-dir"]) / run_config["run-name"] / "summary.json"
    return json.loads(summary.read_text())
