"""Files: what fedskew reads back is verified, it deletes only its own files,
and what it writes reaches the disk before it replaces the old file."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import RecordDict

from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.data.node import load_node_data

CFG = validate({})
NODE = {"partition-id": 2, "num-partitions": 20}


def test_the_cache_deletes_only_its_own_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FEDSKEW_CACHE_MAX_MB", "0.001")  # room for no slice beyond the newest
    for name in ("unrelated.npz", "fashion-mnist-notes.npz", "fashion-mnist-p1of20-x.npz"):
        np.savez(tmp_path / name, a=np.zeros(10_000))
    for pid in (0, 1):
        load_node_data(CFG, {**NODE, "partition-id": pid, "cache-dir": str(tmp_path)})
    others = {"unrelated.npz", "fashion-mnist-notes.npz", "fashion-mnist-p1of20-x.npz"}
    left = {p.name for p in tmp_path.glob("*.npz")}
    (own,) = left - others  # of its own slices only the newest is left, and every other file
    assert others < left and own.startswith("fashion-mnist-p1of20-")


def test_a_tampered_cache_slice_is_never_used(tmp_path: Path, caplog) -> None:
    nc = {**NODE, "cache-dir": str(tmp_path)}
    _, good = load_node_data(CFG, nc)
    (path,) = tmp_path.glob("*.npz")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["y_train"] = np.full_like(arrays["y_train"], 77)  # labels rewritten, a valid npz file
    np.savez(path, **arrays)
    with caplog.at_level(logging.WARNING, logger="fedskew.client"):
        _, again = load_node_data(CFG, nc)
    assert torch.equal(again.y_train, good.y_train) and torch.equal(again.x_train, good.x_train)
    assert "digest" in caplog.text
    with np.load(next(tmp_path.glob("*.npz"))) as z:
        assert np.array_equal(z["y_train"], good.y_train.numpy())  # rewritten


def _truncate(path: Path, keep: float) -> None:
    path.write_bytes(path.read_bytes()[: int(keep * path.stat().st_size)])


def _flip(path: Path, at: float) -> None:
    blob = bytearray(path.read_bytes())
    blob[int(at * (len(blob) - 1))] ^= 0x55
    path.write_bytes(bytes(blob))


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


SLICE_DAMAGES = {
    **{f"truncated to {k:.1%}": (lambda p, k=k: _truncate(p, k)) for k in (0.0, 0.001, 0.02, 0.5, 0.999)},
    **{f"bit flip at {a:.1%}": (lambda p, a=a: _flip(p, a)) for a in (0.0, 0.002, 0.01, 0.5, 0.99, 1.0)},
    "a folder in its place": _folder,
}


@pytest.mark.parametrize("damage", sorted(SLICE_DAMAGES))
def test_a_damaged_cache_slice_is_recomputed_and_replaced(tmp_path: Path, caplog, damage: str) -> None:
    """Whatever the damage (a cut file raises BadZipFile or EOFError in np.load), the node serves the
    right slice, and the cache holds a good copy again (the folder case: the node still serves it)."""
    from fedskew.data.node import _CHECKED

    nc = {**NODE, "cache-dir": str(tmp_path)}
    _, good = load_node_data(CFG, nc)
    (path,) = tmp_path.glob("*.npz")
    (tmp_path / "unrelated.npz").write_bytes(b"not ours")
    SLICE_DAMAGES[damage](path)
    _CHECKED.clear()  # as in a new process
    with caplog.at_level(logging.WARNING, logger="fedskew.client"):
        _, again = load_node_data(CFG, nc)
    assert torch.equal(again.x_train, good.x_train) and torch.equal(again.y_test, good.y_test)
    assert (tmp_path / "unrelated.npz").read_bytes() == b"not ours"
    if path.is_file():  # replaced by a good copy: read back without a warning
        _CHECKED.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedskew.client"):
            load_node_data(CFG, nc)
        assert "refused" not in caplog.text
    else:
        assert "could not write the data cache" in caplog.text


@pytest.mark.parametrize("damage", ["nan", "garbage"])
def test_a_damaged_client_state_on_disk_counts_as_lost(tmp_path: Path, caplog, damage: str) -> None:
    """E.g. a NaN HPM in MAP's state-dir: refused with a warning, so MAP restarts the client as a
    first participation (and the server counts the lost state) instead of distilling from NaN."""
    state = ClientState(RecordDict(), 64, 0, tmp_path)
    state.save_tensors("hpm", {"w": torch.ones(3)})
    if damage == "nan":
        torch.save({"w": torch.tensor([1.0, float("nan"), 2.0])}, tmp_path / "hpm.pt")
    else:
        (tmp_path / "hpm.pt").write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="fedskew.client"):
        assert state.load_tensors("hpm") is None
    assert "hpm" in caplog.text


def test_checkpoints_reach_the_disk_before_they_replace_the_old_one(tmp_path: Path, monkeypatch) -> None:
    from fedskew.server_app.results import RunOutput

    out = RunOutput(validate({"out-dir": str(tmp_path), "run-name": "r"}), 1)
    events: list[str] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(f"replace {Path(b).name}") or replace(a, b))
    out.save_checkpoint({"round": 1, "arrays": {"w": torch.ones(2)}})
    assert events[:2] == ["fsync", "replace checkpoint.pt"]
    assert torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)["round"] == 1
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["checkpoint.pt", "config.json"]  # no temp file left


# ----------------------------------------------------------------------------- damaged client state


def _train(state_dir: Path, cache: Path, server_round: int):
    """One MAP round of the real ClientApp for partition 2 of 60, its state in `state_dir`; returns
    the reply and the MAP server's reading of its records (the declared schema, range checks)."""
    from flwr.app import ConfigRecord, Context, Message

    from fedskew.client_app.app import app
    from fedskew.records import check_content
    from fedskew.strategies.map import MAPStrategy
    from tests.harness import app_defaults

    run_config = {**app_defaults(), "method": "map", "num-server-rounds": 5}
    strategy = MAPStrategy(validate(run_config))
    strategy.sent_arrays = strategy.initial_arrays()
    node_config = {"partition-id": 2, "num-partitions": 60, "state-dir": str(state_dir), "cache-dir": str(cache)}
    ctx = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config)
    content = RecordDict({"arrays": strategy.sent_arrays, "config": ConfigRecord({"server-round": server_round})})
    reply = app(Message(content, dst_node_id=7, message_type="train"), ctx)
    assert not reply.has_error(), reply.error.reason
    return check_content(reply.content, strategy.reply_schema())["metrics"]


