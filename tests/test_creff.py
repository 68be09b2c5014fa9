"""CReFF: the synthesis at CReFF's defaults, the re-trained classifier on a toy long tail, one
matching step against the authors' code (shangxinyi/CReFF-FL at commit
fbec98f1a49dfb8d9f346d98bf3f9568d9004687), the client's class gradients, the evaluated model,
server state and resume."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Error, Message

from fedskew.client_app.creff import CReFFTrainer
from fedskew.losses.creff import fresh_classifier, retrain_classifier
from fedskew.losses.mupfl import class_gradients, finetune_classifier, synthesize_features
from fedskew.methods.creff import CREFF_CLASSIFIER, CREFF_GRADS
from fedskew.models import build_model
from fedskew.training import torch_threads
from tests.harness import IN_FLOAT64, WIRE_ROUNDING, app_defaults, run_in_process
from tests.test_trainers import global_content, make_data, make_trainer


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as every client and the server's own training run (`torch-threads`)."""
    with torch_threads(torch.device("cpu"), 1):
        yield


class ToyLongTail:
    """Class-conditional ReLU'd Gaussian features of K = 10 classes in d = 32 dimensions."""

    k, d = 10, 32

    def __init__(self, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.means = torch.randn(self.k, self.d, generator=self.g).relu() * 1.5

    def sample(self, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
        return (self.means[y] + torch.randn(len(y), self.d, generator=self.g)).relu(), y

    def targets(self, weight: torch.Tensor, per_class: int = 32) -> dict[int, torch.Tensor]:
        """Real class gradients z^k at `weight` of a balanced sample (what clients would upload)."""
        x, y = self.sample([per_class] * self.k)
        return {c: class_gradients(weight, x[y == c], y[y == c])[c] for c in range(self.k)}


def test_fresh_classifier_is_nn_linears_initialisation_and_seeded() -> None:
    w = fresh_classifier(10, 84, torch.Generator().manual_seed(0))
    bound = 1 / 84**0.5
    assert w.shape == (10, 84) and float(w.abs().max()) <= bound and float(w.abs().max()) > 0.9 * bound
    assert torch.equal(w, fresh_classifier(10, 84, torch.Generator().manual_seed(0)))


def test_synthesis_at_creffs_defaults_reduces_its_matching_loss_by_a_large_factor() -> None:
    """CReFF's lr 0.1 and 100 iterations a round, m = 100 features per class, warm-started over three
    rounds against fixed real gradients at a fresh classifier (round 1's)."""
    cfg, toy = app_defaults(), ToyLongTail()
    weight = fresh_classifier(toy.k, toy.d, toy.g)
    targets = toy.targets(weight)
    feats = torch.randn(toy.k, cfg["creff-features-per-class"], toy.d, generator=toy.g)
    history = []
    for _ in range(3):
        feats, losses = synthesize_features(feats, weight, targets, cfg["creff-feature-lr"], cfg["creff-match-iters"])
        history += losses
    assert history[0] > 0.9 and history[-1] < history[0] / 10  # measured: 0.99 -> 0.18 -> 0.08 -> 0.05


def test_retrained_classifier_improves_balanced_accuracy_on_a_toy_long_tail() -> None:
    """A classifier trained on a long tail (IF 100) against one re-trained from scratch, CReFF's
    defaults, on features synthesised from balanced class gradients; on unsynthesised noise the
    re-training is at chance."""
    cfg, toy = app_defaults(), ToyLongTail()
    x_tail, y_tail = toy.sample((500 * 100 ** (-torch.arange(toy.k) / (toy.k - 1))).long().tolist())
    x_test, y_test = toy.sample([300] * toy.k)

    def balanced_accuracy(weight: torch.Tensor) -> float:
        pred = (x_test @ weight.T).argmax(1)
        return float(torch.stack([(pred[y_test == c] == c).float().mean() for c in range(toy.k)]).mean())

    biased = torch.nn.Linear(toy.d, toy.k, bias=False)
    torch.nn.init.zeros_(biased.weight)
    finetune_classifier(biased, x_tail, y_tail, 20, 64, 0.1, toy.g)
    weight = fresh_classifier(toy.k, toy.d, toy.g)
    start = torch.randn(toy.k, cfg["creff-features-per-class"], toy.d, generator=toy.g)
    feats, _ = synthesize_features(
        start, weight, toy.targets(weight), cfg["creff-feature-lr"], cfg["creff-match-iters"]
    )
    epochs, lr, batch = cfg["creff-retrain-epochs"], cfg["creff-retrain-lr"], cfg["batch-size"]
    retrained, _ = retrain_classifier(feats, epochs, batch, lr, toy.g)
    on_noise, _ = retrain_classifier(start, epochs, batch, lr, toy.g)
    before = balanced_accuracy(biased.weight.detach())
    assert balanced_accuracy(retrained) > before + 0.05  # measured: 0.843 -> 0.944
    assert balanced_accuracy(on_noise) < 0.3  # measured: 0.12


def test_one_matching_step_equals_the_authors_update_feature_syn() -> None:
    """main.py `Global.update_feature_syn`, one iteration with autograd: per class the CE gradient of
    the classifier on S_k (create_graph), `distance_wb` to the real gradient summed over classes,
    then SGD on S. The classifier has no bias here (fedskew's), so the code's bias term is absent."""
    torch.manual_seed(0)
    k, m, d, lr = 4, 6, 8, 0.1
    weight = torch.randn(k, d) * 0.3
    real = {c: torch.randn(k, d) for c in (0, 1, 3)}
    start = torch.randn(k, m, d)
    ours, _ = synthesize_features(start, weight, real, lr=lr, iterations=1)

    syn = start.reshape(k * m, d).clone().requires_grad_(True)
    net = torch.nn.Linear(d, k, bias=False)
    net.weight.data = weight.clone()
    loss = torch.tensor(0.0)
    for c, gwr in real.items():
        out = net(syn[c * m : (c + 1) * m])
        (gws,) = torch.autograd.grad(F.cross_entropy(out, torch.full((m,), c)), [net.weight], create_graph=True)
        loss = loss + torch.sum(1 - torch.sum(gwr * gws, dim=-1) / (gwr.norm(dim=-1) * gws.norm(dim=-1) + 1e-6))
    opt = torch.optim.SGD([syn], lr=lr)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert torch.allclose(ours, syn.detach().reshape(k, m, d), atol=1e-5)
    assert not torch.allclose(ours, start)


def authors_matching_step(start, weight, real, lr) -> torch.Tensor:
    """One iteration of main.py `Global.update_feature_syn` in float64, `distance_wb`'s cosine
    <a, b> / (||a|| ||b|| + 1e-6) as the code computes it (bias-free classifier, as fedskew's)."""
    k, m, d = start.shape
    syn = start.double().reshape(k * m, d).clone().requires_grad_(True)
    net = torch.nn.Linear(d, k, bias=False).double()
    net.weight.data = weight.double().clone()
    loss = torch.tensor(0.0, dtype=torch.float64)
    for c, gwr in real.items():
        out = net(syn[c * m : (c + 1) * m])
        (gws,) = torch.autograd.grad(F.cross_entropy(out, torch.full((m,), c)), [net.weight], create_graph=True)
        gwr = gwr.double()
        loss = loss + torch.sum(1 - torch.sum(gwr * gws, dim=-1) / (gwr.norm(dim=-1) * gws.norm(dim=-1) + 1e-6))
    opt = torch.optim.SGD([syn], lr=lr)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return syn.detach().reshape(k, m, d)


def test_near_zero_gradients_match_with_the_codes_cosine_only() -> None:
    """Real class gradients of norm about 1e-5 a row (a confident classifier's): the code's
    1 - <a, b> / (||a|| ||b|| + 1e-6) is far from a cosine there, so `cosine="creff-code"` follows
    the code's step (float64 both sides: 1e-16) where `F.cosine_similarity` (eps 1e-8, MuPFL's
    arithmetic and CReFF's before) does not (1e-2 apart)."""
    torch.manual_seed(1)
    k, m, d, lr = 4, 6, 8, 0.1
    weight = torch.randn(k, d, dtype=torch.float64) * 0.3
    real = {c: 3e-6 * torch.randn(k, d, dtype=torch.float64) for c in (0, 1, 3)}
    start = torch.randn(k, m, d, dtype=torch.float64)
    want = authors_matching_step(start, weight, real, lr)
    code, _ = synthesize_features(start, weight, real, lr=lr, iterations=1, cosine="creff-code")
    plain, _ = synthesize_features(start, weight, real, lr=lr, iterations=1)
    assert float((code - want).abs().max()) < 1e-12
    assert float((plain - want).abs().max()) > 1e-3


def creff_content(weight: torch.Tensor):
    content = global_content()
    content[CREFF_CLASSIFIER] = ArrayRecord({"weight": weight})
    return content


def test_client_takes_class_gradients_of_the_received_model_at_the_received_classifier() -> None:
    """Classes 1, 4, 7 of about 27 samples each: every draw of 32 takes all of a class, so the mean
    over draws is the class gradient of all its samples, on the received (untrained) backbone."""
    data = make_data()
    torch.manual_seed(3)
    weight = torch.randn(10, 200) * 0.1
    trainer = make_trainer(CReFFTrainer, data, method="creff", **IN_FLOAT64)  # float64: it sums per draw
    reply = trainer.fit(creff_content(weight))
    grads = reply[CREFF_GRADS]
    assert sorted(grads.keys()) == ["1", "4", "7"]
    received = build_model("mlp", "fashion-mnist").double()
    received.load_state_dict(global_content()["arrays"].to_torch_state_dict())
    with torch.no_grad():
        h = received.eval().features(data.x_train.double())
    for k in (1, 4, 7):
        want = class_gradients(weight.double(), h[data.y_train == k], data.y_train[data.y_train == k])[k]
        assert torch.allclose(torch.from_numpy(grads[str(k)].numpy()).double(), want, **WIRE_ROUNDING)
    # client-global-accuracy is CReFF's global model: the received backbone with W, not its own classifier
    received.classifier.weight.data = weight.double()
    with torch.no_grad():
        acc = float((received(data.x_test.double()).argmax(1) == data.y_test).float().mean())
    assert reply["metrics"]["client-global-accuracy"] == pytest.approx(acc)
    fours = torch.zeros(10, 200)
    fours[4] = 1.0  # ReLU features: this classifier predicts class 4 for every input
    reply = make_trainer(CReFFTrainer, data, method="creff").fit(creff_content(fours))
    share = float((data.y_test == 4).float().mean())
    assert share > 0 and reply["metrics"]["client-global-accuracy"] == pytest.approx(share)


def raise_error(msg: Message, reply: Message) -> Message:
    return Message(Error(code=0, reason="RuntimeError: injected client crash"), reply_to=msg)


def test_creff_in_process_evaluates_the_retrained_classifier_and_resumes_identically(tmp_path, task_identity) -> None:
    over = {"method": "creff", "model": "mlp", "partition": "dirichlet", "fraction-train": 1.0}
    over |= {"num-server-rounds": 2, "checkpoint-every": 1, "out-dir": str(tmp_path)}
    over |= {"creff-features-per-class": 10, "creff-match-iters": 20, "creff-retrain-epochs": 20}
    grid = run_in_process({**over, "run-name": "full"}, 4, None, 20)
    sent = [m.content for m in grid.sent if m.metadata.message_type == "train"]
    w1, w2 = (sent[i][CREFF_CLASSIFIER]["weight"].numpy() for i in (0, 4))
    assert all(
        (c[CREFF_CLASSIFIER]["weight"].numpy() == w).all() for c, w in zip(sent, [w1] * 4 + [w2] * 4, strict=True)
    )
    assert not (w1 == w2).all()  # round 2 takes its gradients at the classifier re-trained in round 1
    run = tmp_path / "full"
    model, ckpt = torch.load(run / "model.pt", weights_only=True), torch.load(run / "checkpoint.pt", weights_only=True)
    assert torch.equal(model["classifier.weight"], ckpt["strategy"]["classifier"])  # evaluated: W re-trained
    assert not torch.equal(model["classifier.weight"], ckpt["arrays"]["classifier.weight"])  # trained: FedAvg's
    assert all(torch.equal(model[k], ckpt["arrays"][k]) for k in model if k.startswith("features"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["creff-match-loss-last"] < r["creff-match-loss-first"] for r in rows)
    with pytest.raises(RuntimeError):
        run_in_process({**over, "run-name": "cut", "round-retries": 0}, 4, {(p, 2): raise_error for p in range(4)}, 20)
    run_in_process({**over, "run-name": "cut", "resume": True}, 4, None, 20)
    assert (tmp_path / "cut" / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
