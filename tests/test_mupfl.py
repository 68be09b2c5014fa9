"""MuPFL: BAVD, ACMU clustering, PKCF gradients / synthesis / fine-tune (spec §10), and one real run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.mupfl import MuPFLTrainer
from fedskew.config import validate
from fedskew.data import dataset_info
from fedskew.data.clients import to_float
from fedskew.data.readers import load_dataset
from fedskew.losses.mupfl import (
    BAVD,
    aggregate_class_gradients,
    attach_bavd,
    bavd_map_size,
    bavd_mask,
    bavd_pass,
    bavd_update,
    class_gradients,
    dropped_fractions,
    feature_norm,
    finetune_classifier,
    flat_maps,
    gradient_distance,
    gradient_matching_loss,
    initial_features,
    loss_change,
    map_threshold_mask,
    matching_terms,
    sample_mean_mask,
    sample_topk_mask,
    synthesize_features,
)
from fedskew.methods.mupfl import MUPFL_CLASSIFIER as CLASSIFIER
from fedskew.methods.mupfl import MUPFL_GLOBAL as GLOBAL
from fedskew.models import build_model
from fedskew.server_app.results import read_jsonl
from fedskew.strategies.base import arrays_to_numpy
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
from fedskew.strategies.mupfl import MuPFLStrategy
from tests.conftest import read_metrics
from tests.harness import FLOAT64, app_defaults, cut_and_resume, float32_ratio_rtol, run_in_process
from tests.test_strategy import FakeGrid, make_reply
from tests.test_trainers import global_content, make_data, make_trainer

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


def test_attach_bavd_builds_its_layers_with_the_given_factory() -> None:
    class Closed(BAVD):  # another reading of Eq. 5: its mask drops everything
        def mask(self) -> torch.Tensor:
            return torch.zeros_like(self.map)

    torch.manual_seed(0)
    model = build_model("lenet", "fashion-mnist").train()
    layers = attach_bavd(model, Closed)
    assert len(layers) == 2 and all(isinstance(layer, Closed) for layer in layers)
    x = torch.randn(8, 1, 28, 28)
    model(x)
    for layer in layers:
        layer.update(0, 0.0)
    # every activation after the first conv block is zeroed: the logits no longer depend on the input
    logits = model(x)
    assert torch.allclose(logits, logits[:1].expand_as(logits)) and not torch.allclose(model.eval()(x), logits)


def test_bavd_rescale_keeps_each_channels_sum_as_inverted_dropout() -> None:
    m = torch.randn(4, 6, 6)
    keep, scaled = bavd_mask(m), bavd_mask(m, rescale=True)
    assert torch.equal(scaled > 0, keep > 0)  # the same positions
    assert torch.allclose(scaled.sum(dim=(1, 2)), torch.full((4,), 36.0))  # each channel sums to H x W
    assert torch.equal(bavd_mask(torch.zeros(2, 3, 3), rescale=True), torch.ones(2, 3, 3))  # zero map: identity
    layer = BAVD(rescale=True).train()
    h = torch.rand(5, 4, 6, 6)
    layer(h)
    layer.map = m
    assert torch.allclose(layer(h), h * scaled)


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


def two_samples() -> torch.Tensor:
    """A batch of two post-ReLU samples (2 channels, 3 x 3) whose strong positions differ."""
    a = torch.tensor([[9.0, 8.0, 1.0], [0.5, 0.0, 0.2], [0.1, 0.3, 0.0]])
    b = torch.flip(a, dims=(0, 1))  # its strong corner is the opposite one
    return torch.stack([torch.stack([a, 2 * a]), torch.stack([b, 3 * b])])


def test_sample_mean_masks_differ_between_samples_and_drop_each_samples_weakest() -> None:
    """Sec. 3.3 per sample: each sample's activations below its own (per-channel) mean are zeroed."""
    h = two_samples()
    mask = sample_mean_mask(h)
    assert mask.shape == h.shape and not torch.equal(mask[0], mask[1])
    assert torch.equal(mask, (h >= h.mean(dim=(2, 3), keepdim=True)).float())  # hand rule: >= own mean
    flat, keep = h.flatten(2), mask.flatten(2)
    assert (keep.gather(2, flat.argmin(2, keepdim=True)) == 0).all()  # every sample's weakest: dropped
    assert (keep.gather(2, flat.argmax(2, keepdim=True)) == 1).all()  # its strongest: kept
    batch = bavd_mask(h.mean(0)).expand_as(h)  # the batch reading: one mask for both samples ...
    assert ((batch == 1) & (mask == 0)).any()  # ... keeps activations below their own sample's mean
    assert (sample_mean_mask(h, rescale=True).sum(dim=(2, 3)) == 9).all()  # inverted dropout per slice
    feats = torch.tensor([[3.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 6.0]])  # (B, D): per sample over D
    assert torch.equal(sample_mean_mask(feats), torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 1]]))