DAMAGES = {
    "count not an integer": lambda d: (d / "map.json").write_text('{"participations": "three"}'),
    "count of 2**70": lambda d: (d / "map.json").write_text(f'{{"participations": {2**70}}}'),
    "map.json not UTF-8": lambda d: (d / "map.json").write_bytes(b'{"participations": \xff\xfe}'),
    "hpm.pt a folder": lambda d: ((d / "hpm.pt").unlink(), (d / "hpm.pt").mkdir()),
    "participation rounds not a list": lambda d: (d / "fedskew-participation.json").write_text('{"rounds": 4}'),
    "participation round in the future": lambda d: (d / "fedskew-participation.json").write_text('{"rounds": [1, 9]}'),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_client_state_starts_a_new_client_and_the_next_round_counts_on(
    tmp_path: Path, caplog, task_identity, damage: str
) -> None:
    """Round 1 writes MAP's state; after the damage round 2 is answered as by a new client (which the
    server's checks accept), and round 3 counts on from there: the node never fails a round."""
    state_dir, cache = tmp_path / "state", tmp_path / "cache"
    first = _train(state_dir, cache, 1)
    assert (first["hpm-participations"], first["participations"]) == (1, 1)
    DAMAGES[damage](state_dir / "run-1" / "partition-2")
    with caplog.at_level(logging.WARNING, logger="fedskew.client"):
        second = _train(state_dir, cache, 2)
    assert "treated as lost" in caplog.text or "inconsistent" in caplog.text
    if "participation" in damage:  # the participation record is lost, MAP's own state is not
        assert (second["participations"], second["hpm-participations"], second["hpm-transfer"]) == (1, 2, 1)
    else:  # a new MAP client: no HPM to learn from, counted from 1 again
        assert (second["participations"], second["hpm-participations"], second["hpm-transfer"]) == (2, 1, 0)
    third = _train(state_dir, cache, 3)
    assert third["hpm-participations"] == second["hpm-participations"] + 1 and third["hpm-transfer"] == 1
    assert third["participations"] == second["participations"] + 1


def test_stored_values_are_checked_against_their_declared_form() -> None:
    from fedskew.client_app.state import ListOf, check_values
    from fedskew.records import Number

    schema = {"n": Number(int, 1, 5, required=True), "rounds": ListOf(Number(int, 1, 3), max_len=2)}
    assert check_values({"n": 5, "rounds": [1, 3]}, schema) == {"n": 5, "rounds": [1, 3]}
    for bad, needle in (
        ([1], "not an object"),
        ({"n": 1.0}, "n=1.0 is not of kind int"),
        ({"n": True}, "not of kind int"),
        ({"n": 6}, r"n=6 is outside \[1, 5\]"),
        ({"n": 2**70}, "outside"),
        ({}, "missing keys \\['n'\\]"),
        ({"n": 1, "x": 0}, "unexpected keys \\['x'\\]"),
        ({"n": 1, "rounds": "12"}, "list of at most 2"),
        ({"n": 1, "rounds": [1, 2, 3]}, "list of at most 2"),
        ({"n": 1, "rounds": [1, 4]}, r"rounds\[1\]=4 is outside"),
    ):
        with pytest.raises(ValueError, match=needle):
            check_values(bad, schema)
