"""FedGELA: ETF properties, local adaptation, frozen classifier, backbone-only payloads, e2e run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedskew.client_app.base import TrainerContext
from fedskew.client_app.fedgela import FedGELATrainer
from fedskew.client_app.state import ClientState
from fedskew.config import validate
from fedskew.data.clients import ClientData
from fedskew.losses.fedgela import (
    ETFNet,
    class_geometry,
    etf_checksum,
    etf_net,
    gela_logits,
    gela_model,
    local_phi,
    make_etf,
)
from fedskew.models import build_model
from fedskew.partitions.core import classes_per_client_pmcn, dirichlet
from fedskew.records import Rejected, check_content
from fedskew.strategies.fedgela import FedGELAStrategy
from fedskew.training import clip_before_step, evaluate
from tests.conftest import read_metrics
from tests.harness import IN_FLOAT64, WIRE_ROUNDING


def gram_target(c: int) -> torch.Tensor:
    return c / (c - 1) * torch.eye(c) - torch.ones(c, c) / (c - 1)


@pytest.mark.parametrize(("d", "c"), [(84, 10), (200, 10), (64, 10), (10, 10), (9, 10), (99, 100), (512, 100)])
def test_etf_is_a_simplex_etf(d: int, c: int) -> None:
    m = make_etf(d, c, seed=3)
    assert m.shape == (d, c) and m.dtype == torch.float32
    g = (m.T @ m).double()
    assert torch.allclose(g, gram_target(c).double(), atol=1e-5)  # unit columns, cosine -1/(C-1)
    assert torch.allclose(m.norm(dim=0), torch.ones(c), atol=1e-5)
    off = g[~torch.eye(c, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -1 / (c - 1)), atol=1e-5)
    assert torch.allclose(m @ torch.ones(c), torch.zeros(d), atol=1e-5)
    assert torch.linalg.matrix_rank(m.double(), tol=1e-4) == c - 1


def test_etf_dimension_check_and_determinism() -> None:
    with pytest.raises(ValueError, match="d >= 9"):
        make_etf(8, 10, seed=0)
    a, b, other = make_etf(84, 10, 0), make_etf(84, 10, 0), make_etf(84, 10, 1)
    assert torch.equal(a, b) and etf_checksum(a) == etf_checksum(b)
    assert not torch.allclose(a, other) and etf_checksum(a) != etf_checksum(other)
    assert torch.allclose(other.T @ other, a.T @ a, atol=1e-5)  # same geometry, other rotation


def test_local_phi() -> None:
    phi = local_phi(np.array([30, 10, 0, 0, 60, 0, 0, 0, 0, 0]))
    assert math.isclose(float(phi.sum()), 10.0, rel_tol=1e-6)
    assert torch.allclose(phi, torch.tensor([3.0, 1.0, 0, 0, 6.0, 0, 0, 0, 0, 0]))
    assert torch.equal(local_phi(np.full(10, 7)), torch.ones(10))
    assert torch.equal(local_phi(np.eye(10, dtype=int)[4] * 50), 10 * torch.eye(10)[4])


@pytest.mark.parametrize("split", ["pathological", "dirichlet"])
def test_averaged_adapted_classifiers_are_the_global_etf(split: str) -> None:
    """sum_k (n_k / n) W diag(phi_k) = W on a class-balanced federation (paper §3.3)."""
    labels = np.repeat(np.arange(10), 300)
    rng = np.random.default_rng(0)
    if split == "pathological":
        parts = classes_per_client_pmcn(labels, 20, 2, rng)
    else:
        parts = dirichlet(labels, 20, 0.1, rng, min_size=1)
    m = make_etf(84, 10, 0).double()
    n = sum(len(p) for p in parts)
    assert n == len(labels)
    avg = torch.zeros_like(m)
    for p in parts:
        phi = local_phi(np.bincount(labels[p], minlength=10)).double()
        assert (phi == 0).any()  # partial class-disjointness: the adaptation is not trivial
        avg += len(p) / n * m * phi.unsqueeze(0)
    assert torch.allclose(avg, m, atol=1e-6)


def test_logits_modes_and_single_class_client() -> None:
    """In float64: two paths' float32 sums round by the CPU's vector width; float64's stay below
    1e-10 apart on any x86 CPU (84 products of logits of order 100: at most about 1e-11)."""
    torch.manual_seed(0)
    h, m = torch.randn(8, 84, dtype=torch.float64), make_etf(84, 10, 0).double()
    phi = local_phi(np.eye(10, dtype=int)[3] * 40).double()  # a single-class client: phi = 10 e_3
    cos = torch.nn.functional.normalize(h, dim=1) @ m
    assert torch.allclose(gela_logits(h, m, 100.0), 100 * cos, rtol=0, atol=1e-10)
    assert torch.allclose(gela_logits(h, m, 100.0, torch.ones(10)), gela_logits(h, m, 100.0), rtol=0, atol=1e-10)
    # the global argmax does not depend on the scale or on the feature norm
    assert torch.equal(gela_logits(3 * h, m, 7.0).argmax(1), gela_logits(h, m, 100.0).argmax(1))
    y = torch.full((8,), 3)
    z_all, z_loc = gela_logits(h, m, 100.0, phi, "all"), gela_logits(h, m, 100.0, phi, "local")
    assert torch.all(z_all[:, phi == 0] == 0) and torch.all(torch.isneginf(z_loc[:, phi == 0]))
    assert torch.nn.functional.cross_entropy(z_all, y) > 0  # the default mode still learns
    assert torch.nn.functional.cross_entropy(z_loc, y) == 0  # Eq. (5) literal: nothing to learn


def test_logits_without_normalisation_are_scaled_inner_products() -> None:
    torch.manual_seed(0)
    h, m, phi = torch.randn(6, 84, dtype=torch.float64), make_etf(84, 10, 0).double(), local_phi(np.arange(10))
    assert torch.allclose(gela_logits(h, m, 5.0, phi.double(), normalize=False), 5.0 * (h @ m) * phi, atol=1e-12)


def etf_alignment(net: ETFNet, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over classes of cos(class mean of the unit features, m_c)."""
    with torch.no_grad():
        h = torch.nn.functional.normalize(net.features(x), dim=1)
    means = torch.stack([h[y == c].mean(0) for c in range(net.etf.shape[1])])
    return float(torch.nn.functional.cosine_similarity(means, net.etf.T, dim=1).mean())


