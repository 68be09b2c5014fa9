"""Client trainers on synthetic data, without Flower's runtime."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedskew.client_app.base import BaseTrainer
from fedskew.client_app.fedavg import FedAvgTrainer
from fedskew.client_app.fedprox import FedProxTrainer
from fedskew.client_app.fedrs import FedRSTrainer
from fedskew.config import validate
from fedskew.data.clients import ClientData
from fedskew.models import build_model
from fedskew.training import seed_everything
from tests.harness import trainer_context

OBSERVED = (1, 4, 7)


def make_data(n: int = 96, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(OBSERVED)[torch.randint(0, len(OBSERVED), (n,), generator=g)]
    x = torch.randn(n, 1, 28, 28, generator=g) + y.view(-1, 1, 1, 1) * 0.3
    return ClientData(x[:80], y[:80], x[80:], y[80:], 10)


def make_trainer(
    cls: type, data: ClientData, *, state: RecordDict | None = None, server_round: int = 1, **overrides
) -> BaseTrainer:
    """A trainer of round `server_round` whose client state lives in `state` (fresh by default)."""
    cfg = validate({"model": "mlp", "batch-size": 16, "local-epochs": 2, **overrides})
    return cls(trainer_context(cfg, data, state, 0, server_round, seed_everything(cfg["seed"], 0, server_round)))


def global_content(seed: int = 0, server_round: int = 1, **records) -> RecordDict:
    """The server's train message: a seeded mlp, the round config and `records` (names with '_')."""
    torch.manual_seed(seed)
    model = build_model("mlp", "fashion-mnist")
    extra = {k.replace("_", "-"): v for k, v in records.items()}
    config = ConfigRecord({"server-round": server_round})
    return RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": config, **extra})


def test_fedavg_reply_has_same_arrays_and_the_metrics_the_server_needs() -> None:
    content = global_content()
    reply = make_trainer(FedAvgTrainer, make_data()).fit(content)
    sent, got = content["arrays"], reply["arrays"]
    assert list(got.keys()) == list(sent.keys())
    assert all(got[k].shape == sent[k].shape and got[k].dtype == sent[k].dtype for k in sent.keys())
    m = reply["metrics"]
    assert m["num-examples"] == 80 and m["partition-id"] == 0 and m["personal-num-test"] == 16
    assert 0.0 <= m["personal-accuracy"] <= 1.0
    assert not any("count" in k for k in m.keys())  # label counts never leave the client


def test_fedrs_alpha_one_equals_fedavg() -> None:
    a = make_trainer(FedAvgTrainer, make_data()).fit(global_content())["arrays"].to_torch_state_dict()
    b = make_trainer(FedRSTrainer, make_data(), **{"fedrs-alpha": 1.0}).fit(global_content())["arrays"]
    for k, v in b.to_torch_state_dict().items():
        assert torch.allclose(v, a[k], atol=1e-6), k


def test_fedrs_alpha_zero_without_decay_freezes_missing_rows() -> None:
    content = global_content()
    w0 = content["arrays"].to_torch_state_dict()["classifier.weight"].clone()
    trainer = make_trainer(FedRSTrainer, make_data(), **{"fedrs-alpha": 0.0, "weight-decay": 0.0})
    w1 = trainer.fit(content)["arrays"].to_torch_state_dict()["classifier.weight"]
    missing = [c for c in range(10) if c not in OBSERVED]
    assert torch.equal(w1[missing], w0[missing])
    assert not torch.allclose(w1[list(OBSERVED)], w0[list(OBSERVED)])


def test_fedrs_alpha_zero_with_decay_keeps_missing_directions() -> None:
    content = global_content()
    w0 = content["arrays"].to_torch_state_dict()["classifier.weight"].clone()
    trainer = make_trainer(FedRSTrainer, make_data(), **{"fedrs-alpha": 0.0, "weight-decay": 0.01})
    w1 = trainer.fit(content)["arrays"].to_torch_state_dict()["classifier.weight"]
    for c in (c for c in range(10) if c not in OBSERVED):
        cos = torch.nn.functional.cosine_similarity(w1[c].double(), w0[c].double(), dim=0)  # not a float32 sum
        assert cos == pytest.approx(1.0, abs=1e-9) and w1[c].norm() < w0[c].norm()


