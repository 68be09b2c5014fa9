"""The nodes' client states at a checkpoint's round, kept by an in-process engine so that a resumed
run of a method whose clients keep state (SCAFFOLD's c_i, MOON's previous model, Ditto's personal
model...) equals the uninterrupted run.

A resumed Flower run starts its nodes with empty contexts, so such a method cannot resume there
(`MethodSpec.resume_note`: the suite starts it afresh). An engine that holds the nodes' contexts itself
(`tests.harness.InProcessGrid`) can do better: at the first message of round R + 1, when R is a
checkpoint round, it writes every node's `context.state` as it stood after round R into
`node-states-r<R>.pt` in the run folder, and a resume from the checkpoint of round R puts them back.
The server writes that checkpoint while round R + 1 trains (`EvaluatedRound.finish`), so the states
of the checkpoint round before stay until the next one is written: two files at most.

A file is read as hostile: `torch.load(weights_only=True)`, its round, its nodes and its config
(compared as a resume compares `config.json`: `config_changes`) must be this run's, and each state
must parse as a Flower RecordDict; anything else raises ValueError naming the file and what is wrong,
and the cell starts afresh instead of resuming with states of another run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import RecordDict
from flwr.common.serde import ProtoRecordDict, recorddict_from_proto, recorddict_to_proto

from fedskew.files import atomic_write
from fedskew.server_app.results import config_changes, saved_config

PATTERN = re.compile(r"node-states-r(\d+)\.pt")


def node_states_path(run_dir: Path, server_round: int) -> Path:
    """Where the nodes' states after round `server_round` are kept."""
    return Path(run_dir) / f"node-states-r{server_round}.pt"


def kept_rounds(run_dir: Path) -> list[int]:
    """The rounds whose nodes' states `run_dir` holds, in order."""
    found = (PATTERN.fullmatch(p.name) for p in Path(run_dir).glob("node-states-r*.pt"))
    return sorted(int(m.group(1)) for m in found if m)


def save_node_states(
    run_dir: Path, server_round: int, cfg: Mapping[str, Any], states: Mapping[int, RecordDict], keep: int = 2
) -> Path:
    """Write the nodes' `states` (node id -> context.state) after round `server_round` atomically,
    then remove those of later rounds (an earlier run's, or of rounds a resume computes again) and
    all but the newest `keep`; the file written."""
    blob = {
        "round": server_round,
        "config": json.dumps(saved_config(cfg), sort_keys=True),
        "nodes": {
            str(node): _bytes_tensor(recorddict_to_proto(state).SerializeToString()) for node, state in states.items()
        },
    }
    path = node_states_path(run_dir, server_round)
    atomic_write(path, lambda f: torch.save(blob, f))
    drop_node_states(run_dir, after=server_round)
    for r in kept_rounds(run_dir)[:-keep]:
        node_states_path(run_dir, r).unlink(missing_ok=True)
    return path


def drop_node_states(run_dir: Path, after: int = 0) -> None:
    """Remove the nodes' states `run_dir` keeps of the rounds after `after` (0: all)."""
    for r in kept_rounds(run_dir):
        if r > after:
            node_states_path(run_dir, r).unlink(missing_ok=True)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """`data` as a 1-d uint8 tensor (an empty state serialises to no bytes)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_node_states(
    run_dir: Path, server_round: int, cfg: Mapping[str, Any], node_ids: Iterable[int] | None = None
) -> dict[int, RecordDict]:
    """The states `save_node_states` kept after round `server_round` for the nodes `node_ids` (None:
    those the file holds) of a run under `cfg`; ValueError naming the file when there are none or
    they are not this run's."""
    path = node_states_path(run_dir, server_round)
    if not path.is_file():
        raise ValueError(f"{path} is missing: the nodes' states after round {server_round} were not kept")
    try:
        blob = torch.load(path, weights_only=True)
    except Exception as e:  # a damaged file: pickle, zip, EOF or torch errors alike
        raise ValueError(f"{path} does not load: {type(e).__name__}: {e}") from None
    if not isinstance(blob, dict) or set(blob) != {"round", "config", "nodes"}:
        raise ValueError(f"{path}: not a file of the nodes' states (keys round, config, nodes)")
    if type(blob["round"]) is not int or blob["round"] != server_round:
        raise ValueError(f"{path}: holds round {blob['round']!r}, not {server_round}")
    try:
        saved = json.loads(blob["config"])
        changes = config_changes(saved, cfg) if isinstance(saved, dict) else ["not a JSON object"]
    except (TypeError, ValueError) as e:
        changes = [f"unreadable ({e})"]
    if changes:
        raise ValueError(f"{path}: kept by a run of another config: {', '.join(map(str, changes))}")
    nodes = blob["nodes"]
    if not isinstance(nodes, dict) or not all(isinstance(n, str) and n.isdigit() for n in nodes):
        raise ValueError(f"{path}: not a map of node ids to states")
    wanted = sorted(int(n) for n in (nodes if node_ids is None else node_ids))
    if sorted(nodes) != sorted(map(str, wanted)):
        raise ValueError(f"{path}: holds nodes {sorted(map(int, nodes))}, not {wanted}")
    states = {}
    for node in wanted:
        data = nodes[str(node)]
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(f"{path}: node {node}'s state is not a byte tensor")
        try:
            states[node] = recorddict_from_proto(ProtoRecordDict.FromString(data.numpy().tobytes()))
        except Exception as e:  # protobuf's DecodeError, or records Flower refuses
            raise ValueError(f"{path}: node {node}'s state does not parse: {type(e).__name__}: {e}") from None
    return states