def test_papers_head_reaches_the_etf_where_relu_features_cannot() -> None:
    """Theorem 1's limit h_c / ||h_c|| = m_c needs features of any sign. A backbone that ends in a ReLU
    has h >= 0, so cos(h, m_c) <= ||max(m_c, 0)||, 0.67 on average here (and 0.05 for class 0 of
    LeNet's 84 x 10 ETF); one FC layer after the backbone (§5) lifts that bound."""
    d, c = 16, 4
    etf = make_etf(d, c, seed=1)
    bound = float(etf.clamp(min=0).norm(dim=0).mean())
    assert bound < 0.7
    g = torch.Generator().manual_seed(0)
    y = torch.arange(c).repeat(64)
    x = 3 * torch.randn(c, 10, generator=g)[y] + torch.randn(len(y), 10, generator=g)
    aligned = {}
    for head in ("paper", "relu-only"):
        torch.manual_seed(0)
        trunk = torch.nn.Sequential(torch.nn.Linear(10, d), torch.nn.ReLU())
        # a small scale s = sqrt(E_W) = 2 keeps the loss from saturating before the features align
        net = etf_net(trunk, d, etf, "paper", 4.0, 1.0) if head == "paper" else ETFNet(trunk, etf, 2.0)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for _ in range(100):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        aligned[head] = etf_alignment(net, x, y)
    assert aligned["relu-only"] <= bound + 1e-4
    assert aligned["paper"] > 0.99 > bound + 0.1, aligned


