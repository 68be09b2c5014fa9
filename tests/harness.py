"""An in-process Grid: runs the real ServerApp `main` against the real ClientApp, node by node,
without Ray or a SuperLink (fast, deterministic), with optional fault injection per
(partition, round), and rounds in which no node can be reached."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import tomllib
import torch
from flwr.app import Context, Error, Message, RecordDict

from fedskew.client_app.app import app as client_app
from fedskew.client_app.base import TrainerContext
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.data.clients import ClientData
from fedskew.registry import get_method
from fedskew.run.experiments import stopped_round
from fedskew.run.node_states import drop_node_states, load_node_states, save_node_states
from fedskew.server_app.app import main as server_main
from fedskew.server_app.results import resumed_rounds

ROOT = Path(__file__).resolve().parent.parent
Fault = Callable[[Message, Message], Message | None]  # (request, reply) -> replacement reply, or None to drop
# clients in float64 (`compute-dtype`), to compare a trainer with a reference written out in float64;
# its reply's arrays are rounded to float32 (the wire's dtype): one rounding (2^-24 relative) apart
IN_FLOAT64 = {"compute-dtype": "float64"}
WIRE_ROUNDING = {"rtol": 2.0**-23, "atol": 1e-9}
FLOAT64 = {"rtol": 1e-9, "atol": 1e-12}  # float64 kept state, never rounded to float32


def float32_ratio_rtol(terms: int, averaged: int = 0) -> float:
    """Relative gap allowed between two float32 evaluations of a ratio of two sums of `terms`
    non-negative terms, summed in any order: each sum lies within (terms - 1) u of its value
    (u = 2^-24), so each ratio within 2 terms u and the two within 4 terms u; a float32 mean over
    `averaged` such ratios adds 2 u each (BAVD's dropped mass, `dropped_fractions`)."""
    return (4 * terms + 2 * averaged) * 2.0**-24


def assert_float64_runs_match(got: Path, want: Path, rounds: int) -> None:
    """Two float64 runs' `metrics.jsonl` (`compute-dtype`) hold the same `rounds` rows and keys and
    every value to float64's roundings (FLOAT64; a count or an accuracy's 1/n is then equal): the
    arithmetic's order and MKL's kernels, which round with the buffers' alignment, may move last bits."""
    import pytest  # late: the benchmarks import this module where pytest is not installed

    from tests.conftest import read_metrics

    rows = [read_metrics(got), read_metrics(want)]
    assert [r.keys() for r in rows[0]] == [r.keys() for r in rows[1]] and len(rows[1]) == rounds, (got, want)
    for a, b in zip(*rows, strict=True):
        for key, value in b.items():
            assert a[key] == pytest.approx(value, rel=FLOAT64["rtol"], abs=FLOAT64["atol"]), (got, a["round"], key)


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
        keep_node_states: bool = False,
    ):
        """Node i serves partition i of `num_partitions` (default: one partition per node); every
        such node's config adds `node_config` (e.g. a `state-dir` that outlives the grid);
        `extra_nodes` adds nodes by id with their own node config (ids below 1000 answer first).
        `keep_node_states`: each run on this grid keeps its nodes' states at its checkpoint rounds
        and a resume puts them back (`fedskew.run.node_states`)."""
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
        self.unreachable: set[int] = set()  # rounds whose train messages reach no node (the SuperLink answers)
        self._ids = itertools.count(1)
        self.keep_node_states = keep_node_states
        self._run_dir: Path | None = None  # the run whose nodes' states are kept
        self._kept = 0  # the last round whose nodes' states are kept
        self._clear_above: int | None = None  # at the run's first message, kept states after this round go
        self._cfg: dict[str, Any] = {}  # the run's validated config
        self.node_states_restored: int | None = None  # the round whose states a resume put back (the server reads it)

    def start_run(self, run_config: dict[str, Any]) -> None:
        """Before a run under `run_config`: with `keep_node_states`, note its folder and, on a
        resume, put back its nodes' states at the checkpoint's round. A method whose clients keep
        state is refused there without them (its resumed rounds would differ); another resumes
        without them, as on Flower's runtime."""
        self._run_dir, self.node_states_restored = None, None
        if not self.keep_node_states:
            return
        self._cfg = cfg = validate(run_config)
        if not cfg["checkpoint-every"]:
            return
        if not cfg["run-name"] or any("state-dir" in c.node_config for c in self.contexts.values()):
            raise ValueError("keep_node_states needs a run-name and nodes without a state-dir")
        self._run_dir = Path(cfg["out-dir"]).expanduser().absolute() / cfg["run-name"]
        self._kept = self._clear_above = 0
        if not (cfg["resume"] and (stopped := stopped_round(self._run_dir, cfg))):
            return
        try:
            states = load_node_states(self._run_dir, stopped, cfg, self.contexts)
        except ValueError as e:
            if note := get_method(cfg["method"]).resume_note(cfg):
                raise RuntimeError(f"cannot resume after round {stopped}: {note}, and {e}") from None
            return
        for node, state in states.items():
            self.contexts[node].state = state
        self._kept = self.node_states_restored = self._clear_above = stopped

    def _keep_states(self, messages: list[Message]) -> None:
        """At the first train message of round R + 1, R a checkpoint round: keep the nodes' states (the
        server writes that checkpoint while round R + 1 trains)."""
        if self._run_dir is None:
            return
        if self._clear_above is not None:
            # the server has taken the run: states kept by an earlier run, or of rounds it computes again, go
            drop_node_states(self._run_dir, after=self._clear_above)
            self._clear_above = None
        cfg = self._cfg
        rounds = [int(m.content["config"]["server-round"]) for m in messages if m.metadata.message_type == "train"]
        done = max(rounds, default=0) - 1
        if done <= self._kept or done % cfg["checkpoint-every"]:
            return
        save_node_states(self._run_dir, done, cfg, {node: ctx.state for node, ctx in self.contexts.items()})
        self._kept = done

    def end_run(self) -> None:
        """After a finished run: its nodes' states are no longer needed."""
        if self._run_dir is not None and (self._run_dir / "summary.json").is_file():
            drop_node_states(self._run_dir)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        self._keep_states(messages)
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"  # normally set by the SuperLink
            self.sent.append(msg)
            ctx = self.contexts[msg.metadata.dst_node_id]
            if msg.metadata.message_type == "train" and msg.content["config"]["server-round"] in self.unreachable:
                replies.append(Message(Error(code=0, reason="node unreachable"), reply_to=msg))
                continue
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


