"""`benchmarks/niid_bench_reference.py`, niid_bench's own FedAvg and FedNova transcribed: its server
arithmetic is fedskew's (compared in float64), its a_i is `fednova_normalizer`'s, and one short
round trains, aggregates and evaluates on their split."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedskew.strategies.aggregate import fednova_normalizer, normalized_average, weighted_average
from tests.harness import ROOT


@pytest.fixture(scope="module")
def ref():
    spec = importlib.util.spec_from_file_location(
        "niid_bench_reference", ROOT / "benchmarks" / "niid_bench_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_their_fednova_and_fedavg_aggregation_is_fedskews(ref) -> None:
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(3, 4)), rng.normal(size=5)]
    ys = [[v + rng.normal(size=v.shape) for v in x] for _ in range(4)]
    n, a = [120, 640, 75, 300], [930.0, 610.5, 88.0, 2410.0]
    theirs = ref.aggregate(
        x,
        [([(s - y) / ai for s, y in zip(x, yi, strict=True)], ni, ai) for yi, ni, ai in zip(ys, n, a, strict=True)],
        True,
    )
    ours = normalized_average(dict(enumerate(x)), [dict(enumerate(y)) for y in ys], n, a)
    for k, v in enumerate(theirs):
        np.testing.assert_allclose(v, ours[k], rtol=1e-12, atol=1e-12)
    theirs = ref.aggregate(x, [(yi, ni, 0.0) for yi, ni in zip(ys, n, strict=True)], False)
    ours = weighted_average([dict(enumerate(y)) for y in ys], n)
    for k, v in enumerate(theirs):
        np.testing.assert_allclose(v, ours[k], rtol=1e-12, atol=1e-12)


def test_their_a_i_is_fednova_normalizer_over_the_steps_taken(ref, monkeypatch) -> None:
    monkeypatch.setattr(ref, "EPOCHS", 2)
    data = TensorDataset(torch.rand(70, 1, 28, 28), torch.randint(0, 10, (70,)))
    loader = DataLoader(data, 32, shuffle=True, generator=torch.Generator().manual_seed(0))
    net = ref.CNNMnist()
    start = [p.detach().clone() for p in net.parameters()]
    g, n, a_i = ref.local_train(net, loader, fednova=True)
    assert n == 70 and a_i == pytest.approx(fednova_normalizer(2 * 3, 0.9), rel=1e-15)  # 3 batches an epoch
    for gi, p0, p in zip(g, start, net.parameters(), strict=True):  # g_i = (x - y_i) / a_i
        np.testing.assert_allclose(gi, ((p0 - p.detach()) / a_i).numpy(), rtol=1e-6)
    assert max(float(np.abs(gi).max()) for gi in g) > 0


def test_a_short_run_writes_its_rounds_and_best(ref, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(ref, "EPOCHS", 1)
    record = ref.run("fednova", 0, 1, tmp_path / "fednova-s0.json")
    saved = json.loads((tmp_path / "fednova-s0.json").read_text())
    assert saved == record and len(saved["accuracy"]) == 2 and saved["best"] == max(saved["accuracy"])
    assert saved["accuracy"][1] > saved["accuracy"][0] + 0.02  # one round of their FedNova learns


def test_a_run_stopped_after_its_checkpoint_resumes_to_the_uninterrupted_runs_rounds(
    ref, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(ref, "EPOCHS", 1)
    monkeypatch.setattr(ref, "CHECKPOINT_EVERY", 1)
    split = ref.client_indices  # each client's first eighth: the resume's arithmetic, in a fifth of the time
    monkeypatch.setattr(ref, "client_indices", lambda cfg, n: [(tr[: len(tr) // 8], te) for tr, te in split(cfg, n)])
    whole = ref.run("fedavg", 3, 2, tmp_path / "whole.json")
    train, calls = ref.local_train, []

    def stop_in_round_two(*args, **kwargs):
        calls.append(1)
        if len(calls) > 10:  # round 2's first client: after round 1's checkpoint
            raise KeyboardInterrupt
        return train(*args, **kwargs)

    monkeypatch.setattr(ref, "local_train", stop_in_round_two)
    with pytest.raises(KeyboardInterrupt):
        ref.run("fedavg", 3, 2, tmp_path / "cut.json")
    assert (tmp_path / "cut.ckpt").is_file() and not (tmp_path / "cut.json").exists()
    monkeypatch.setattr(ref, "local_train", train)
    resumed = ref.run("fedavg", 3, 2, tmp_path / "cut.json")
    assert resumed["accuracy"] == whole["accuracy"] and not (tmp_path / "cut.ckpt").exists()