def test_class_geometry_measures_the_distance_to_the_etf() -> None:
    """Features at their class's ETF vector: no within-class spread, every pair of class means at
    -1/(C-1), each aligned with its classifier vector; noise, a shift of all features, a wrong
    classifier and a missing class each move the measure they should."""
    d, c = 32, 5
    etf = make_etf(d, c, seed=3)
    y = torch.arange(c).repeat(40)
    h = 7.0 * etf.T[y] + 2.0  # any scale and any common offset
    g = class_geometry(h, y, etf.T, c)
    assert g["within / between"] == pytest.approx(0.0, abs=1e-12)
    assert g["cos between class means"] == pytest.approx(-1 / (c - 1))
    assert g["std of those cosines"] == pytest.approx(0.0, abs=1e-6)
    assert g["cos class mean / classifier"] == pytest.approx(1.0)
    noisy = class_geometry(h + 3.0 * torch.randn(h.shape, generator=torch.Generator().manual_seed(0)), y, etf.T, c)
    # within: 3^2 * d per sample; between: 7^2 * ||m_c||^2 = 49
    assert noisy["within / between"] == pytest.approx(9 * d / 49, rel=0.25)
    assert noisy["cos class mean / classifier"] < 0.99
    swapped = class_geometry(h, y, etf.T[[1, 0, 2, 3, 4]], c)
    assert swapped["cos class mean / classifier"] == pytest.approx((3 - 2 / (c - 1)) / c)
    four = class_geometry(h[y != 4], y[y != 4], etf.T, c)  # class 4 absent: left out, the rest re-centred
    assert four["cos between class means"] == pytest.approx(-1 / 3) and four["within / between"] < 1e-12
    with pytest.raises(ValueError, match="at least 2 classes"):
        class_geometry(h[y == 0], y[y == 0], etf.T, c)


# ---------------------------------------------------------------- client and server
def make_trainer(cfg: dict, labels: torch.Tensor, pid: int = 0) -> FedGELATrainer:
    g = torch.Generator().manual_seed(pid)
    x = torch.randn(len(labels), 1, 28, 28, generator=g) + labels.view(-1, 1, 1, 1).float()
    data = ClientData(x[:-10], labels[:-10], x[-10:], labels[-10:], 10)
    ctx = TrainerContext(cfg, data, torch.device("cpu"), ClientState(RecordDict(), 64, pid), pid, 1, g)
    return FedGELATrainer(ctx)


def server_message(strategy: FedGELAStrategy) -> RecordDict:
    arrays = strategy.initial_arrays()
    strategy.sent_arrays = arrays
    return RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1}), **strategy.broadcast(1)})


@pytest.mark.parametrize("head", ["paper", "code"])
def test_client_trains_backbone_only_and_uploads_it(task_identity, head: str) -> None:
    # 70 training samples in batches of 23: the last batch has one sample (BatchNorm1d must cope)
    cfg = validate({"method": "fedgela", "batch-size": 23, "local-epochs": 2, "fedgela-head": head})
    strategy = FedGELAStrategy(cfg)
    content = server_message(strategy)
    backbone = strategy.build_model().state_dict()
    assert backbone and all(k.startswith("features.") for k in backbone)
    assert any("running_mean" in k for k in backbone) == (head == "code")
    assert list(content["arrays"].keys()) == list(backbone)  # the downlink carries no classifier

    trainer = make_trainer(cfg, torch.tensor([1, 7] * 40))
    models: list[ETFNet] = []
    build = trainer.build_model
    trainer.build_model = lambda: models.append(build()) or models[-1]  # type: ignore[method-assign]
    reply = trainer.fit(content)
    model = models[0]
    # the classifier is frozen: not a parameter, bit-identical to the server's after training
    assert all(p.data_ptr() != model.etf.data_ptr() for p in model.parameters())
    assert torch.equal(model.etf, strategy.etf)
    assert torch.equal(model.phi, local_phi(trainer.data.train_counts))
    # the payload is exactly the backbone, and training changed it
    arrays = reply["arrays"]
    check_content(reply, strategy.reply_schema())  # passes the server's screen
    changed = [k for k in arrays if not np.array_equal(arrays[k].numpy(), content["arrays"][k].numpy())]
    assert changed
    assert 0.0 <= reply["metrics"]["personal-accuracy"] <= 1.0
    # a reply that carries a classifier is dropped
    bad = RecordDict(
        {
            "arrays": ArrayRecord(
                {**arrays, "classifier.weight": Array.from_torch_tensor(strategy.etf.T.contiguous())}
            ),
            "metrics": reply["metrics"],
        }
    )
    with pytest.raises(Rejected, match="unexpected"):
        check_content(bad, strategy.reply_schema())


