"""FedBABU (Oh, Kim & Yun, ICLR'22): the head frozen in training and moved by fine-tuning, the body-only
upload, the server's fixed head, and a run of the real ServerApp and ClientApp in process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from flwr.app import RecordDict

from fedskew.client_app.base import BaseTrainer
from fedskew.client_app.fedbabu import FedBABUTrainer
from fedskew.config import validate
from fedskew.models import body_state, build_model
from fedskew.registry import get_method
from tests.conftest import read_metrics
from tests.harness import IN_FLOAT64, WIRE_ROUNDING, run_in_process
from tests.test_trainers import global_content, make_data, make_trainer


def one_round(content: RecordDict, **overrides) -> tuple[BaseTrainer, torch.nn.Module]:
    """A FedBABU trainer after `local_train` on `content`, and its locally trained model."""
    trainer = make_trainer(FedBABUTrainer, make_data(), **overrides)
    model = trainer.build_model()
    trainer.received = trainer.receive(content)
    trainer.load_global(model, content)
    trainer.local_train(model, content)
    return trainer, model


def test_the_head_never_moves_in_training_and_moves_in_fine_tuning() -> None:
    """Momentum and weight decay on: a head left in the optimiser would move. Training moves the body
    only; the whole-model fine-tuning moves the head too, the head-only one the head alone."""
    content = global_content(5)
    sent = content["arrays"].to_torch_state_dict()
    trainer, model = one_round(content, momentum=0.9, **{"weight-decay": 0.01})
    trained = model.state_dict()
    assert torch.equal(trained["classifier.weight"], sent["classifier.weight"])
    assert all(not torch.equal(trained[k], sent[k]) for k in body_state(sent))
    tuned = trainer.finetuned.state_dict()
    assert not torch.equal(tuned["classifier.weight"], sent["classifier.weight"])
    assert all(not torch.equal(tuned[k], sent[k]) for k in body_state(sent))

    head_only, _ = one_round(content, **{"fedbabu-finetune-part": "head"})
    tuned = head_only.finetuned.state_dict()
    assert all(torch.equal(tuned[k], sent[k]) for k in body_state(sent))
    assert not torch.equal(tuned["classifier.weight"], sent["classifier.weight"])

    no_tuning, _ = one_round(content, **{"fedbabu-finetune-epochs": 0})
    assert all(torch.equal(v, sent[k]) for k, v in no_tuning.finetuned.state_dict().items())


@pytest.mark.parametrize("every, tuning_rounds", [(1, [1, 2, 3, 4, 5]), (2, [2, 4, 5]), (0, [5])])
def test_finetune_every_fine_tunes_in_its_rounds_and_the_last_and_else_scores_the_received_model(
    every: int, tuning_rounds: list[int]
) -> None:
    """`fedbabu-finetune-every` = N fine-tunes in every N-th round and the last of 5 (0: the last
    alone, PFLlib's protocol); another round's personalized model is the received global model, so its
    personalized accuracy is the received model's and no fine-tuning loss is reported."""
    data, tuned = make_data(), []
    for r in range(1, 6):
        content = global_content(5, server_round=r)
        overrides = {"num-server-rounds": 5, "fedbabu-finetune-every": every}
        trainer = make_trainer(FedBABUTrainer, data, server_round=r, **overrides)
        m = trainer.fit(content)["metrics"]
        sent = content["arrays"].to_torch_state_dict()
        kept = all(torch.equal(v, sent[k]) for k, v in trainer.finetuned.state_dict().items())
        assert kept == ("fedbabu-finetune-loss" not in m)
        if kept:
            assert m["personal-accuracy"] == m["client-global-accuracy"]
        else:
            tuned.append(r)
    assert tuned == tuning_rounds


def test_one_body_step_equals_the_authors_update_and_only_the_body_is_uploaded() -> None:
    """One full-batch step compared with the authors' code (jhoon-oh/FedBABU at
    e34c15b4288224f0af1bc13670bc0cdc373c9576, models/Update.py: SGD with the body's group at lr and
    the head's at lr 0, i.e. body <- body - lr * grad, head unchanged), gradients taken here by autograd."""
    data, lr = make_data(), 0.05
    content = global_content(5)
    overrides = {"momentum": 0.0, "weight-decay": 0.0, "augment": "none", "batch-size": 80, "local-epochs": 1}
    overrides.update(IN_FLOAT64)  # both sides in float64: the trainer shuffles its batch
    reply = make_trainer(FedBABUTrainer, data, lr=lr, **overrides).fit(content)
    model = build_model("mlp", "fashion-mnist").double()
    model.load_state_dict(content["arrays"].to_torch_state_dict())
    body = dict(model.features.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(data.x_train.double()), data.y_train), list(body.values()))
    uploaded = reply["arrays"].to_torch_state_dict()
    assert list(uploaded) == [f"features.{k}" for k in body]
    for (k, p), g in zip(body.items(), grads, strict=True):
        torch.testing.assert_close(uploaded[f"features.{k}"].double(), (p - lr * g).detach(), **WIRE_ROUNDING)