def test_sample_topk_keeps_the_k_largest_of_each_sample_and_channel() -> None:
    """Sec. 3.6: top-K "in each H x W area of the batch and channel dimensions ... all B x C slices"."""
    h = torch.rand(3, 4, 5, 5, generator=torch.Generator().manual_seed(0))
    mask = sample_topk_mask(h, 0.3)
    kept = mask.flatten(2)
    assert (kept.sum(2) == 8).all()  # ceil(0.3 x 25) in every (b, c) slice
    flat = h.flatten(2)
    lowest_kept = torch.where(kept > 0, flat, torch.inf).amin(2)
    highest_dropped = torch.where(kept == 0, flat, -torch.inf).amax(2)
    assert (lowest_kept > highest_dropped).all()
    assert not torch.equal(mask[0], mask[1])
    with pytest.raises(ValueError, match="top"):
        sample_topk_mask(h, 0.0)


def test_map_threshold_takes_its_level_from_the_map_and_its_positions_from_the_sample() -> None:
    h = two_samples()
    low, high = torch.zeros(2, 3, 3), torch.ones(2, 3, 3)
    low[:, 0, 0] = 1.0  # normalised mean 1/9 in both channels
    high[:, 0, 0] = 0.0  # normalised mean 8/9
    norm = (h - h.amin(dim=(2, 3), keepdim=True)) / (
        h.amax(dim=(2, 3), keepdim=True) - h.amin(dim=(2, 3), keepdim=True)
    )
    assert torch.equal(map_threshold_mask(h, low), (norm >= 1 / 9 - 1e-6).float())
    assert torch.equal(map_threshold_mask(h, high), (norm >= 8 / 9 - 1e-6).float())
    assert map_threshold_mask(h, high).sum() < map_threshold_mask(h, low).sum()  # a higher level drops more
    assert not torch.equal(map_threshold_mask(h, low)[0], map_threshold_mask(h, low)[1])  # per sample
    assert torch.equal(map_threshold_mask(h, torch.zeros(2, 3, 3)), torch.ones_like(h))  # zero map: keep all


def test_dropped_fractions_count_positions_and_activation_mass() -> None:
    h = torch.tensor([[1.0, 1.0, 8.0], [0.0, 2.0, 8.0]])
    mask = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    positions, mass = dropped_fractions(h, mask).tolist()
    assert positions == pytest.approx(4 / 6) and mass == pytest.approx(4 / 20)
    positions, mass = dropped_fractions(h, torch.tensor([1.0, 0.0, 1.0])).tolist()  # one mask for the batch
    assert positions == pytest.approx(1 / 3) and mass == pytest.approx(3 / 20)


