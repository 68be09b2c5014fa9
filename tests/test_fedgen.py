"""FedGen: the generator's losses and training, the client regulariser, label-count screening, server
state and resume. Reference formulas are derived from the authors' code, zhuangdizhu/FedGen at
commit dd5807c5625404e99035d97e2ef8c712c2e007a6."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Error, Message, MetricRecord, RecordDict

from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.fedgen import FedGenTrainer
from fedskew.config import ConfigError, validate
from fedskew.losses.fedgen import (
    Generator,
    client_regulariser,
    diversity_loss,
    label_weights,
    regulariser_weight,
    teacher_loss,
    train_generator,
)
from fedskew.methods.fedgen import FEDGEN_COUNTS, FEDGEN_GENERATOR
from fedskew.strategies.fedgen import FedGenStrategy
from fedskew.training import torch_threads
from tests.harness import app_defaults, run_in_process
from tests.test_trainers import global_content, make_data, make_trainer


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as every client and the server's own training run (`torch-threads`)."""
    with torch_threads(torch.device("cpu"), 1):
        yield


def authors_diversity(noise: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """`DiversityLoss('l1').forward` of the authors' generator.py, written out."""

    def pairwise(t: torch.Tensor) -> torch.Tensor:
        n = t.size(0)
        return t.expand((n, n, t.size(1))), t.unsqueeze(1)

    a, b = pairwise(layer)
    layer_dist = torch.abs(a - b).mean(dim=(2,))
    a, b = pairwise(noise)
    noise_dist = torch.pow(a - b, 2).mean(dim=(2,))
    return torch.exp(torch.mean(-noise_dist * layer_dist))


def test_diversity_loss_matches_a_hand_computation_and_the_authors_code() -> None:
    eps = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    feats = torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    # off-diagonal pairs: squared noise distance 1, absolute feature distance 2; mean over 4 entries = 1
    assert float(diversity_loss(eps, feats)) == pytest.approx(np.exp(-1.0))
    assert float(diversity_loss(eps, torch.zeros(2, 3))) == pytest.approx(1.0)  # collapsed: the maximum
    torch.manual_seed(0)
    eps, feats = torch.rand(16, 32), torch.randn(16, 84)
    assert torch.allclose(diversity_loss(eps, feats), authors_diversity(eps, feats))


def test_label_weights_normalise_each_label_over_clients() -> None:
    counts = torch.tensor([[3, 0, 0], [1, 2, 0]])  # 2 clients, 3 classes; nobody holds class 2
    w = label_weights(counts)
    assert w.shape == (3, 2)
    assert torch.allclose(w, torch.tensor([[0.75, 0.25], [0.0, 1.0], [0.0, 0.0]]))


def test_teacher_loss_weights_each_sample_by_its_labels_client_weights() -> None:
    torch.manual_seed(0)  # float64: two summation orders, equal to 1e-12 on any CPU
    clfs, h = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 2, 0])
    w = torch.tensor([[0.75, 0.25], [0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    hand = sum(w[y[i], k] * F.cross_entropy((h[i : i + 1] @ clfs[k].T), y[i : i + 1]) for i in range(5) for k in (0, 1))
    assert float(teacher_loss(h, y, clfs, w)) == pytest.approx(float(hand) / 5, rel=1e-12)

    def authors(labels: torch.Tensor) -> torch.Tensor:
        """serverpFedGen.py: mean(NLL (B,) * weight (B, 1)), which broadcasts to (B, B)."""
        total = 0
        for k in range(2):
            logp = F.log_softmax(h @ clfs[k].T, dim=1)
            total = total + torch.mean(F.nll_loss(logp, labels, reduction="none") * w[labels][:, k].reshape(-1, 1))
        return total

    one_label = torch.ones(5, dtype=torch.long)  # one label a batch: the two agree
    assert float(teacher_loss(h, one_label, clfs, w)) == pytest.approx(float(authors(one_label)), rel=1e-12)
    assert float(teacher_loss(h, y, clfs, w)) != pytest.approx(float(authors(y)), rel=1e-3)  # the documented deviation


def test_generator_training_loss_falls_on_a_fixed_toy_ensemble() -> None:
    """Five rounds of the defaults (50 Adam steps each, lr x 0.98 a round) against five fixed random
    classifiers: the count-weighted teacher loss falls by a large factor, and the label-holders'
    ensemble then classifies the generated features as their labels."""
    cfg = app_defaults()
    torch.manual_seed(0)
    k, d, n = 10, 84, 5
    classifiers, counts = torch.randn(n, k, d) * 0.3, torch.randint(0, 50, (n, k))
    generator = Generator(k, d, cfg["fedgen-hidden-dim"], cfg["fedgen-noise-dim"])
    opt = torch.optim.Adam(generator.parameters(), lr=cfg["fedgen-lr"], weight_decay=cfg["fedgen-weight-decay"])
    rng = torch.Generator().manual_seed(0)
    teacher = []
    for r in range(5):
        for group in opt.param_groups:
            group["lr"] = cfg["fedgen-lr"] * 0.98**r
        stats = train_generator(
            generator, opt, classifiers, counts, cfg["fedgen-iterations"], 64, cfg["fedgen-eta"], rng
        )
        teacher.append(stats["teacher-loss"])
    assert teacher[-1] < teacher[0] / 10  # measured: 1.60 -> 0.065 (10 rounds: 0.012)
    generator.eval()
    labels = torch.arange(k).repeat(20)
    with torch.no_grad():
        feats, _ = generator.generate(labels, rng)
        ensemble = torch.einsum("bd,nkd,kn->bk", feats, classifiers, label_weights(counts))  # count-weighted logits
    assert float((ensemble.argmax(1) == labels).float().mean()) > 0.95


def test_client_regulariser_equals_the_authors_terms() -> None:
    """userpFedGen.py's loss for one batch: NLL(log_softmax) + gen_ratio * alpha * NLL on generated
    features of sampled labels + beta * KLDivLoss(batchmean)(log_softmax(model(x)), softmax(W G(y)))."""
    torch.manual_seed(0)  # float64: the two sides reduce differently (batchmean vs weighted padded sum)
    clf = torch.nn.Linear(6, 4, bias=False).double()
    logits = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    gen_y, gen_s = torch.randn(8, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    sampled = torch.randint(0, 4, (5,))
    alpha, beta, ratio = 9.8, 9.8, 5 / 8
    total, teacher_term, latent_term = client_regulariser(
        clf, logits, gen_y, gen_s, sampled, torch.tensor([ratio * alpha, beta], dtype=torch.float64)
    )
    with torch.no_grad():
        target = F.softmax(clf(gen_y), dim=1).clone().detach()
        latent = beta * torch.nn.KLDivLoss(reduction="batchmean")(F.log_softmax(logits, dim=1), target)
        teacher = alpha * torch.mean(torch.nn.NLLLoss(reduction="none")(F.log_softmax(clf(gen_s), dim=1), sampled))
    assert float(total.detach()) == pytest.approx(float(ratio * teacher + latent), rel=1e-10)
    total.backward()
    assert logits.grad is not None and clf.weight.grad is not None  # both terms train the model
    # the batched engine's form: the batch's 8 rows weighted 1/8, 3 padding rows weighted 0
    pad = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    weight = torch.cat([torch.full((8,), 1 / 8, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)])
    _, teacher_w, latent_w = client_regulariser(
        clf, torch.cat([logits, pad[0]]), torch.cat([gen_y, pad[1]]), gen_s, sampled, torch.ones(2).double(), weight
    )
    assert float(teacher_w.detach()) == float(teacher_term.detach())  # the same operations on the same rows
    assert float(latent_w.detach()) == pytest.approx(float(latent_term.detach()), rel=1e-10)


def test_regulariser_weight_decays_from_round_two_to_its_floor() -> None:
    assert regulariser_weight(10.0, 1) == 10.0
    assert regulariser_weight(10.0, 2) == pytest.approx(9.8)
    assert regulariser_weight(10.0, 1000) == 1e-4
    assert regulariser_weight(0.0, 5) == 0.0  # off


def generator_content(seed: int = 0) -> tuple[dict, Generator]:
    torch.manual_seed(seed)
    generator = Generator(10, 200)  # mlp features: d = 200
    content = global_content()
    content[FEDGEN_GENERATOR] = ArrayRecord(generator.state_dict())
    return content, generator


def test_client_is_fedavg_without_a_generator_and_its_regulariser_acts_with_one() -> None:
    data = make_data()
    fedavg = make_trainer(FedAvgTrainer, data).fit(global_content())
    plain = make_trainer(FedGenTrainer, data, method="fedgen").fit(global_content())
    for k in fedavg["arrays"].keys():
        assert np.array_equal(plain["arrays"][k].numpy(), fedavg["arrays"][k].numpy())
    counts = plain[FEDGEN_COUNTS]["counts"].numpy()
    assert counts.dtype == np.int64 and np.array_equal(counts, np.bincount(data.y_train.numpy(), minlength=10))
    assert "fedgen-teacher-loss" not in plain["metrics"]

    content, _ = generator_content()
    regularised = make_trainer(FedGenTrainer, data, method="fedgen").fit(content)
    moved = [
        k
        for k in fedavg["arrays"].keys()
        if not np.array_equal(regularised["arrays"][k].numpy(), fedavg["arrays"][k].numpy())
    ]
    assert "classifier.weight" in moved and any(k.startswith("features") for k in moved)
    assert regularised["metrics"]["fedgen-teacher-loss"] > 0 and regularised["metrics"]["fedgen-latent-loss"] >= 0
    off = make_trainer(FedGenTrainer, data, method="fedgen", **{"fedgen-alpha": 0.0, "fedgen-beta": 0.0}).fit(content)
    for k in fedavg["arrays"].keys():  # both weights 0: the generator's draws leave FedAvg's batches alone
        assert np.array_equal(off["arrays"][k].numpy(), fedavg["arrays"][k].numpy())


def test_batch_size_one_is_refused_for_the_generators_batchnorm() -> None:
    with pytest.raises(ConfigError, match="fedgen-iterations"):
        validate({"method": "fedgen", "batch-size": 1})
    validate({"method": "fedavg", "batch-size": 1})
    validate({"method": "fedgen", "batch-size": 1, "fedgen-iterations": 0})


def test_server_state_restores_the_generator_its_optimiser_and_its_decay(task_identity) -> None:
    cfg = validate({**app_defaults(), "method": "fedgen", "model": "mlp", "fedgen-iterations": 5})

    def replies(seed: int) -> list[Message]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(3):
            content = RecordDict(
                {
                    "arrays": ArrayRecord({"classifier.weight": torch.randn(10, 200, generator=g)}),
                    FEDGEN_COUNTS: ArrayRecord({"counts": torch.randint(0, 20, (10,), generator=g)}),
                    "metrics": MetricRecord({}),
                }
            )
            out.append(Message(content, dst_node_id=1, message_type="train"))
        return out

    first = FedGenStrategy(cfg)
    assert first.broadcast(1) == {}  # nothing to send before the generator was trained
    first.aggregate_extras(1, replies(1))
    assert FEDGEN_GENERATOR in first.broadcast(2)
    resumed = FedGenStrategy(cfg)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert (
        resumed.rounds == 1
        and resumed.optimizer.state_dict()["state"].keys() == first.optimizer.state_dict()["state"].keys()
    )
    a, b = first.aggregate_extras(2, replies(2)), resumed.aggregate_extras(2, replies(2))
    assert json.dumps(a) == json.dumps(b)
    sa, sb = first.state_dict(), resumed.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    fresh = FedGenStrategy(cfg)  # without the optimiser's moments the same round trains differently
    fresh.generator.load_state_dict(first.generator.state_dict())
    fresh.rounds = first.rounds
    fresh.aggregate_extras(3, replies(3))
    first.aggregate_extras(3, replies(3))
    assert not torch.equal(fresh.generator.representation.weight, first.generator.representation.weight)


def raise_error(msg: Message, reply: Message) -> Message:
    return Message(Error(code=0, reason="RuntimeError: injected client crash"), reply_to=msg)


def test_fedgen_in_process_sends_the_generator_from_round_two_and_resumes_identically(tmp_path, task_identity) -> None:
    over = {"method": "fedgen", "model": "mlp", "partition": "iid", "fraction-train": 1.0, "num-server-rounds": 2}
    over |= {"checkpoint-every": 1, "out-dir": str(tmp_path), "fedgen-iterations": 10}
    grid = run_in_process({**over, "run-name": "full"}, 4, None, 20)
    train = [m.content for m in grid.sent if m.metadata.message_type == "train"]
    assert [FEDGEN_GENERATOR in c for c in train] == [False] * 4 + [True] * 4
    full = (tmp_path / "full" / "metrics.jsonl").read_text()
    rows = [json.loads(line) for line in full.splitlines()]
    assert rows[1]["fedgen-teacher-loss"] > 0 and rows[0]["generator-teacher-loss"] > 0
    with pytest.raises(RuntimeError):
        run_in_process({**over, "run-name": "cut", "round-retries": 0}, 4, {(p, 2): raise_error for p in range(4)}, 20)
    run_in_process({**over, "run-name": "cut", "resume": True}, 4, None, 20)
    assert (tmp_path / "cut" / "metrics.jsonl").read_text() == full