def labelled_images(
    classes: tuple[int, ...], n: int, n_test: int, noise: float = 0.5, shift: float = 0.2, seed: int = 0
) -> ClientData:
    """A client's data of 1x28x28 images: `n` examples cycling through `classes`, each Gaussian noise
    (std `noise`) plus `shift` times its label, the last `n_test` held out as its test split."""
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(list(classes) * (n // len(classes)))
    x = noise * torch.randn(len(y), 1, 28, 28, generator=g) + shift * y.view(-1, 1, 1, 1).float()
    k = len(y) - n_test
    return ClientData(x[:k], y[:k], x[k:], y[k:], 10)


def trainer_context(
    cfg: dict[str, Any],
    data: ClientData,
    state: RecordDict | None = None,
    partition_id: int = 0,
    server_round: int = 1,
    generator: torch.Generator | None = None,
) -> TrainerContext:
    """A trainer's context on CPU, as the ClientApp builds it: the client's persistent state under the
    config's `state-max-mb`, a generator seeded by the round unless one is given."""
    return TrainerContext(
        cfg=cfg,
        data=data,
        device=torch.device("cpu"),
        state=ClientState(RecordDict() if state is None else state, cfg["state-max-mb"], partition_id),
        partition_id=partition_id,
        server_round=server_round,
        generator=generator or torch.Generator().manual_seed(server_round),
    )


def mean_node_state(
    grid: InProcessGrid, name: str, like: dict[str, torch.Tensor], server_round: int, num_partitions: int
) -> tuple[dict[str, torch.Tensor], int]:
    """The mean over `num_partitions` of the tensors each of `grid`'s nodes keeps under `name`
    (`ClientState.load_round_tensors`; a partition without them counts as 0, as a server state
    initialised at 0 counts it), and how many nodes keep them."""
    states = [ClientState(c.state, 64, 0).load_round_tensors(name, like, server_round) for c in grid.contexts.values()]
    held = [s for s in states if s is not None]
    return {k: sum(s[k] for s in held) / num_partitions for k in like}, len(held)


def run_in_process(
    overrides: dict[str, Any],
    num_nodes: int,
    faults: dict | None = None,
    num_partitions: int | None = None,
    extra_nodes: dict[int, dict[str, Any]] | None = None,
    node_config: dict[str, Any] | None = None,
    keep_node_states: bool = False,
) -> InProcessGrid:
    """Run the whole ServerApp main in this process; returns the grid (its contexts hold client state).
    `keep_node_states`: as `InProcessGrid`'s (a cell of a suite that may resume)."""
    grid = InProcessGrid(num_nodes, {}, faults, num_partitions, extra_nodes, node_config, keep_node_states)
    run_on(grid, overrides)
    return grid


def run_on(grid: InProcessGrid, overrides: dict[str, Any]) -> None:
    """Run the ServerApp main against `grid`'s nodes, which keep their client state between runs."""
    cfg = {**app_defaults(), **overrides}
    grid.run_config = cfg
    for ctx in grid.contexts.values():
        ctx.run_config = cfg
    grid.start_run(cfg)
    server_main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    grid.end_run()


def cut_and_resume(
    out: Path, overrides: dict[str, Any], num_nodes: int = 4, num_partitions: int | None = 50, rounds: int = 2
) -> tuple[Path, Path, InProcessGrid]:
    """(an uninterrupted run's folder, the same run's folder after a cut and a resume, the grid of the
    uninterrupted run), after asserting that both runs end with the same `metrics.jsonl` and
    `model.pt` (where the method writes one): the second run reaches no node in its last round and
    stops (`round-retries=0`), then `--resume`s from its checkpoint of the round before against the
    same nodes, which kept their client state as SuperNodes do. Defaults: mlp, iid, every client each round."""
    base = {"model": "mlp", "partition": "iid", "fraction-train": 1.0}
    cfg = {**base, **overrides, "num-server-rounds": rounds, "checkpoint-every": 1, "round-retries": 0}
    cfg["out-dir"] = str(out)
    full = run_in_process({**cfg, "run-name": "full"}, num_nodes, None, num_partitions)
    grid = InProcessGrid(num_nodes, {}, None, num_partitions)
    grid.unreachable = {rounds}
    try:
        run_on(grid, {**cfg, "run-name": "cut"})
    except RuntimeError as e:
        assert f"round {rounds}: only 0 usable replies" in str(e), e
    else:
        raise AssertionError("the cut run did not stop")
    grid.unreachable = set()
    run_on(grid, {**cfg, "run-name": "cut", "resume": True})
    assert (out / "cut" / "metrics.jsonl").read_text() == (out / "full" / "metrics.jsonl").read_text()
    assert resumed_rounds(out / "cut") == [rounds - 1] and resumed_rounds(out / "full") == []
    written = [(out / name / "model.pt").is_file() for name in ("full", "cut")]
    assert written[0] == written[1], written  # none for a method without a global model (FedProto, FedRep)
    if written[0]:
        a, b = (torch.load(out / name / "model.pt", weights_only=True) for name in ("full", "cut"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return out / "full", out / "cut", full