@pytest.mark.parametrize("reading", ["batch", "sample-mean", "sample-topk", "map-threshold"])
def test_each_bavd_reading_masks_in_training_and_reports_what_it_drops(reading: str) -> None:
    layer = BAVD(reading=reading, top=0.5).train()
    h = two_samples()
    first = layer(h)
    assert torch.equal(first, h) == (reading in ("batch", "map-threshold"))  # map readings: no map yet
    layer.update(0, 0.0)
    out = layer(h)
    assert not torch.equal(out, h) and ((out == 0) | (out == h)).all()
    positions, mass = layer.dropped()
    assert 0 < mass < positions < 1  # the dropped activations are the weak ones
    assert torch.equal(layer.eval()(h), h)
    with pytest.raises(ValueError, match="reading"):
        BAVD(reading="random")


@pytest.mark.parametrize("reading", ["batch", "sample-mean", "sample-topk", "map-threshold"])
@pytest.mark.parametrize("rescale", [False, True])
def test_bavd_s_functional_pass_on_a_padded_batch_is_the_layer_s_on_its_examples(reading: str, rescale: bool) -> None:
    """`bavd_pass` (the batched engine's) on 5 examples and 3 rows of padding (weight 0) gives the
    layer's masked activations on the 5 and their h_bar (float64 roundings apart), and exactly its
    dropped positions; a zero map masks nothing, as no map."""
    g = torch.Generator().manual_seed(0)
    h = torch.relu(torch.randn(8, 3, 4, 4, generator=g, dtype=torch.float64))
    weight = torch.tensor([0.2] * 5 + [0.0] * 3, dtype=torch.float64)
    layer = BAVD(rescale, reading, top=0.3).train()
    layer(h[:5])
    layer.update(0, 0.0)  # a map: the batch mean of the 5
    want = layer(h[:5])
    out, h_bar, frac = bavd_pass(h, layer.map, reading, 0.3, rescale, weight)
    assert torch.equal(out[:5], want)
    torch.testing.assert_close(h_bar, h[:5].mean(0), rtol=1e-12, atol=0.0)
    positions, mass = dropped_fractions(h[:5], layer.keep(h[:5]))
    # the mass in float32 (`dropped_fractions`), summed in another order; padding rows add exact zeros
    rel = float32_ratio_rtol(h[:5].numel())
    assert frac[0] == positions > 0 and float(frac[1]) == pytest.approx(float(mass), rel=rel)
    if reading in ("batch", "map-threshold"):
        out, _, frac = bavd_pass(h, torch.zeros_like(layer.map), reading, 0.3, rescale, weight)
        assert torch.equal(out, h) and float(frac[0]) == 0.0


def test_bavd_sites_after_both_convs_the_last_conv_or_the_features() -> None:
    info = dataset_info(validate({**app_defaults(), "model": "mupfl-cnn"}))
    for site, layers, size in (
        ("convs", 2, 32 * 24 * 24 + 64 * 8 * 8),
        ("last-conv", 1, 64 * 8 * 8),
        ("features", 1, 1024),
    ):
        model = build_model("mupfl-cnn", "fashion-mnist").train()
        got = attach_bavd(model, site=site)
        model(torch.rand(4, 1, 28, 28))
        assert len(got) == layers and sum(layer.h_bar.numel() for layer in got) == size, site
        assert bavd_map_size(build_model("mupfl-cnn", "fashion-mnist"), info, site) == size
    mlp = build_model("mlp", "fashion-mnist")
    assert attach_bavd(mlp) == [] and len(attach_bavd(mlp, site="features")) == 1  # no conv: features only


