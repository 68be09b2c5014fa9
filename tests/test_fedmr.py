"""FedMR: the losses' properties (spec §10), prototype aggregation, the trainer, the strategy's reply
screening, and one real `flwr run`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedskew.losses.fedmr import (
    aggregate_prototypes,
    class_prototypes,
    gradient_share,
    inter_class_loss,
    intra_class_loss,
    sharing_partitions,
)
from fedskew.schema import parse_class_list
from tests.conftest import read_metrics

# ---------------------------------------------------------------------------------------------- intra


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def decorrelated(n: int, d: int) -> torch.Tensor:
    """n x d, columns centred, orthogonal and of equal norm (Hadamard columns 1..d)."""
    return hadamard(n)[:, 1 : d + 1].clone()


def test_intra_is_zero_for_decorrelated_features_and_paper_fro_is_d() -> None:
    n, d = 16, 6
    z = torch.cat([decorrelated(n, d), 3.0 * decorrelated(n, d)[torch.randperm(n)] + 2.0])
    y = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)])
    assert intra_class_loss(z, y, "paper_offdiag").abs() < 1e-6
    assert intra_class_loss(z, y, "ref").abs() < 1e-6
    assert intra_class_loss(z, y, "paper_fro").item() == pytest.approx(d * (n / (n - 1)) ** 2, rel=1e-5)


def test_intra_of_fully_correlated_features_matches_each_normalisation() -> None:
    g = torch.Generator().manual_seed(0)
    sizes, d = (5, 9), 4
    zs, ys = [], []
    for c, n in enumerate(sizes):
        latent = torch.randn(n, 1, generator=g)
        zs.append(latent * torch.rand(1, d, generator=g).add(0.5) + torch.randn(1, d, generator=g))
        ys.append(torch.full((n,), c))
    z, y = torch.cat(zs), torch.cat(ys)
    ref = sum((n - 1) ** 2 for n in sizes) / sum(sizes)  # every off-diagonal correlation is 1
    assert intra_class_loss(z, y, "ref").item() == pytest.approx(ref, rel=1e-4)
    paper = np.mean([d * (d - 1) * (n / (n - 1)) ** 2 for n in sizes])
    assert intra_class_loss(z, y, "paper_offdiag").item() == pytest.approx(paper, rel=1e-4)


def test_intra_is_invariant_and_has_no_cross_class_terms() -> None:
    g, f64 = torch.Generator().manual_seed(1), torch.float64  # float64: per class and all at once sum differently
    z = torch.randn(30, 5, generator=g, dtype=f64)
    y = torch.randint(0, 3, (30,), generator=g)
    for mode in ("ref", "paper_fro", "paper_offdiag"):
        base = intra_class_loss(z, y, mode)
        moved = z.clone()
        for c in range(3):  # per-class, per-dimension positive affine maps
            scale, shift = torch.rand(5, generator=g, dtype=f64).add(0.2), torch.randn(5, generator=g, dtype=f64)
            moved[y == c] = moved[y == c] * scale + shift
        perm, dims = torch.randperm(30, generator=g), torch.randperm(5, generator=g)
        assert intra_class_loss(moved[perm][:, dims], y[perm], mode).item() == pytest.approx(base.item(), rel=1e-4)
        per_class = [intra_class_loss(z[y == c], y[y == c], mode).item() for c in range(3)]
        n = [int((y == c).sum()) for c in range(3)]
        combined = np.dot(per_class, n) / sum(n) if mode == "ref" else np.mean(per_class)
        assert base.item() == pytest.approx(combined, rel=1e-10)


def test_intra_skips_singletons_and_survives_constant_dimensions() -> None:
    z = torch.randn(3, 4, requires_grad=True)
    out = intra_class_loss(z, torch.tensor([0, 1, 2]))
    assert out.shape == () and out.item() == 0.0 and out.requires_grad
    out.backward()  # graph-connected zero
    z2 = torch.randn(8, 4)
    z2[:, 2] = 1.5  # zero variance in one dimension
    for mode in ("ref", "paper_fro", "paper_offdiag"):
        assert torch.isfinite(intra_class_loss(z2, torch.zeros(8, dtype=torch.long), mode))


# ---------------------------------------------------------------------------------------------- inter

PROTOS = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 5.0]])
ALL = torch.tensor([True, True, True])


def test_inter_is_zero_when_margins_hold_and_matches_a_hand_computed_case() -> None:
    z = torch.tensor([[0.1, 0.0], [0.2, 0.1], [0.9, 0.1], [0.1, 4.0]])
    y = torch.tensor([0, 0, 1, 2])
    assert inter_class_loss(z, y, PROTOS, ALL).item() == 0.0
    # z=(0.8,0) of class 0: d_own 0.8, d_1 0.2 -> hinge 0.6; d_2 > 5 -> 0. Pairs (0,1),(0,2): mean 0.3
    z = torch.tensor([[0.8, 0.0]])
    assert inter_class_loss(z, torch.tensor([0]), PROTOS, ALL).item() == pytest.approx(0.3)
    assert inter_class_loss(z, torch.tensor([0]), PROTOS, ALL, margin=1.0).item() == pytest.approx((1.6 + 0) / 2)
    # margin-removed variant: the mean distance to the own prototype
    z = torch.tensor([[0.8, 0.0], [1.0, 3.0]])
    pull = inter_class_loss(z, torch.tensor([0, 1]), PROTOS, ALL, form="pull")
    assert pull.item() == pytest.approx((0.8 + 3.0) / 2)


def test_inter_gradients_masks_and_negative_modes() -> None:
    z = torch.tensor([[0.8, 0.0], [0.7, 0.2]], requires_grad=True)
    y = torch.tensor([0, 2])
    g = PROTOS.clone().requires_grad_(True)
    out = inter_class_loss(z, y, g, ALL)
    out.backward()
    assert z.grad is not None and z.grad.abs().sum() > 0 and g.grad is None
    # class 2's prototype invalid: its sample is dropped and 2 is no negative -> only pair (0,1)
    only01 = inter_class_loss(z, y, PROTOS, torch.tensor([True, True, False]))
    assert only01.item() == pytest.approx(0.6)
    # 'local': a client holding only class 0 has no negative pair -> 0; moving a missing class's
    # prototype changes 'all' but not 'local'
    z0, y0 = torch.tensor([[0.8, 0.0]]), torch.tensor([0])
    local = torch.tensor([True, False, False])
    assert inter_class_loss(z0, y0, PROTOS, ALL, local, negatives="local").item() == 0.0
    local01 = torch.tensor([True, True, False])
    moved = PROTOS.clone()
    moved[2] = torch.tensor([0.9, 0.0])
    assert inter_class_loss(z0, y0, moved, ALL, local01, "local") == inter_class_loss(
        z0, y0, PROTOS, ALL, local01, "local"
    )
    assert inter_class_loss(z0, y0, moved, ALL) != inter_class_loss(z0, y0, PROTOS, ALL)
    # Lite: n >= B is the full loss, n = 0 switches it off
    assert inter_class_loss(z, y, PROTOS, ALL, lite_n=10) == out.detach()
    assert inter_class_loss(z, y, PROTOS, ALL, lite_n=0).item() == 0.0


# ---------------------------------------------------------------------------------------------- prototypes


def test_prototype_aggregation_is_count_weighted_per_class() -> None:
    g = torch.Generator().manual_seed(2)
    z, y = torch.randn(40, 3, generator=g), torch.randint(0, 3, (40,), generator=g)
    y[y == 2] = 0  # class 2 never held; class 3 (of 4) neither
    parts = [(z[:10], y[:10]), (z[10:], y[10:])]
    local = [class_prototypes(zz, yy, 4) for zz, yy in parts]
    protos, valid = aggregate_prototypes([p.numpy() for p, _ in local], [n.numpy() for _, n in local])
    pooled, counts = class_prototypes(z, y, 4)
    assert valid.tolist() == [True, True, False, False] and counts.tolist()[2:] == [0, 0]
    np.testing.assert_allclose(protos[:2], pooled[:2].numpy(), rtol=1e-5)  # = mean of the pooled data
    assert not protos[2:].any()
    # one client -> its own prototype; a zero-count (non-sharing) client has no influence
    other = np.full((4, 3), 9.0, np.float32)
    alone, _ = aggregate_prototypes([local[0][0].numpy(), other], [local[0][1].numpy(), np.zeros(4)])
    held = local[0][1].numpy() > 0
    np.testing.assert_allclose(alone[held], local[0][0].numpy()[held], rtol=1e-6)
    # explicit weights: 1 x [0,0,0] and 3 x [4,4,4] -> 3
    two, _ = aggregate_prototypes([np.zeros((1, 3)), np.full((1, 3), 4.0)], [np.array([1]), np.array([3])])
    np.testing.assert_allclose(two, [[3.0, 3.0, 3.0]])
    # stale classes keep the previous value and validity
    prev = np.arange(12, dtype=np.float32).reshape(4, 3)
    kept, v = aggregate_prototypes([np.ones((4, 3))], [np.array([2, 0, 0, 0])], prev, np.array([0, 1, 0, 0], bool))
    np.testing.assert_allclose(kept[1:], prev[1:])
    assert kept[0].tolist() == [1, 1, 1] and v.tolist() == [True, True, False, False]
    with pytest.raises(ValueError):
        aggregate_prototypes([np.ones((4, 3))], [np.array([-1, 0, 0, 0])])


def test_class_lists_and_sharing_subset() -> None:
    assert parse_class_list("", 10) == [] and parse_class_list("all", 3) == [0, 1, 2]
    assert parse_class_list("7, 3,3", 10) == [3, 7]
    for bad in ("10", "a,b"):
        with pytest.raises(ValueError):
            parse_class_list(bad, 10)
    m = sharing_partitions(10, 0.5, seed=0)
    assert m.sum() == 5 and (m == sharing_partitions(10, 0.5, seed=0)).all()
    assert sharing_partitions(10, 0.0, 0).sum() == 0 and sharing_partitions(10, 1.0, 0).all()


# ---------------------------------------------------------------------------------------------- trainer


def make_trainer(method: str, overrides: dict, pid: int = 0, server_round: int = 1):
    from fedskew.client_app.base import TrainerContext
    from fedskew.client_app.state import ClientState
    from fedskew.config import validate
    from fedskew.data.clients import ClientData
    from fedskew.registry import get_method
    from fedskew.training import seed_everything

    cfg = validate({"method": method, **overrides})
    g = torch.Generator().manual_seed(5)
    y = torch.tensor([1, 4] * 20)
    data = ClientData(
        torch.randn(40, 1, 28, 28, generator=g), y, torch.randn(6, 1, 28, 28, generator=g), torch.tensor([1, 4] * 3), 10
    )
    gen = seed_everything(cfg["seed"], pid, server_round)
    ctx = TrainerContext(cfg, data, torch.device("cpu"), ClientState(RecordDict(), 64, pid), pid, server_round, gen)
    return get_method(method).trainer_class()(ctx), cfg


def global_content(cfg: dict, extra: dict | None = None) -> RecordDict:
    from fedskew.models import build_model

    torch.manual_seed(0)
    arrays = ArrayRecord(build_model(cfg["model"], cfg["dataset"]).state_dict())
    return RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1}), **(extra or {})})


def test_trainer_with_zero_weights_is_fedavg_and_uploads_prototypes() -> None:
    avg, cfg = make_trainer("fedavg", {})
    mr, _ = make_trainer("fedmr", {"fedmr-mu1": 0.0, "fedmr-mu2": 0.0})
    a, b = avg.fit(global_content(cfg)), mr.fit(global_content(cfg))
    for k, v in a["arrays"].items():
        assert np.array_equal(v.numpy(), b["arrays"][k].numpy()), k
    rec = b["fedmr-prototypes"]
    counts = rec["counts"].numpy()
    assert counts.tolist() == [0, 20, 0, 0, 20, 0, 0, 0, 0, 0] and rec["prototypes"].numpy().shape == (10, 84)
    assert not rec["prototypes"].numpy()[counts == 0].any() and rec["prototypes"].numpy()[1].any()


def test_trainer_round1_has_no_inter_term_then_uses_prototypes_and_privacy() -> None:
    from fedskew.strategies.fedmr import FedMRStrategy

    t1, cfg = make_trainer("fedmr", {"fedmr-private-classes": "4"})
    strat = FedMRStrategy(cfg)
    strat.num_partitions = 2
    r1 = t1.fit(global_content(cfg, strat.broadcast(1)))
    assert r1["metrics"]["inter-active"] == 0.0 and r1["metrics"]["intra-loss"] > 0
    assert r1["fedmr-prototypes"]["counts"].numpy().tolist() == [0, 20] + [0] * 8  # class 4 private
    strat.prototypes = np.random.default_rng(0).normal(size=(10, 84)).astype(np.float32)
    strat.valid[:] = True
    t2, _ = make_trainer("fedmr", {"fedmr-private-classes": "4"}, server_round=2)
    r2 = t2.fit(global_content(cfg, strat.broadcast(2)))
    assert r2["metrics"]["inter-active"] == 1.0 and r2["metrics"]["inter-loss"] > 0
    # not in the sharing subset: uploads nothing, still trains with the inter loss
    t3, cfg0 = make_trainer("fedmr", {"fedmr-share-fraction": 0.0}, server_round=2)
    strat0 = FedMRStrategy(cfg0)
    strat0.num_partitions, strat0.prototypes, strat0.valid = 2, strat.prototypes, strat.valid
    r3 = t3.fit(global_content(cfg0, strat0.broadcast(2)))
    assert r3["metrics"]["inter-active"] == 1.0 and not r3["fedmr-prototypes"]["counts"].numpy().any()


def test_gradient_share_matches_a_hand_computation() -> None:
    w, v = torch.tensor([3.0, 4.0], requires_grad=True), torch.tensor([1.0], requires_grad=True)
    reference = (w**2).sum() / 2 + (v**2).sum() / 2  # gradient (w, v): norm sqrt(26)
    term = 0.1 * w.sum()  # gradient (0.1, 0.1) on w, nothing on v
    assert gradient_share(term, reference, [w, v]) == pytest.approx(math.sqrt(0.02) / math.sqrt(26))
    (reference + term).backward()  # the graph is kept for the real backward pass
    assert torch.allclose(w.grad, torch.tensor([3.1, 4.1]))
    assert math.isnan(gradient_share(term, 0.0 * w.sum(), [w]))


def test_gradient_shares_are_logged_without_changing_training_and_scale_with_mu2() -> None:
    """The inter loss's gradient against the CE's in the backbone: logged every n-th batch, the
    same upload with and without logging, and proportional to mu2 (the paper's 1e-4: a few per mille)."""
    from fedskew.strategies.fedmr import FedMRStrategy

    def round_two(**over) -> RecordDict:
        trainer, cfg = make_trainer("fedmr", {"fedmr-negatives": "local", **over}, server_round=2)
        strat = FedMRStrategy(cfg)
        strat.num_partitions = 2
        strat.prototypes = np.random.default_rng(0).normal(size=(10, 84)).astype(np.float32)
        strat.valid[:] = True
        return trainer.fit(global_content(cfg, strat.broadcast(2)))

    quiet, logged = round_two(), round_two(**{"fedmr-grad-share-every": 1})
    for k, v in quiet["arrays"].items():
        assert np.array_equal(v.numpy(), logged["arrays"][k].numpy()), k
    assert "inter-grad-share" not in quiet["metrics"]
    paper = logged["metrics"]["inter-grad-share"]
    assert 0 < paper < 0.05 and logged["metrics"]["intra-grad-share"] > 0
    strong = round_two(**{"fedmr-grad-share-every": 1, "fedmr-mu2": 1e-2})["metrics"]["inter-grad-share"]
    assert strong / paper == pytest.approx(100, rel=0.3)


# ---------------------------------------------------------------------------------------------- strategy


def reply(
    strategy,
    pid: int,
    protos: np.ndarray,
    counts: np.ndarray,
    num: int = 100,
    drop: str = "",
    record: str = "fedmr-prototypes",
):
    from flwr.app import Message

    from fedskew.strategies.base import numpy_to_arrays

    out = Message(RecordDict(), dst_node_id=10 + pid, message_type="train")
    content = RecordDict(
        {
            "arrays": strategy.sent_arrays,
            "metrics": MetricRecord({"num-examples": num, "partition-id": pid, "train-seconds": 1.0}),
        }
    )
    if drop != "record":
        content[record] = numpy_to_arrays({"prototypes": protos, "counts": counts})
    return Message(content, reply_to=out)


def test_strategy_screens_replies_and_aggregates_prototypes(task_identity) -> None:
    from fedskew.config import validate
    from fedskew.strategies.fedmr import FedMRStrategy

    cfg = validate({"method": "fedmr", "fedmr-private-classes": "9"})
    s = FedMRStrategy(cfg)
    s.sent_arrays = s.initial_arrays()
    s.num_partitions = 7
    s.node_partitions = {10 + p: p for p in range(7)}
    s.class_counts = np.full((7, 10), 50)  # partitions of 50 examples a class: the counts below stay within
    c, d = 10, s.feature_dim
    ones, n = np.ones((c, d), np.float32), np.zeros(c, np.int64)
    good0 = reply(s, 0, ones, np.where(np.arange(c) < 2, 30, 0))
    good1 = reply(s, 1, 4 * ones, np.where(np.arange(c) == 1, 10, 0))
    bad = [
        reply(s, 2, ones, np.where(np.arange(c) == 3, -1, 0)),  # negative count
        reply(s, 3, np.ones((c, d + 1), np.float32), n),  # wrong shape
        reply(s, 4, np.full((c, d), np.nan, np.float32), n),  # NaN
        reply(s, 5, ones, n, drop="record"),  # no prototype record
        reply(s, 5, ones, np.full(c, 50), num=100),  # counts exceed num-examples
        reply(s, 6, ones, np.where(np.arange(c) == 9, 5, 0)),  # a private class
    ]
    new, metrics = s.aggregate_train(1, [bad[0], good1, bad[1], good0, *bad[2:]])
    assert new is not None and metrics["replies"] == 2 and metrics["failures"] == 6
    reasons = " | ".join(f["reason"] for f in s.failures)
    for word in ("holds -1 < 0", "expected float32", "NaN", "missing", "> num-examples", "private"):
        assert word in reasons, word
    assert s.valid.tolist() == [True, True] + [False] * 8  # class 9 private: never valid
    np.testing.assert_allclose(s.prototypes[0], 1.0)
    np.testing.assert_allclose(s.prototypes[1], (30 * 1 + 10 * 4) / 40)
    assert metrics["prototype-classes"] == 2
    down = s.broadcast(2)
    assert down["fedmr-prototypes"]["prototypes"].numpy().shape == (c, d)
    assert down["fedmr-prototypes"]["valid"].numpy().tolist() == s.valid.tolist()
    # next round: class 1 not held by anyone -> keeps its stale prototype
    s.aggregate_train(2, [reply(s, 0, 7 * ones, np.where(np.arange(c) == 0, 5, 0))])
    np.testing.assert_allclose(s.prototypes[0], 7.0)
    np.testing.assert_allclose(s.prototypes[1], 70 / 40)


# ---------------------------------------------------------------------------------------------- e2e


@pytest.mark.slow
def test_fedmr_flwr_run(flwr_job) -> None:
    summary, run_dir = flwr_job({"method": "fedmr", "num-server-rounds": 3}, num_supernodes=5, name="fedmr")
    rows = read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["failures"] == 0 and r["replies"] == 5 for r in rows)
    assert rows[0]["prototype-classes"] == 10  # P5C2 covers every class after round 1
    assert rows[0]["inter-loss"] == 0.0 and rows[1]["inter-loss"] > 0  # inter term from round 2 on
    assert math.isfinite(rows[-1]["intra-loss"])
    assert summary["best_global_accuracy"] > 0.3