def test_the_server_averages_bodies_under_the_head_it_sent(task_identity) -> None:
    """The server expects bodies only and keeps the head it sent, whatever the replies hold."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

    from tests.harness import InProcessGrid

    cfg = validate({"method": "fedbabu", "model": "mlp", "fraction-train": 1.0})
    strategy = get_method("fedbabu").strategy_class()(cfg)
    arrays = strategy.initial_arrays()
    assert list(strategy.expected_upload(arrays)) == list(body_state(arrays.to_torch_state_dict()))
    grid = InProcessGrid(2, cfg, num_partitions=50)
    messages = list(strategy.configure_train(1, arrays, ConfigRecord({"attempt": 0}), grid))
    replies = []
    for i, msg in enumerate(messages):
        msg.metadata.__dict__["_message_id"] = f"m{i}"  # normally set by the SuperLink
        body = {k: v + 0.01 * (i + 1) for k, v in body_state(arrays.to_torch_state_dict()).items()}
        metrics = MetricRecord({"num-examples": 10, "partition-id": strategy.node_partitions[msg.metadata.dst_node_id]})
        replies.append(Message(RecordDict({"arrays": ArrayRecord(body), "metrics": metrics}), reply_to=msg))
    new, metrics = strategy.aggregate_train(1, replies)
    assert metrics["failures"] == 0
    got, sent = new.to_torch_state_dict(), arrays.to_torch_state_dict()
    assert list(got) == list(sent) and torch.equal(got["classifier.weight"], sent["classifier.weight"])
    for k in body_state(sent):
        torch.testing.assert_close(got[k], sent[k] + 0.015)


def test_in_process_fedbabu_keeps_the_initial_head(tmp_path, task_identity) -> None:
    """The real ServerApp and ClientApp (4 nodes of 50 partitions, 2 rounds): the final global model
    has the run's initial head and a trained body; personalization (fine-tuning) beats the global model."""
    cfg = {"model": "mlp", "partition": "dirichlet", "fraction-train": 1.0, "local-test-fraction": 0.2}
    run_in_process(
        {**cfg, "method": "fedbabu", "num-server-rounds": 2, "out-dir": str(tmp_path), "run-name": "r"}, 4, None, 50
    )
    initial = get_method("fedbabu").strategy_class()(validate({**cfg, "method": "fedbabu"})).initial_arrays()
    w0, final = initial.to_torch_state_dict(), torch.load(tmp_path / "r" / "model.pt", weights_only=True)
    assert torch.equal(final["classifier.weight"], w0["classifier.weight"])
    assert all(not torch.equal(final[k], w0[k]) for k in body_state(w0))
    rows = read_metrics(tmp_path / "r")
    assert all(r["failures"] == 0 and r["global-accuracy"] is not None for r in rows)
    assert rows[-1]["personalized-accuracy"] > rows[-1]["client-global-accuracy"]