def test_trainer_reports_the_activation_mass_its_bavd_reading_removes() -> None:
    """The round's metrics: the fraction of positions and of activation mass the masks zeroed; a
    per-sample mean threshold drops about half the positions but much less of the mass."""
    keys = {"mupfl-pkcf": False, "mupfl-bavd-site": "features", "mupfl-bavd-mask": "sample-mean"}
    m = make_trainer(MuPFLTrainer, make_data(), method="mupfl", **keys).fit(global_content())["metrics"]
    assert 0.3 < m["bavd-dropped-positions"] < 0.95 and 0 < m["bavd-dropped-mass"] < m["bavd-dropped-positions"]


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
    torch.manual_seed(0)  # float64: the closed form and autograd sum in other orders
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    h, y = torch.randn(10, 6, dtype=torch.float64), torch.tensor([0, 0, 1, 1, 1, 3, 3, 3, 3, 0])
    z = class_gradients(w.detach(), h, y)
    for k in (0, 1, 3):
        (g,) = torch.autograd.grad(F.cross_entropy(h[y == k] @ w.T, y[y == k]), w)
        assert torch.allclose(z[k], g, **FLOAT64)
    assert torch.equal(z[2], torch.zeros(4, 6, dtype=torch.float64))
    a, b, c = {0: torch.ones(2), 1: torch.full((2,), 3.0)}, {1: torch.full((2,), 5.0)}, {2: torch.full((2,), 7.0)}
    glo = aggregate_class_gradients([a, b, c])
    assert sorted(glo) == [0, 1, 2]
    assert torch.equal(glo[0], torch.ones(2)) and torch.equal(glo[1], torch.full((2,), 4.0))  # not / 3
    assert torch.equal(glo[2], torch.full((2,), 7.0))


def test_matching_distances_per_row_and_flattened() -> None:
    torch.manual_seed(0)  # float64: batched and looped cosines sum in other orders
    real, synth = torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(3, 4, 6, dtype=torch.float64)
    rows = torch.stack(
        [sum(1 - F.cosine_similarity(synth[c, r], real[c, r], dim=0) for r in range(4)) for c in range(3)]
    )
    assert torch.allclose(gradient_distance(synth, real, "creff"), rows, atol=1e-12)  # CReFF's distance_wb
    flat = torch.stack([1 - F.cosine_similarity(synth[c].flatten(), real[c].flatten(), dim=0) for c in range(3)])
    assert torch.allclose(gradient_distance(synth, real, "paper"), flat, atol=1e-12)
    row_scales = torch.tensor([1.0, 10.0, 0.1, 3.0]).view(1, 4, 1)  # each row compared on its own ...
    assert torch.allclose(gradient_distance(real * row_scales, real, "creff"), torch.zeros(3).double(), atol=1e-5)
    assert (gradient_distance(real * row_scales, real, "paper") > 0.01).all()  # ... one flat cosine is not
    with pytest.raises(ValueError, match="unknown matching distance"):
        gradient_distance(synth, real, "mse")


@pytest.mark.parametrize(("distance", "lr"), [("creff", 1.0), ("paper", 20.0)])
def test_synthesis_moves_only_matched_classes_at_a_frozen_classifier(distance: str, lr: float) -> None:
    torch.manual_seed(0)
    k, d = 5, 16
    w = torch.randn(k, d) * 0.3
    means = torch.randn(k, d) * 2
    targets = {
        c: class_gradients(w, means[c] + torch.randn(40, d) * 0.5, torch.full((40,), c))[c] for c in (0, 1, 3, 4)
    }
    start = torch.randn(k, 10, d)
    w_before = w.clone()
    feats, losses = synthesize_features(start, w, targets, lr=lr, iterations=50, distance=distance)
    terms = matching_terms(len(targets), k, distance)
    assert losses[0] == pytest.approx(float(gradient_matching_loss(start, w, targets, distance)) / terms)
    assert feats.shape == (k, 10, d) and losses[-1] < 0.5 * losses[0] and min(losses) >= 0
    assert torch.equal(feats[2], start[2]) and torch.equal(w, w_before)  # class 2: uploaded by nobody
    scaled = {c: 2.0 * z for c, z in targets.items()}  # cosine: the real gradients' scale does not matter
    assert float(gradient_matching_loss(feats, w, scaled, distance)) == pytest.approx(
        float(gradient_matching_loss(feats, w, targets, distance)), rel=1e-5
    )


