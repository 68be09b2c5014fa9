"""Many runs in one process: their ServerApps take turns, their clients train together.

Each run (a suite's cell) keeps what it has when it runs alone on the batched engine: its own
ServerApp `main` (strategy, seed, records, run folder), its own nodes and their client state, its
own `BatchedExecutor` (`RunGrid`, a `BatchedGrid`). What they share is one `StackedTrainer`: a
round's train messages of every running run are gathered, and the clients whose local steps are the
same function (`fedskew.batched.executor.stack_key`: one method, network and SGD settings, the
per-client values as extras) train as one stacked model, whichever run they belong to.

Turns (`ManyRuns.run`): each ServerApp runs in a thread of its own, but one at a time. A run goes on
until it sends messages (`push_messages`) or ends; when every run has, the engine answers the
round: for each run in order its messages are prepared (`BatchedExecutor.prepare`: a message that
is not a train message, and every client of a method that is not stacked, answered there), then
the stacked clients of all runs are trained at once and their replies written; then each run gets
its turn again. One at a time, in a fixed order, the runs never race for the process's random
generators: each run's are saved when it yields and set back when it resumes, as they were when it
ran alone (python's, numpy's and torch's; the clients seed theirs per round), so a run among many
writes what it writes alone on the batched engine, to the last bits that the arithmetic's order and
MKL's alignment-dependent kernels leave (`tests/test_batched.py`, in float64).

Not batched yet: central evaluation, which each ServerApp does for its own model on its turn.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict

from fedskew.batched.executor import BatchedExecutor, StackedTrainer
from fedskew.batched.grid import RUN_ID, BatchedGrid
from fedskew.server_app.app import main

log = logging.getLogger("fedskew.client")


def rng_state() -> tuple:
    """The process's random generators: python's, numpy's, torch's (and CUDA's once it is in use)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_rng_state(state: tuple) -> None:
    py, np_state, torch_state, cuda = state
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class RunGrid(BatchedGrid):
    """A run's Grid among many: `push_messages` hands the messages to the engine and waits for its
    turn to come back with the replies (`ManyRuns`)."""

    def __init__(self, num_nodes: int, run_config: Mapping[str, Any], engine: ManyRuns, run: int) -> None:
        super().__init__(num_nodes, run_config, BatchedExecutor(run_config, engine.trainer))
        self.engine, self.index = engine, run

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"batched-{next(self._ids)}"  # as a SuperLink sets it
        for reply in self.engine.answer(self.index, messages):
            self._replies[reply.metadata.reply_to_message_id] = reply
        return [m.metadata.message_id for m in messages]


@dataclass
class Turn:
    """One run's thread and where it stands."""

    grid: RunGrid
    config: dict[str, Any]
    go: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    pending: list[Message] | None = None  # the messages it waits on (None: running or ended)
    replies: list[Message] = field(default_factory=list)
    rng: tuple | None = None  # its generators' state while it waits
    done: bool = False
    error: BaseException | None = None
    seconds: float = 0.0


class ManyRuns:
    """Runs `configs` (complete run configs, each with its `out-dir` and `run-name`) with
    `nodes[i]` nodes each, in this process (module docstring); `run()` returns each run's error
    (None: it finished)."""

    def __init__(self, configs: Sequence[Mapping[str, Any]], nodes: Sequence[int], trainer: StackedTrainer) -> None:
        self.trainer = trainer
        self.back = threading.Semaphore(0)  # a run yielded (sent messages, or ended)
        self.turns = [
            Turn(RunGrid(n, cfg, self, i), dict(cfg)) for i, (cfg, n) in enumerate(zip(configs, nodes, strict=True))
        ]

    def answer(self, run: int, messages: list[Message]) -> list[Message]:
        """Called on run `run`'s thread: wait for the engine to answer `messages` (module docstring)."""
        turn = self.turns[run]
        turn.pending = messages
        turn.rng = rng_state()
        self.back.release()
        turn.go.acquire()
        set_rng_state(turn.rng)
        replies, turn.replies = turn.replies, []
        return replies

    def thread(self, turn: Turn) -> None:
        turn.go.acquire()
        t0 = time.perf_counter()
        try:
            context = Context(run_id=RUN_ID, node_id=0, node_config={}, state=RecordDict(), run_config=turn.config)
            main(turn.grid, context)
        except BaseException as e:  # a run that fails ends alone, its error returned
            turn.error = e
        finally:
            turn.seconds += time.perf_counter() - t0
            turn.done = True
            self.back.release()

    def resume(self, turn: Turn) -> None:
        """Give `turn` the process until it sends messages again or ends."""
        turn.pending = None
        turn.go.release()
        self.back.acquire()

    def run(self) -> list[BaseException | None]:
        threads = [threading.Thread(target=self.thread, args=(t,), daemon=True) for t in self.turns]
        for th in threads:
            th.start()
        for turn in self.turns:
            self.resume(turn)
        while live := [t for t in self.turns if not t.done]:
            self.round(live)
            for turn in live:
                self.resume(turn)
        for th in threads:
            th.join()
        return [t.error for t in self.turns]

    def round(self, live: list[Turn]) -> None:
        """Answer every waiting run's messages: each prepared on its own generators' state (as
        when it runs alone), then all stacked clients trained together."""
        prepared, stacked = [], []
        for turn in live:
            set_rng_state(turn.rng)
            replies, clients = turn.grid.executor.prepare(turn.pending or [], turn.grid.contexts, turn.grid.index)
            turn.rng = rng_state()  # what the run's prepare left, as its own executor would
            prepared.append(replies)
            stacked += clients
        trained = self.trainer.train(stacked)
        for turn, replies in zip(live, prepared, strict=True):
            replies.update({i: reply for (run, i), reply in trained.items() if run == turn.grid.index})
            turn.replies = [replies[i] for i in sorted(replies)]


def run_many(
    configs: Sequence[Mapping[str, Any]], nodes: Sequence[int], device: torch.device, chunk: int = 0
) -> list[BaseException | None]:
    """Run the runs of `configs` together (`ManyRuns`) on `device`; each run's error (None: done)."""
    return ManyRuns(configs, nodes, StackedTrainer(device, chunk)).run()


def summary_of(config: Mapping[str, Any]) -> Path:
    return Path(config["out-dir"]) / str(config["run-name"]) / "summary.json"
