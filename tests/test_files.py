"""Files (issue 15 item 12): what fedskew reads back is verified, it deletes only its own files,
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
