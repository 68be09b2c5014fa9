"""The nodes' states an in-process engine keeps at checkpoint rounds: read back as written, and
refused, naming the file and the fault, when they are not this run's."""

from __future__ import annotations

import shutil

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedskew.config import validate
from fedskew.run.node_states import kept_rounds, load_node_states, node_states_path, save_node_states
from tests.harness import app_defaults


@pytest.fixture
def cfg():
    return validate(app_defaults())


def states() -> dict[int, RecordDict]:
    g = torch.Generator().manual_seed(0)
    full = RecordDict(
        {
            "model": ArrayRecord({"w": torch.randn(3, 2, generator=g), "n": torch.tensor(7, dtype=torch.int64)}),
            "seen": ConfigRecord({"rounds": [1, 3], "text": "x"}),
            "loss": MetricRecord({"last": 0.25}),
        }
    )
    return {1000: full, 1017: RecordDict()}


def test_states_read_back_as_written_and_only_the_newest_two_stay(tmp_path, cfg) -> None:
    for r in (2, 4, 6):
        save_node_states(tmp_path, r, cfg, states())
    assert kept_rounds(tmp_path) == [4, 6]
    save_node_states(tmp_path, 2, cfg, states())  # a new run, or a resume from round 2: 4 and 6 are not its
    assert kept_rounds(tmp_path) == [2]
    for r in (4, 6):
        save_node_states(tmp_path, r, cfg, states())
    back = load_node_states(tmp_path, 6, cfg, [1017, 1000])
    assert len(back[1017]) == 0
    a, b = back[1000]["model"].to_torch_state_dict(), states()[1000]["model"].to_torch_state_dict()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in b) and a.keys() == b.keys()
    assert dict(back[1000]["seen"]) == {"rounds": [1, 3], "text": "x"} and dict(back[1000]["loss"]) == {"last": 0.25}
    assert load_node_states(tmp_path, 4, cfg).keys() == {1000, 1017}  # None: the file's own nodes


def test_states_of_another_round_nodes_or_config_are_refused(tmp_path, cfg) -> None:
    save_node_states(tmp_path, 2, cfg, states())
    path = node_states_path(tmp_path, 4)
    shutil.copy(node_states_path(tmp_path, 2), path)
    with pytest.raises(ValueError, match=r"node-states-r4.pt: holds round 2, not 4"):
        load_node_states(tmp_path, 4, cfg)
    with pytest.raises(ValueError, match=r"holds nodes \[1000, 1017\], not \[1000, 1034\]"):
        load_node_states(tmp_path, 2, cfg, [1000, 1034])
    with pytest.raises(ValueError, match="kept by a run of another config: local-epochs"):
        load_node_states(tmp_path, 2, {**cfg, "local-epochs": cfg["local-epochs"] + 1})
    with pytest.raises(ValueError, match=r"node-states-r6\.pt is missing"):
        load_node_states(tmp_path, 6, cfg)


@pytest.mark.parametrize(
    ("blob", "fault"),
    [
        ([1, 2], "not a file of the nodes' states"),
        ({"round": 2.0, "config": "{}", "nodes": {}}, "holds round 2.0, not 2"),
        ({"round": 2, "config": "[", "nodes": {}}, "kept by a run of another config: unreadable"),
        ({"round": 2, "config": "KEEP", "nodes": {"x": torch.zeros(1, dtype=torch.uint8)}}, "not a map of node ids"),
        ({"round": 2, "config": "KEEP", "nodes": {"5": torch.zeros(2)}}, "node 5's state is not a byte tensor"),
        ({"round": 2, "config": "KEEP", "nodes": {"5": torch.full((9,), 255, dtype=torch.uint8)}}, "does not parse"),
    ],
)
def test_a_hostile_file_is_refused_naming_the_fault(tmp_path, cfg, blob, fault) -> None:
    save_node_states(tmp_path, 2, cfg, {})
    path = node_states_path(tmp_path, 2)
    if isinstance(blob, dict) and blob["config"] == "KEEP":
        blob["config"] = torch.load(path, weights_only=True)["config"]
    torch.save(blob, path)
    with pytest.raises(ValueError, match=fault):
        load_node_states(tmp_path, 2, cfg)