def test_fedrs_scale_is_fixed_for_the_whole_round() -> None:
    trainer = make_trainer(FedRSTrainer, make_data(), **{"fedrs-alpha": 0.5})
    seen: list[torch.Tensor] = []
    original = trainer.loss

    def spy(model, x, y):
        seen.append(trainer.scale.clone())
        return original(model, x, y)

    trainer.loss = spy
    trainer.fit(global_content())
    assert len(seen) == 10  # 2 epochs x 5 batches
    assert all(torch.equal(s, seen[0]) for s in seen)
    expected = np.where(np.isin(np.arange(10), OBSERVED), 1.0, 0.5)
    assert np.allclose(seen[0].numpy(), expected)


def test_fedprox_pulls_towards_the_global_model() -> None:
    content = global_content()
    w0 = content["arrays"].to_torch_state_dict()

    def dist(trainer_cls, **kw) -> float:
        out = make_trainer(trainer_cls, make_data(), **kw).fit(content)["arrays"].to_torch_state_dict()
        return sum(float((out[k] - w0[k]).pow(2).sum()) for k in w0)

    assert dist(FedProxTrainer, **{"fedprox-mu": 5.0}) < dist(FedProxTrainer, **{"fedprox-mu": 0.0})
    assert dist(FedProxTrainer, **{"fedprox-mu": 0.0}) == pytest.approx(dist(FedAvgTrainer), rel=1e-5)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda a: a.pop("classifier.weight"), "missing"),
        (lambda a: a.__setitem__("classifier.weight", torch.zeros(2, 2)), "expected"),
        (lambda a: a["classifier.weight"].fill_(float("nan")), "NaN"),
    ],
)
def test_client_rejects_bad_server_arrays(edit, needle: str) -> None:
    content = global_content()
    arrays = content["arrays"].to_torch_state_dict()
    edit(arrays)
    content["arrays"] = ArrayRecord(arrays)
    with pytest.raises(ValueError, match=needle):
        make_trainer(FedAvgTrainer, make_data()).fit(content)


def test_warmup_lr_ramps_linearly_then_holds() -> None:
    from fedskew.training import warmup_lr

    assert [warmup_lr(0.03, r, 5) for r in (1, 2, 5, 6, 100)] == pytest.approx([0.006, 0.012, 0.03, 0.03, 0.03])
    assert warmup_lr(0.03, 1, 0) == 0.03  # off


def test_round_lr_combines_warm_up_and_step_decay() -> None:
    from fedskew.training import round_lr

    cfg = validate({"lr": 0.01, "lr-decay": 0.5, "lr-decay-every": 3, "lr-warmup-rounds": 2})
    assert [round_lr(cfg, r) for r in (1, 2, 3, 4, 6, 7)] == pytest.approx([0.005, 0.01, 0.01, 0.005, 0.005, 0.0025])
    assert round_lr(validate({"lr": 0.01}), 40) == 0.01  # defaults: constant


def test_client_global_accuracy_is_the_received_model_on_the_local_test_split() -> None:
    """`client-global-accuracy` evaluates the model as received (before local training), on the same
    local test split as the personalized model; training then moves the personalized accuracy."""
    data, content = make_data(), global_content()
    reply = make_trainer(FedAvgTrainer, data).fit(content)
    received = build_model("mlp", "fashion-mnist")
    received.load_state_dict(content["arrays"].to_torch_state_dict())
    received.eval()
    with torch.no_grad():
        expected = float((received(data.x_test).argmax(1) == data.y_test).float().mean())
    m = reply["metrics"]
    assert m["client-global-accuracy"] == pytest.approx(expected)
    assert m["personal-accuracy"] > m["client-global-accuracy"] + 0.3  # an untrained MLP vs a trained one


def test_grad_clip_bounds_every_local_step() -> None:
    """`grad-clip` > 0: the step uses the gradient clipped to that norm (MAP/FedRS code: 100)."""
    from fedskew.training import sgd

    for clip, expected in ((2.0, 2.0), (0.0, 100 * 5**0.5)):
        w = torch.nn.Parameter(torch.zeros(5))
        opt = sgd([w], validate({"lr": 1.0, "momentum": 0.0, "weight-decay": 0.0, "grad-clip": clip}))
        w.grad = torch.full((5,), 100.0)
        opt.step()
        assert float(w.detach().norm()) == pytest.approx(expected, rel=1e-5)