@pytest.fixture(scope="module")
def real_gradients() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """A LeNet trained 3 epochs on a long-tailed (IF 10) slice of Fashion-MNIST: its classifier and
    the real class gradients z^k of 64 samples of each class (the targets PKCF matches)."""
    x, y, _, _ = load_dataset("fashion-mnist", "")
    y = torch.from_numpy(np.array(y, dtype=np.int64))
    counts = (200 * 10 ** (-np.arange(10) / 9)).astype(int)
    idx = torch.cat([torch.nonzero(y == k).flatten()[:n] for k, n in enumerate(counts)])
    xs, ys = to_float(x[idx.numpy()], "fashion-mnist"), y[idx]
    torch.manual_seed(0)
    model = build_model("lenet", "fashion-mnist")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for b in torch.randperm(len(ys), generator=g).split(64):
            loss = F.cross_entropy(model(xs[b]), ys[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        h = model.features(xs)
    w = model.classifier.weight.detach()
    return w, {k: class_gradients(w, h[ys == k][:64], ys[ys == k][:64])[k] for k in range(10)}


def test_synthesis_converges_with_its_defaults_on_real_gradients(real_gradients) -> None:
    """Before the fix: with lr 0.1 and one cosine per class the features did not move (loss 0.99 -> 0.98)."""
    cfg = app_defaults()
    w, targets = real_gradients
    start = torch.randn(10, cfg["mupfl-features-per-class"], w.shape[1], generator=torch.Generator().manual_seed(1))
    feats, losses = synthesize_features(
        start, w, targets, cfg["mupfl-feature-lr"], cfg["mupfl-match-iters"], cfg["mupfl-distance"]
    )
    assert losses[0] > 0.9 and losses[-1] < losses[0] / 10  # measured: 1.03 -> 0.02
    assert float((feats - start).norm() / start.norm()) > 0.2  # measured: 0.47


def test_finetune_on_synthesised_features_debiases_a_long_tail_classifier() -> None:
    """Toy PKCF round: class-conditional (ReLU'd) Gaussian features, a classifier trained on a long
    tail (IF 100); the classifier fine-tuned on the features synthesised from balanced real class
    gradients (defaults) gains balanced accuracy. Noise features (no synthesis) do not."""
    cfg = app_defaults()
    k, d, m = 10, 32, cfg["mupfl-features-per-class"]
    g = torch.Generator().manual_seed(0)
    means = torch.randn(k, d, generator=g).relu() * 1.5

    def sample(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
        return (means[y] + torch.randn(len(y), d, generator=g)).relu(), y

    x_tail, y_tail = sample((500 * 100 ** (-torch.arange(k) / (k - 1))).long().tolist())
    x_test, y_test = sample([300] * k)
    biased = torch.nn.Linear(d, k, bias=False)
    torch.nn.init.zeros_(biased.weight)
    finetune_classifier(biased, x_tail, y_tail, 20, 64, 0.1, g)

    def balanced_accuracy(clf: torch.nn.Linear) -> float:
        with torch.no_grad():
            pred = clf(x_test).argmax(1)
        return float(torch.stack([(pred[y_test == c] == c).float().mean() for c in range(k)]).mean())

    w = biased.weight.detach().clone()
    x_real, y_real = sample([64] * k)
    targets = {c: class_gradients(w, x_real[y_real == c], y_real[y_real == c])[c] for c in range(k)}
    start = torch.randn(k, m, d, generator=g)
    feats, _ = synthesize_features(
        start, w, targets, cfg["mupfl-feature-lr"], cfg["mupfl-match-iters"], cfg["mupfl-distance"]
    )
    labels = torch.arange(k).repeat_interleave(m)
    tuned, on_noise = torch.nn.Linear(d, k, bias=False), torch.nn.Linear(d, k, bias=False)
    for clf, f in ((tuned, feats), (on_noise, start)):
        clf.weight.data = w.clone()
        finetune_classifier(clf, f.reshape(-1, d), labels, cfg["mupfl-tau"], cfg["mupfl-feature-batch"], cfg["lr"], g)
    before = balanced_accuracy(biased)
    assert balanced_accuracy(tuned) > before + 0.04  # measured: 0.854 -> 0.925
    assert balanced_accuracy(on_noise) < before + 0.02  # the old synthesis' noise: 0.857


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


# ----------------------------------------------------------------------------- start model


def test_default_start_model_is_the_global_model() -> None:
    """Before the fix: with the personal start (the old default) the global model was an average of models
    nothing trained from. By default a returning client now starts from w_glo; 'personal' stays."""
    cfg = validate({**app_defaults(), "method": "mupfl"})
    strategy = MuPFLStrategy(cfg)
    glo = strategy.initial_arrays()
    strategy.personal[3] = {k: v + 1.0 for k, v in arrays_to_numpy(glo).items()}
    start = strategy.start_model(3, glo)
    assert all(np.array_equal(start[k], v) for k, v in arrays_to_numpy(glo).items())
    strategy.cfg = {**cfg, "mupfl-init": "personal"}
    assert all(np.array_equal(strategy.start_model(3, glo)[k], v) for k, v in strategy.personal[3].items())


def test_default_run_sends_every_client_the_global_model_and_its_classifier(tmp_path, task_identity) -> None:
    """In process, defaults: every client of a round gets the same start model (w_glo), and the PKCF
    matching classifier equals its classifier; the global model learns (not stuck at chance); the
    synthesis, started from the global extractor's outputs, matches the clients' gradients."""
    grid = run_in_process(
        {"method": "mupfl", "model": "mlp", "partition": "iid", "fraction-train": 0.15, "num-server-rounds": 3}
        | {"out-dir": str(tmp_path), "run-name": "r"},
        20,
    )
    train = [m.content for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train) == 9
    for r in range(3):
        sent = [c["arrays"].to_torch_state_dict() for c in train[3 * r : 3 * r + 3]]
        assert all(torch.equal(s[k], sent[0][k]) for s in sent for k in s)  # one start model: w_glo
        for c in train[3 * r : 3 * r + 3]:
            weight = c[CLASSIFIER].to_torch_state_dict()["weight"]
            assert torch.equal(weight, sent[0]["classifier.weight"])
    rows = read_metrics(tmp_path / "r")
    assert rows[-1]["global-accuracy"] > 0.5
    first, last = rows[0]["pkcf-match-loss-first"], rows[0]["pkcf-match-loss-last"]
    assert first > 10 * last and all(r["pkcf-match-loss-last"] < 0.1 for r in rows)  # the synthesis converges


def test_no_finetune_epochs_trains_nothing_and_fails_no_reply(tmp_path, task_identity) -> None:
    """tau = 0 (the fine-tune off, PKCF's synthesis on): the clients report no fine-tune loss (a
    NaN one was refused by the server's screen, so every reply of round 2 failed) and the start
    after the 0-epoch fine-tune is the global model."""
    cfg = {"method": "mupfl", "model": "mlp", "partition": "iid", "fraction-train": 0.15, "num-server-rounds": 2}
    run_in_process(cfg | {"mupfl-tau": 0, "out-dir": str(tmp_path), "run-name": "r"}, 20)
    rows = read_metrics(tmp_path / "r")
    assert [r["failures"] for r in rows] == [0, 0] and rows[1]["replies"] == 3
    assert rows[1]["pkcf-accuracy"] == pytest.approx(rows[1]["client-global-accuracy"])


def test_personal_start_reports_client_global_accuracy_of_w_glo() -> None:
    """Under init 'personal' a client receives w~_i; `client-global-accuracy` must still be w_glo's
    (sent beside it), and `start-accuracy` w~_i's."""
    data = make_data()
    glo = build_model("mlp", "fashion-mnist")
    torch.nn.init.zeros_(glo.classifier.weight)  # predicts class 0, which this client does not hold
    personal = make_trainer(FedAvgTrainer, data).fit(global_content(1))["arrays"]
    content = global_content()
    content["arrays"] = personal
    content[GLOBAL] = ArrayRecord(glo.state_dict())
    content[CLASSIFIER] = ArrayRecord({"weight": glo.classifier.weight.detach()})
    reply = make_trainer(MuPFLTrainer, data, method="mupfl", **{"mupfl-init": "personal"}).fit(content)

    def accuracy(arrays: dict[str, torch.Tensor]) -> float:
        model = build_model("mlp", "fashion-mnist")
        model.load_state_dict(arrays)
        with torch.no_grad():
            return float((model.eval()(data.x_test).argmax(1) == data.y_test).float().mean())

    m = reply["metrics"]
    assert m["client-global-accuracy"] == pytest.approx(accuracy(glo.state_dict()))
    assert m["start-accuracy"] == pytest.approx(accuracy(personal.to_torch_state_dict()))
    assert m["client-global-accuracy"] == 0.0 and m["start-accuracy"] > 0.2


def test_cluster_start_is_the_cluster_updated_extractor_with_the_global_classifier(task_identity) -> None:
    """ACMU on the client's path (Alg. 1 L6-L8, Eq. 14): a returning client starts from its cluster's
    update of its own model, w~_i = w_i^(t-1) + mean_{j in C(i)} dw_j, its feature extractor with the
    global classifier of Eq. 15; a first-time client from the global model."""
    overrides = {"model": "mlp", "partition": "iid", "fraction-train": 1.0, "max-update-ratio": 0.0}
    keys = {"mupfl-init": "cluster", "mupfl-pkcf": False, "mupfl-bavd": False}
    cfg = validate({**app_defaults(), "method": "mupfl", **overrides, **keys})
    strategy, grid = MuPFLStrategy(cfg), FakeGrid({11: 0, 22: 1, 33: 2, 44: 3})
    glo = strategy.initial_arrays()
    start = arrays_to_numpy(glo)
    rng = np.random.default_rng(0)
    directions = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in start.items()} for _ in range(2)]
    deltas = [
        {k: (1 + 0.1 * i) * d[k] + 0.01 * rng.normal(size=d[k].shape) for k in d}
        for i, d in enumerate(directions[g] for g in (0, 0, 1, 1))
    ]  # two planted clusters: {0, 1} and {2, 3}
    msgs = list(strategy.configure_train(1, glo, ConfigRecord(), grid))
    sizes = [100, 200, 300, 400]
    replies = []
    for m in msgs:
        pid = strategy.node_partitions[m.metadata.dst_node_id]
        arrays = {k: (start[k] + deltas[pid][k]).astype(np.float32) for k in start}
        replies.append(make_reply(m, arrays, sizes[pid], pid))
    new, metrics = strategy.aggregate_train(1, replies)
    assert metrics["acmu-kappa"] == 2 and metrics["acmu-clusters"][0] == metrics["acmu-clusters"][1]
    personal = [
        {k: start[k] + (deltas[a][k] + deltas[b][k]) / 2 for k in start} for a, b in ((0, 1), (0, 1), (2, 3), (2, 3))
    ]
    new_glo = arrays_to_numpy(new)
    for k in start:  # Eq. 15: the sample-weighted mean of the w~_i
        assert np.allclose(
            new_glo[k], sum(n * w[k] for n, w in zip(sizes, personal, strict=True)) / sum(sizes), atol=1e-5
        )
    sent = {
        strategy.node_partitions[m.metadata.dst_node_id]: m
        for m in strategy.configure_train(2, new, ConfigRecord(), grid)
    }
    for pid, msg in sent.items():
        got = arrays_to_numpy(msg.content["arrays"])
        for k in start:
            want = new_glo[k] if k.startswith("classifier.") else personal[pid][k]
            assert np.allclose(got[k], want, atol=1e-5), (pid, k)
        assert np.array_equal(arrays_to_numpy(msg.content[GLOBAL])["classifier.weight"], new_glo["classifier.weight"])
    strategy.personal.pop(3)  # as if client 3 had never taken part
    assert all(np.array_equal(v, new_glo[k]) for k, v in strategy.start_model(3, new).items())


def test_cluster_reading_reports_its_start_and_pkcf_accuracies_and_resumes(tmp_path, task_identity) -> None:
    """In process: the start model (the client's cluster-updated extractor, global classifier) and
    the same after PKCF's fine-tune are evaluated from a client's second participation on; the
    synthetic features start at the clients' real-feature norm; a cut run resumes to the same result."""
    keys = {
        "method": "mupfl",
        "mupfl-init": "cluster",
        "mupfl-feature-init": "rescaled",
        "mupfl-bavd-site": "features",
        "mupfl-bavd-mask": "sample-mean",
        "mupfl-match-iters": 10,
        "mupfl-tau": 2,
    }
    full, _, grid = cut_and_resume(tmp_path, keys)
    rows = read_metrics(full)
    first, second = rows
    assert first["pkcf-initial-norm"] == pytest.approx(first["pkcf-real-norm"], rel=1e-4)
    assert first["pkcf-synthetic-norm"] > 0 and "pkcf-accuracy" not in first  # no features before round 2
    assert first["start-accuracy"] == pytest.approx(first["client-global-accuracy"])  # first start: w_glo
    assert 0 <= second["start-accuracy"] <= 1 and 0 <= second["pkcf-accuracy"] <= 1
    assert 0 < second["bavd-dropped-mass"] < second["bavd-dropped-positions"] < 1
    train = [m.content for m in grid.sent if m.metadata.message_type == "train"]
    bodies = [c["arrays"].to_torch_state_dict()["features.1.weight"] for c in train[4:]]
    heads = [c["arrays"].to_torch_state_dict()["classifier.weight"] for c in train[4:]]
    assert all(torch.equal(h, heads[0]) for h in heads)  # one global classifier
    labels = first["acmu-clusters"]  # round 1 started everyone from w_glo: one extractor per cluster
    assert len(set(labels)) > 1
    for i in range(4):
        for j in range(4):
            assert torch.equal(bodies[i], bodies[j]) == (labels[i] == labels[j])


def test_initial_features_start_from_the_extractor_or_the_real_norm() -> None:
    """PKCF's synthetic features: N(0, 1) (CReFF), the global extractor's outputs (Sec. 3.5, Eq. 18),
    or N(0, 1) rescaled to the real features' norm."""
    shape = (3, 4, 84)

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(3)

    normal = initial_features("normal", shape, gen())
    assert torch.equal(normal, torch.randn(shape, generator=gen()))
    model = build_model("lenet", "fashion-mnist").train()
    ext = initial_features("extractor", shape, gen(), model.features, (1, 28, 28))
    assert model.features.training  # its mode restored
    with torch.no_grad():
        expect = model.features.eval()(torch.randn(12, 1, 28, 28, generator=gen()))
    assert torch.allclose(ext.reshape(12, 84), expect) and (ext >= 0).all()
    rescaled = initial_features("rescaled", shape, gen(), real_norm=2.5)
    assert torch.allclose(rescaled.norm(dim=2), torch.full((3, 4), 2.5))
    assert feature_norm(normal) > 3 * feature_norm(rescaled)  # N(0, 1) in 84 dimensions: about 9
    with pytest.raises(ValueError, match="finite"):
        initial_features("rescaled", shape, gen(), real_norm=float("nan"))


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
    assert "start-accuracy" not in rows[-1]  # the default start model is w_glo: client-global-accuracy
    assert rows[-1]["client-global-accuracy"] > 0.2