def test_evaluated_global_model_keeps_the_trained_models_device(task_identity) -> None:
    """The plain-ETF global model is built from the trained one, on its device: on an H100 the ETF
    stayed on the CPU (the received copy) and every CUDA client failed ('mat2 is on cpu'). The meta
    device stands in for CUDA here: a tensor left behind on the CPU would show."""
    cfg = validate({"method": "fedgela"})
    trainer = make_trainer(cfg, torch.tensor([1, 7] * 40))
    trainer.receive(server_message(FedGELAStrategy(cfg)))
    model = trainer.build_model().to("meta")
    plain = trainer.received_global_model(model)
    assert {t.device.type for t in [*plain.parameters(), *plain.buffers()]} == {"meta"}
    assert plain.phi is None and model.phi is not None


def test_default_model_is_the_papers_head() -> None:
    """Backbone + one FC layer, L2-normalised, x sqrt(E_W) (§5): no BatchNorm whose averaged running
    statistics would be miscalibrated under label skew, and features of any sign."""
    strategy = FedGELAStrategy(validate({"method": "fedgela"}))
    model = strategy.build_model()
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert not any("running" in k for k in strategy.initial_arrays())
    last = list(model.features.modules())[-1]
    assert isinstance(last, torch.nn.Linear) and (last.in_features, last.out_features) == (84, 84)
    model.eval()
    x = torch.randn(8, 1, 28, 28)
    h = model.features(x)
    assert (h < 0).any()  # not ReLU features
    want = math.sqrt(strategy.cfg["fedgela-ew"]) * torch.nn.functional.normalize(h, dim=1) @ strategy.etf
    assert torch.allclose(model(x), want, atol=1e-4)


class AuthorsNet(torch.nn.Module):
    """The authors' `model_cifar` (`model.py`) for LeNet features with proxy "etf": backbone, then
    `encoder` Linear(d, d) - ReLU - Linear(d, d), then `proxy` BatchNorm1d(d)."""

    def __init__(self, backbone: torch.nn.Module, d: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.encoder = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d))
        self.proxy = torch.nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proxy(self.encoder(self.backbone(x)))