def test_a_cuda_device_is_put_in_deterministic_mode(monkeypatch) -> None:
    """Same seed, same metrics on a GPU: picking a CUDA device turns on deterministic kernels (on an
    H100, 1 and 2 actors gave different metrics.jsonl without, the same with). CUDA is faked here;
    the CPU path leaves torch's global settings alone."""
    from fedskew import training

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "unset after the test")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert training.pick_device("cpu").type == "cpu"
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    try:
        assert training.pick_device("auto").type == "cuda"
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_local_training_copies_batch_indices_to_the_device_once_an_epoch(monkeypatch) -> None:
    """Each batch's indices copied from pageable memory would make the host wait for the GPU every
    step (`Tensor.to` without `non_blocking` synchronises): `minibatches` copies the epoch's
    permutation once, and gives the same batches on every device."""
    from fedskew import training

    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    drawn = torch.randperm(10, generator=gen()).split(4)  # the permutation the CPU generator draws
    moved = list(training.minibatches(10, 4, gen(), torch.device("cpu")))
    assert [b.tolist() for b in moved] == [b.tolist() for b in drawn] and [len(b) for b in moved] == [4, 4, 2]
    assert sorted(torch.cat(moved).tolist()) == list(range(10))

    copies = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(self.shape) or real_to(self, *a, **k))
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    out = training.train_epochs(
        model,
        x,
        y,
        training.cross_entropy_loss,
        torch.optim.SGD(model.parameters(), lr=0.1),
        3,
        4,
        gen(),
        torch.device("cpu"),
    )
    assert out["train-steps"] == 30
    assert copies == [(40, 3), (40,)] + [(40,)] * 3  # the data once, then one permutation an epoch


def striped(labels: torch.Tensor, seed: int) -> torch.Tensor:
    """Images whose row `3 * label` is bright, in noise: a class an MLP learns in a few steps."""
    x = 0.1 * torch.randn(len(labels), 1, 28, 28, generator=torch.Generator().manual_seed(seed))
    x[torch.arange(len(labels)), 0, 3 * labels] += 3.0
    return x


def test_the_personalized_model_on_the_central_test_set_splits_held_and_missing_classes() -> None:
    """A client holding classes 1, 4 and 7 trains on them; on a central test set of all ten classes
    its model is right on its own classes and wrong on the seven it lacks, and the two metrics are
    the per-class means computed here from the returned model's own predictions."""
    y_train = torch.tensor(OBSERVED).repeat(30)
    data = ClientData(striped(y_train, 0), y_train, striped(y_train[:6], 1), y_train[:6], 10)
    y = torch.arange(10).repeat_interleave(20)
    x = striped(y, 2)
    trainer = make_trainer(FedAvgTrainer, data, **{"personalized-central-eval": True, "lr": 0.05})
    trainer.ctx.central_test = (x, y)
    m = make_trainer(FedAvgTrainer, data).fit(global_content())["metrics"]
    assert not {"personal-central-accuracy", "personal-held-accuracy", "personal-missing-accuracy"} & set(m)  # off
    reply = trainer.fit(global_content())
    model = build_model("mlp", "fashion-mnist")
    model.load_state_dict(reply["arrays"].to_torch_state_dict())
    model.eval()
    with torch.no_grad():
        right = (model(x).argmax(1) == y).float().view(10, 20).mean(1)  # per class
    held = [c in OBSERVED for c in range(10)]
    m = reply["metrics"]
    assert m["personal-held-accuracy"] == pytest.approx(float(right[held].mean()))
    assert m["personal-missing-accuracy"] == pytest.approx(float(right[[not h for h in held]].mean()))
    assert m["personal-held-accuracy"] > 0.9 and m["personal-missing-accuracy"] < 0.05
    assert m["personal-central-accuracy"] == pytest.approx(float(right.mean()))  # the whole, balanced test set
