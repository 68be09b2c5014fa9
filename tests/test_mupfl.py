"""MuPFL: BAVD, ACMU clustering, PKCF gradients / synthesis / fine-tune (spec §10), and one real run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.losses.mupfl import (
    BAVD,
    aggregate_class_gradients,
    attach_bavd,
    bavd_mask,
    bavd_update,
    class_gradients,
    finetune_classifier,
    flat_maps,
    gradient_matching_loss,
    loss_change,
    synthesize_features,
)
from fedskew.models import build_model
from fedskew.server_app.results import read_jsonl
from fedskew.strategies.clustering import (
    cluster_update,
    cosine_matrix,
    embed,
    kmeans,
    low_rank,
    select_clusters,
    silhouette_score,
    similarity_matrix,
)
from tests.conftest import read_metrics

# ----------------------------------------------------------------------------- BAVD


def test_bavd_is_identity_at_eval_and_masks_in_training() -> None:
    torch.manual_seed(0)
    plain = build_model("lenet", "fashion-mnist")
    model = build_model("lenet", "fashion-mnist")
    model.load_state_dict(plain.state_dict())
    layers = attach_bavd(model)
    assert len(layers) == 2 and model.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(8, 1, 28, 28)
    model.train()
    model(x)  # caches h_bar
    for layer in layers:
        layer.update(0, 0.0)
        layer.map = torch.randn_like(layer.map)  # a non-trivial map masks about half
    model.eval()
    assert torch.equal(model(x), plain.eval()(x))
    model.train()
    assert not torch.allclose(model(x), plain(x))


def test_bavd_mask_rule() -> None:
    assert torch.equal(bavd_mask(torch.zeros(3, 4, 4)), torch.ones(3, 4, 4))  # zero map keeps all
    assert torch.equal(bavd_mask(torch.full((2, 5), 0.3)), torch.ones(2, 5))  # constant slices too
    m = torch.randn(4, 6, 6)
    mask = bavd_mask(m)
    expect = (m >= m.mean(dim=(1, 2), keepdim=True)).float()
    assert torch.equal(mask, expect)
    assert (mask.sum(dim=(1, 2)) >= 1).all() and 0 < mask.mean() < 1
    assert torch.equal(bavd_mask(3.0 * m + 7.0), mask)  # invariant to positive affine maps
    layer = BAVD().train()
    layer.map = m
    h = torch.randn(5, 4, 6, 6, requires_grad=True)
    out = layer(h)
    assert torch.equal(out, h * mask)
    out.sum().backward()
    assert torch.equal(h.grad, mask.expand_as(h))  # no gradient at masked positions


def test_bavd_map_recursion_weighted_by_loss_change() -> None:
    h0, h1 = torch.rand(3, 4, 4), torch.rand(3, 4, 4)
    m = bavd_update(None, h0, 0, 0.0)
    assert torch.equal(m, h0)
    psi = loss_change(2.0, 1.5)  # the loss improved by 0.5
    assert psi == 0.5 and loss_change(2.0, 1.5, "paper") == -0.5 and loss_change(None, 1.0) == 0.0
    assert torch.allclose(bavd_update(m, h1, 1, psi), h0 + 0.5 * h1)
    assert torch.equal(bavd_update(m, h1, 0, psi), h1)  # lambda = 0 restarts the map
    layer = BAVD().train()
    layer(torch.rand(7, 3, 4, 4))  # any batch size gives a C x H x W map
    layer.update(0, 0.0)
    assert layer.map.shape == (3, 4, 4) and not layer.map.requires_grad
    assert flat_maps([layer]).shape == (48,)


# ----------------------------------------------------------------------------- ACMU


def test_similarity_and_embedding_agree() -> None:
    rng = np.random.default_rng(0)
    u, m = rng.normal(size=(6, 20)), rng.normal(size=(6, 9))
    sim = similarity_matrix(u, m, 0.3)
    assert np.allclose(sim, sim.T) and np.allclose(np.diag(sim), 1.0) and (np.abs(sim) <= 1).all()
    assert np.allclose(similarity_matrix(u, m, 1.0), cosine_matrix(u))
    phi = embed(u, m, 0.3)
    d2 = ((phi[:, None] - phi[None]) ** 2).sum(-1)
    assert np.allclose(d2, 2 * (1 - sim))
    low = low_rank(phi)
    assert low.shape == (6, 6) and np.allclose(((low[:, None] - low[None]) ** 2).sum(-1), d2)


def test_silhouette_matches_hand_computation() -> None:
    x = np.array([0.0, 1.0, 5.0, 6.0, 20.0])
    d = np.abs(x[:, None] - x[None])
    labels = np.array([0, 0, 1, 1, 2])
    a = [1, 1, 1, 1]
    b = [5.5, 4.5, 4.5, 5.5]  # nearest other cluster's mean distance
    expect = (sum((bi - ai) / max(ai, bi) for ai, bi in zip(a, b, strict=True)) + 0.0) / 5  # singleton: 0
    assert silhouette_score(d, labels) == pytest.approx(expect)


def test_silhouette_picks_planted_clusters() -> None:
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(3, 200)) * 5
    truth = np.repeat([0, 1, 2], 4)
    updates = centers[truth] + rng.normal(size=(12, 200)) * 0.5
    maps = np.abs(rng.normal(size=(3, 50)))[truth] + rng.random((12, 50)) * 0.05
    labels, kappa, score = select_clusters(updates, maps, 0.5, 2, 6, np.random.default_rng(0))
    assert kappa == 3 and score > 0.5
    assert len({(t, c) for t, c in zip(truth, labels, strict=True)}) == 3  # groups recovered exactly
    assert select_clusters(updates[:2], maps[:2], 0.5, 2, 6, np.random.default_rng(0))[1] == 1
    assert kmeans(updates, 3, np.random.default_rng(0))[1] < kmeans(updates, 2, np.random.default_rng(0))[1]


def test_cluster_update_shares_the_cluster_mean_increment() -> None:
    rng = np.random.default_rng(2)
    bases, updates = list(rng.normal(size=(4, 5))), list(rng.normal(size=(4, 5)))
    out = cluster_update(bases, updates, np.array([0, 1, 0, 2]))
    mean02 = (updates[0] + updates[2]) / 2
    assert np.allclose(out[0] - bases[0], mean02) and np.allclose(out[2] - bases[2], mean02)
    assert np.allclose(out[3], bases[3] + updates[3])  # singleton: its own trained model


# ----------------------------------------------------------------------------- PKCF


def test_class_gradients_match_autograd_and_mean_over_holders() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 6, requires_grad=True)
    h, y = torch.randn(10, 6), torch.tensor([0, 0, 1, 1, 1, 3, 3, 3, 3, 0])
    z = class_gradients(w.detach(), h, y)
    for k in (0, 1, 3):
        (g,) = torch.autograd.grad(F.cross_entropy(h[y == k] @ w.T, y[y == k]), w)
        assert torch.allclose(z[k], g, atol=1e-6)
    assert torch.equal(z[2], torch.zeros(4, 6))
    a, b, c = {0: torch.ones(2), 1: torch.full((2,), 3.0)}, {1: torch.full((2,), 5.0)}, {2: torch.full((2,), 7.0)}
    glo = aggregate_class_gradients([a, b, c])
    assert sorted(glo) == [0, 1, 2]
    assert torch.equal(glo[0], torch.ones(2)) and torch.equal(glo[1], torch.full((2,), 4.0))  # not / 3
    assert torch.equal(glo[2], torch.full((2,), 7.0))


def test_synthesis_reduces_the_gradient_matching_loss() -> None:
    torch.manual_seed(0)
    k, d = 5, 16
    w = torch.randn(k, d) * 0.3
    means = torch.randn(k, d) * 2
    targets = {}
    for c in (0, 1, 3, 4):  # class 2 held by nobody this round
        h = means[c] + torch.randn(40, d) * 0.5
        targets[c] = class_gradients(w, h, torch.full((40,), c))[c]
    start = torch.randn(k, 10, d)
    before = float(gradient_matching_loss(start, w, targets))
    _, slow = synthesize_features(start, w, targets, lr=0.1, iterations=100)  # the default lr: slowly
    assert slow[0] == pytest.approx(before) and slow[-1] < 0.9 * before
    feats, losses = synthesize_features(start, w, targets, lr=1.0, iterations=100)
    after = float(gradient_matching_loss(feats, w, targets))
    assert feats.shape == (k, 10, d) and before > 0.5 and after < 0.2 * before and losses[-1] < losses[0]
    assert torch.equal(feats[2], start[2])  # a class nobody uploaded is not moved
    assert float(gradient_matching_loss(feats, w, {c: 2.0 * z for c, z in targets.items()})) == pytest.approx(after)


def test_finetune_changes_only_the_classifier() -> None:
    torch.manual_seed(0)
    model = build_model("lenet", "fashion-mnist")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    feats, labels = torch.randn(50, model.feature_dim), torch.randint(0, 10, (50,))
    g = torch.Generator().manual_seed(0)
    assert np.isnan(finetune_classifier(model.classifier, feats, labels, 0, 16, 0.1, g))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    finetune_classifier(model.classifier, feats, labels, 3, 16, 0.1, g)
    after = model.state_dict()
    assert not torch.equal(after["classifier.weight"], before["classifier.weight"])
    assert all(torch.equal(after[k], before[k]) for k in after if not k.startswith("classifier"))


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_mupfl_runs_end_to_end(flwr_job) -> None:
    job = {"method": "mupfl", "num-server-rounds": 3, "mupfl-match-iters": 20}
    summary, run_dir = flwr_job(job, num_supernodes=5, name="mupfl")
    assert summary["final_personalized_accuracy"] > 0.8 and summary["best_global_accuracy"] > 0.2
    rows = read_metrics(run_dir)
    assert [r["replies"] for r in rows] == [5, 5, 5]
    assert all(2 <= r["acmu-kappa"] <= 4 and len(r["acmu-clusters"]) == 5 for r in rows)
    assert all(r["pkcf-classes"] == 10 and r["pkcf-match-loss-last"] < r["pkcf-match-loss-first"] for r in rows)
    timings = read_jsonl(run_dir / "timings.jsonl")  # times are kept out of metrics.jsonl
    assert all(t["pkcf-seconds"] > 0 and t["acmu-seconds"] > 0 for t in timings)
    assert rows[-1]["start-accuracy"] > 0.5  # the received personalized models w~_i are good models