def authors_train_step(
    net: AuthorsNet, etf: torch.Tensor, x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[float, float]:
    """One step of the authors' `train_net` (`FedGELA.py`), re-stated: returns (loss, gradient norm)."""
    uni, count = torch.unique(labels, return_counts=True)  # produce_Ew
    ew = torch.zeros(etf.shape[1], dtype=torch.float64)
    ew[uni] = count.double() / len(labels)
    ew = (ew * etf.shape[1]).float().to(etf.dtype)  # rounded to float32 once, as `local_phi` holds it
    optimizer = torch.optim.SGD([{"params": net.parameters()}], lr=0.05, momentum=0.9, weight_decay=1e-4)
    optimizer.zero_grad()
    out_g = torch.matmul(net(x), ew * etf)
    loss = torch.nn.NLLLoss()(torch.nn.LogSoftmax(dim=1)(out_g / temperature), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=20, norm_type=2)
    optimizer.step()
    return loss.item(), norm.item()


@pytest.mark.parametrize("temperature", [0.2, 20.0])
def test_code_head_equals_the_authors_train_net(task_identity, temperature: float) -> None:
    """`fedgela-head="code"`: one local step (a single batch) gives the loss and the parameters that
    the authors' train_net gives from the same weights, i.e. the same (clipped) gradients."""
    cfg = validate({"method": "fedgela", "fedgela-head": "code", "fedgela-temperature": temperature, "batch-size": 100})
    cfg.update({"lr": 0.05, **IN_FLOAT64})  # both sides in float64: the trainer shuffles its batch
    strategy = FedGELAStrategy(cfg)
    content = server_message(strategy)
    trainer = make_trainer(cfg, torch.tensor([1, 7, 7, 3] * 15))  # 50 training samples, one batch
    reply = trainer.fit(content)

    ours_to_authors = {"features.0.": "backbone.", "features.1.0.": "encoder.0.", "features.1.2.": "encoder.2."}
    ours_to_authors["features.1.3."] = "proxy."

    def authors_name(key: str) -> str:
        prefix = next(p for p in ours_to_authors if key.startswith(p))
        return ours_to_authors[prefix] + key[len(prefix) :]

    start = content["arrays"].to_torch_state_dict()
    net = AuthorsNet(build_model("lenet", "fashion-mnist").features, 84).double()
    assert sorted(net.state_dict()) == sorted(authors_name(k) for k in start)  # same architecture
    net.load_state_dict({authors_name(k): v for k, v in start.items()})
    x, y = trainer.data.x_train, trainer.data.y_train
    assert x.dtype == torch.float64
    loss, norm = authors_train_step(net, strategy.etf.double(), x, y, y, temperature)
    assert (norm > 20) == (temperature == 0.2)  # the clip acts in one case and not in the other

    assert math.isclose(reply["metrics"]["train-loss"], loss, rel_tol=2**-23)  # summed in float32: one rounding
    ours = reply["arrays"].to_torch_state_dict()
    theirs = net.state_dict()
    for k, v in ours.items():  # rounded to float32 on the wire
        assert torch.allclose(v.double(), theirs[authors_name(k)].double(), **WIRE_ROUNDING), k
    moved = [k for k in ours if not torch.equal(ours[k], start[k]) and ours[k].is_floating_point()]
    assert len(moved) == sum(1 for v in ours.values() if v.is_floating_point())  # every tensor took the step


def test_single_class_client_learns_in_default_mode_only(task_identity) -> None:
    labels = torch.full((60,), 4)
    for mode, learns in (("all", True), ("local", False)):
        cfg = validate({"method": "fedgela", "fedgela-mode": mode, "batch-size": 20, "weight-decay": 0.0})
        strategy = FedGELAStrategy(cfg)
        content = server_message(strategy)
        reply = make_trainer(cfg, labels).fit(content)
        same = all(np.array_equal(reply["arrays"][k].numpy(), content["arrays"][k].numpy()) for k in content["arrays"])
        assert same != learns, mode


def test_tampered_or_misshaped_etf_is_refused(task_identity) -> None:
    cfg = validate({"method": "fedgela"})
    content = server_message(FedGELAStrategy(cfg))
    etf = torch.from_numpy(content["etf"]["etf"].numpy())
    trainer = make_trainer(cfg, torch.tensor([1, 7] * 40))
    trainer.receive(content)
    assert torch.equal(trainer.etf, etf)
    content["etf"] = ArrayRecord({"etf": torch.zeros(200, 10)})
    with pytest.raises(ValueError, match="expected float32"):
        trainer.receive(content)
    content["etf"] = ArrayRecord({"etf": etf * 1.01})  # columns no longer of unit norm
    with pytest.raises(ValueError, match="not a simplex ETF"):
        trainer.receive(content)
    content["etf"] = ArrayRecord({"etf": make_etf(etf.shape[0], etf.shape[1], seed=1)})  # another ETF
    with pytest.raises(ValueError, match="checksum"):
        trainer.receive(content)


@pytest.mark.parametrize(("head", "scale", "normalize"), [("paper", 10.0, True), ("code", 1.0, False)])
def test_global_model_uses_plain_etf(head: str, scale: float, normalize: bool) -> None:
    """The server's evaluated model: the plain ETF, scaled by sqrt(E_W) (paper) or, for the authors'
    head, not scaled (their `compute_accuracy_g`: `out = h @ ETF`, no division by the temperature)."""
    cfg = validate({"method": "fedgela", "fedgela-head": head, "fedgela-ew": 100.0, "fedgela-temperature": 0.25})
    strategy = FedGELAStrategy(cfg)
    model = strategy.global_model(strategy.initial_arrays())
    assert isinstance(model, ETFNet) and model.phi is None and torch.equal(model.etf, strategy.etf)
    model.eval()
    x = torch.randn(4, 1, 28, 28)
    want = gela_logits(model.features(x), strategy.etf, scale, normalize=normalize)
    assert torch.allclose(model(x), want, atol=1e-5)


def test_code_head_divides_by_the_temperature_in_training_only(task_identity) -> None:
    """`fedgela-head="code"` as the authors' `FedGELA.py` (commit b5b20d5): `train_net` trains on
    log_softmax(h @ (phi ETF) / T); `compute_accuracy_l` predicts from h @ (phi ETF) and
    `compute_accuracy_g` logs CrossEntropyLoss(h @ ETF): the same predictions, undivided logits."""
    cfg = validate({"method": "fedgela", "fedgela-head": "code", "fedgela-temperature": 0.2})
    strategy = FedGELAStrategy(cfg)
    phi = local_phi(np.array([0, 30, 0, 0, 0, 0, 0, 10, 0, 0])).double()
    etf = strategy.etf.double()
    model = gela_model(cfg, etf, phi).double()  # float64: two arithmetic paths compared on any CPU
    x, y = torch.randn(8, 1, 28, 28, dtype=torch.float64), torch.tensor([1, 7] * 4)
    model.train()
    h = model.features(x)
    assert torch.allclose(model(x), h @ (phi * etf) / 0.2, rtol=0, atol=1e-10)  # train_net's logits
    model.eval()
    with torch.no_grad():
        h = model.features(x)
        out = h @ (phi * etf)  # compute_accuracy_l
        assert torch.allclose(model(x), out, rtol=0, atol=1e-10)
        assert torch.allclose(out, h @ model.class_weights().T, rtol=0, atol=1e-10)  # the vectors scored against
        glo = model.plain()
        loss, accuracy = evaluate(glo, x, y, 4, torch.device("cpu"))
        authors = h @ etf  # compute_accuracy_g
        assert loss == pytest.approx(float(F.cross_entropy(authors, y)), rel=1e-10)
        assert accuracy == pytest.approx(float((authors.argmax(1) == y).float().mean()))
        assert loss != pytest.approx(float(F.cross_entropy(authors / 0.2, y)), rel=1e-3)  # the old, divided ones


def test_client_global_accuracy_is_the_servers_global_model_on_local_data(task_identity) -> None:
    """FedGELA's received global model is the backbone with the plain ETF (the server's model), not
    the client's adapted classifier: its logits on the local test split equal the server's."""
    cfg = validate({"method": "fedgela", "batch-size": 20})
    strategy = FedGELAStrategy(cfg)
    content = server_message(strategy)
    trainer = make_trainer(cfg, torch.tensor([1, 7, 7, 7] * 20))
    logits: list[torch.Tensor] = []
    evaluate_local = trainer.evaluate_local

    def record(model: torch.nn.Module) -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            logits.append(model(trainer.data.x_test))
        return evaluate_local(model)

    trainer.evaluate_local = record  # type: ignore[method-assign]
    reply = trainer.fit(content)
    global_model = strategy.global_model(content["arrays"])
    global_model.eval()
    with torch.no_grad():
        expected = global_model(trainer.data.x_test)
    assert torch.allclose(logits[0], expected, atol=1e-5)  # the first evaluation: before training
    accuracy = float((expected.argmax(1) == trainer.data.y_test).float().mean())
    assert reply["metrics"]["client-global-accuracy"] == pytest.approx(accuracy)


def test_gradient_clipping_hook() -> None:
    w = torch.nn.Parameter(torch.zeros(5))
    opt = torch.optim.SGD([w], lr=1.0)
    clip_before_step(opt, 2.0)
    w.grad = torch.full((5,), 100.0)
    opt.step()
    assert math.isclose(float(w.detach().norm()), 2.0, rel_tol=1e-5)  # the step used the clipped gradient


@pytest.mark.slow
def test_fedgela_end_to_end(flwr_job) -> None:
    summary, run_dir = flwr_job({"method": "fedgela", "num-server-rounds": 3}, num_supernodes=5, name="fedgela")
    assert summary["method"] == "fedgela"
    assert summary["final_personalized_accuracy"] > 0.8  # 2 classes per client
    rows = read_metrics(run_dir)
    # 3 rounds of 2-class clients are too few for a reliable global accuracy, but the test loss must fall
    assert rows[-1]["global-loss"] < rows[0]["global-loss"]
    assert [r["round"] for r in rows] == [1, 2, 3] and all(r["failures"] == 0 for r in rows)
    saved = torch.load(run_dir / "model.pt", weights_only=True)
    assert saved and all(k.startswith("features.") for k in saved)  # the global arrays are the backbone
