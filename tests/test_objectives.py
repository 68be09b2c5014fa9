"""Each batched method writes its objective once (`example_losses`, `feature_loss`, `penalty`) and the base derives
its two forms (`fedskew/client_app/base.py`): the per-client `loss` and the batched engine's
`functional_loss`, with weights 1/b on a batch's b examples and 0 on padding, agree on one client's
batch in float64; and `loss` is the method's loss op for op, as the per-client path computed it
before the derivation (the committed results depend on its last digits)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fedskew.client_app.app import client_trainer
from fedskew.client_app.base import BaseTrainer
from fedskew.client_app.hpm import TEACHER, WEIGHTS
from fedskew.losses import (
    distillation_loss,
    mmd_multi_gaussian,
    personalization_loss,
    proximal_term,
    restricted_softmax_cross_entropy,
)
from fedskew.losses.feddc import penalty_target
from fedskew.losses.feddyn import feddyn_penalty
from fedskew.losses.fedgen import regulariser_weight
from fedskew.losses.fedlc import calibrated_cross_entropy
from fedskew.losses.fedmr import inter_class_loss, intra_class_loss
from fedskew.losses.fedproc import prototypical_contrastive_loss
from fedskew.losses.fedproto import prototype_distance_loss
from fedskew.losses.fedrod import balanced_softmax_loss, personalized_risk
from fedskew.losses.moon import model_contrastive_loss
from fedskew.registry import METHODS
from fedskew.training import Loss
from tests.test_batched import FEATURE_TERMS, LATER, first_round, with_global_prototypes

BATCHED = [name for name, spec in METHODS.items() if spec.trainer_class().__dict__.get("batched", False)]
# float64 rounding: the two forms sum the b examples' losses in other orders (a few epsilons, 2.2e-16)
FLOAT64 = {"rtol": 1e-12, "atol": 0.0}


def cross_entropy(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    return F.cross_entropy(model(x), y)


def feddyn_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    ce = F.cross_entropy(model(x), y)
    return ce + feddyn_penalty(list(model.parameters()), t.start, t.gradient_state, t.cfg["feddyn-alpha"]), ce


# the per-client losses as the trainers wrote them before `example_losses` and `penalty` derived them
WRITTEN: dict[str, Callable[[Any, torch.nn.Module, torch.Tensor, torch.Tensor], Loss]] = {
    "fedrs": lambda t, model, x, y: restricted_softmax_cross_entropy(model(x), y, t.scale),
    "scaffold-rs": lambda t, model, x, y: restricted_softmax_cross_entropy(model(x), y, t.scale),
    "map": lambda t, model, x, y: restricted_softmax_cross_entropy(model(x), y, t.scale),  # stage 1
    "fedlc": lambda t, model, x, y: calibrated_cross_entropy(model(x), y, t.offsets),
    "fedprox": lambda t, model, x, y: (
        F.cross_entropy(model(x), y) + proximal_term(model.parameters(), t.global_params.values(), t.cfg["fedprox-mu"])
    ),
    "feddyn": feddyn_loss,
    "feddc": lambda t, model, x, y: (
        F.cross_entropy(model(x), y) + proximal_term(model.parameters(), t.target, t.cfg["feddc-alpha"])
    ),
}


def fedproto_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    z = model.features(x)
    distance = prototype_distance_loss(z, y, t.prototypes, t.valid)
    return F.cross_entropy(model.classifier(z), y) + t.cfg["fedproto-lambda"] * distance


def fedproc_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    z = model.features(x)
    ce = F.cross_entropy(model.classifier(z), y)
    if not t.use_protos or not t.valid[y].any():
        return ce
    pc = prototypical_contrastive_loss(z, y, t.prototypes, t.valid, t.cfg["fedproc-temperature"])
    return t.alpha * pc + (1.0 - t.alpha) * ce


def fedmr_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    z = model.features(x)
    loss = F.cross_entropy(model.classifier(z), y)
    loss = loss + t.cfg["fedmr-mu1"] * intra_class_loss(z, y, t.cfg["fedmr-intra-mode"])
    inter = inter_class_loss(z, y, t.prototypes, t.valid, t.local_mask, generator=t.lite_generator)
    return loss + t.cfg["fedmr-mu2"] * inter


def moon_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    z = model.features(x)
    loss = F.cross_entropy(model.classifier(z), y)
    if t.previous is None:
        return loss
    previous = copy.deepcopy(t.global_model)
    previous.load_state_dict(t.previous)
    with torch.no_grad():
        z_glob, z_prev = t.global_model.features(x), previous.features(x)
    return loss + t.cfg["moon-mu"] * model_contrastive_loss(z, z_glob, z_prev, t.cfg["moon-temperature"])


def fedmmd_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    h = model.features(x)
    loss = F.cross_entropy(model.classifier(h), y)
    with torch.no_grad():
        h_glob = t.global_model.features(x)
    return loss + t.cfg["fedmmd-lambda"] * mmd_multi_gaussian(h, h_glob)


WRITTEN.update({"moon": moon_loss, "fedmmd": fedmmd_loss})


def fedrod_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    h = model.features(x)
    g = model.classifier(h)
    return balanced_softmax_loss(g, y, t.log_prior) + personalized_risk(g, t.personal(h.detach()), y)


def fedphp_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    logits = model.classifier(model.features(x))
    with torch.no_grad():
        o_p = t.teacher.classifier(t.teacher.features(x))
    kd = distillation_loss(logits, o_p, t.cfg["fedphp-temperature"], t.cfg["fedphp-soften-student"])
    return personalization_loss(F.cross_entropy(logits, y), kd, t.cfg["fedphp-transfer-weight"])


def fedgen_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
    """Its draws from the trainer's own generator at the step: the batch's noise, the sampled labels,
    their noise."""
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    gen_batch = t.cfg["fedgen-gen-batch-size"]
    with torch.no_grad():
        for_batch, _ = t.generator.generate(y, t.noise_rng)
        sampled = torch.randint(model.num_classes, (gen_batch,), generator=t.noise_rng)
        generated, _ = t.generator.generate(sampled, t.noise_rng)
    alpha, beta = (regulariser_weight(t.cfg[f"fedgen-{k}"], t.ctx.server_round) for k in ("alpha", "beta"))
    teacher = F.cross_entropy(model.classifier(generated), sampled)
    target = F.softmax(model.classifier(for_batch), dim=1)
    latent = F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")
    return loss + (gen_batch / t.cfg["batch-size"] * alpha * teacher + beta * latent)


WRITTEN.update({"fedproto": fedproto_loss, "fedproc": fedproc_loss, "fedmr": fedmr_loss})
WRITTEN.update({"fedrod": fedrod_loss, "fedphp": fedphp_loss, "fedgen": fedgen_loss})


def pair(loss: Loss | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, the training loss reported for it)."""
    return (loss[0], loss[1]) if isinstance(loss, tuple) else (loss, loss)


def started_client(method: str) -> tuple[BaseTrainer, torch.nn.Module]:
    """A trainer of `method` in float64 after `begin` on its round-1 message, and its model moved off
    the received one (FedProx's and FedDyn's penalties are 0 there), FedDyn with a nonzero g_k, FedDC
    with a nonzero drift h_i (its penalty's target w - h_i), MOON with a previous local model."""
    grid, messages = first_round(method, **{"compute-dtype": "float64"})
    if method in FEATURE_TERMS:  # global prototypes for all classes but the last (none in round 1)
        messages = with_global_prototypes(messages, FEATURE_TERMS[method][0])
    messages = LATER.get(method, list)(messages)  # FedGen's generator (round 2)
    msg = messages[0]
    trainer = client_trainer(msg, grid.contexts[msg.metadata.dst_node_id], set_threads=False)
    model = trainer.begin(msg.content).model
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    if method == "feddyn":
        trainer.gradient_state = [0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype) for p in model.parameters()]
    if method == "moon":  # a previous local model (none in round 1): the global one moved
        previous = copy.deepcopy(trainer.global_model)
        with torch.no_grad():
            for p in previous.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        trainer.previous = previous.state_dict()
    if method == "feddc":
        drift = [0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype) for p in model.parameters()]
        trainer.target = penalty_target(trainer.start, drift)
    return trainer, model


def rewinder(trainer: BaseTrainer) -> Callable[[], None]:
    """What sets the trainer's own generator of per-step values (FedGen's `noise_rng`) back to where
    it is now (nothing for a trainer without one)."""
    rng = getattr(trainer, "noise_rng", None)
    if rng is None:
        return lambda: None
    state = rng.get_state()

    def rewind() -> None:
        rng.set_state(state)

    return rewind


@pytest.mark.parametrize("method", BATCHED)
def test_loss_and_functional_loss_are_one_objective(method: str, task_identity: None) -> None:
    trainer, model = started_client(method)
    model.train()
    b, pad = 13, 3
    x, y = trainer.data.x_train[: b + pad], trainer.data.y_train[: b + pad]
    assert x.dtype == torch.float64 and next(model.parameters()).dtype == torch.float64
    weight = torch.cat([torch.full((b,), 1.0 / b, dtype=torch.float64), torch.zeros(pad, dtype=torch.float64)])
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    rewind = rewinder(trainer)  # each form draws the same step's values (`step_extras`)
    step = {k: t[0] for k, t in trainer.step_extras([b], b + pad).items()}
    assert bool(step) == (method == "fedgen")
    functional = trainer.functional_loss(model, params, buffers, x, y, weight, {**trainer.batch_extras(), **step})
    stacked = pair(functional)
    rewind()
    per_client = pair(trainer.loss(model, x[:b], y[:b]))
    for got, want in zip(stacked, per_client, strict=True):
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, **FLOAT64)
    reports = functional[2] if isinstance(functional, tuple) and len(functional) > 2 else {}
    assert reports.keys() == trainer.reported.keys() and (not reports or trainer.reads_features())
    for name, value in reports.items():  # what `feature_loss` reports (FedProto's distance), nonzero here
        assert abs(float(value.detach())) > 1e-6, name
        torch.testing.assert_close(value.detach(), trainer.reported[name], **FLOAT64)
    rewind()
    written = pair(WRITTEN.get(method, cross_entropy)(trainer, model, x[:b], y[:b]))
    assert all(torch.equal(a, w) for a, w in zip(per_client, written, strict=True)), method
    penalty = trainer.penalty(params, trainer.batch_extras())
    assert (penalty is not None and abs(float(penalty.detach())) > 1e-4) == (method in ("fedprox", "feddyn", "feddc"))


def map_stage_two_loss(t: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MAP's stage-2 loss as its trainer wrote it before stage 2 became a phase: CE, and the transfer
    from the teacher where the client has one."""
    z = model.features(x)
    logits = model.classifier(z)
    lam, key = t.cfg["map-transfer-weight"], lambda name: t.cfg[f"map-{name}"]
    if t.teacher is None or lam == 0:
        return personalization_loss(F.cross_entropy(logits, y), None, lam)
    with torch.no_grad():
        h_p = t.teacher.features(x)
        o_p = t.teacher.classifier(h_p)
    if key("transfer") == "distill":
        transfer = distillation_loss(logits, o_p, key("temperature"), key("soften-student"))
    else:
        transfer = mmd_multi_gaussian(z, h_p, key("mmd-kernel-mul"), key("mmd-kernels"))
    return personalization_loss(F.cross_entropy(logits, y), transfer, lam)


@pytest.mark.parametrize("transfer", ["distill", "mmd"])
@pytest.mark.parametrize("init", ["none", "initial"], ids=["no-teacher", "teacher-w0"])
def test_map_s_stage_two_is_one_objective_with_or_without_a_teacher(transfer: str, init: str, task_identity) -> None:
    """MAP's stage 2 (a later phase): its per-client loss is the one written before, op for op, and its
    functional form on padded batches the same value in float64, with a teacher (the HPM w^0) and
    without (a first participation: plain CE per client; stacked, the stand-in's finite term at
    weight 0), both with the same extras keys."""
    overrides = {"map-transfer": transfer, "map-hpm-init": init, "map-transfer-weight": 0.5}
    grid, messages = first_round("map", **{"compute-dtype": "float64", **overrides})
    msg = messages[0]
    trainer = client_trainer(msg, grid.contexts[msg.metadata.dst_node_id], set_threads=False)
    model = trainer.begin(msg.content).model
    phase = next(trainer.later_phases(model))
    assert (trainer.teacher is not None) == (init == "initial")
    assert phase.extras.keys() == {TEACHER + k for k in model.state_dict()} | {WEIGHTS}
    assert phase.extras[WEIGHTS].tolist() == ([0.5, 0.5] if init == "initial" else [1.0, 0.0])
    student = phase.model  # moved off the teacher w^0 and off the stand-in (the stage-1 model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    student.train()
    b, pad = 13, 3
    x, y = trainer.data.x_train[: b + pad], trainer.data.y_train[: b + pad]
    weight = torch.cat([torch.full((b,), 1.0 / b, dtype=torch.float64), torch.zeros(pad, dtype=torch.float64)])
    params, buffers = dict(student.named_parameters()), dict(student.named_buffers())
    stacked = pair(phase.functional_loss(student, params, buffers, x, y, weight, phase.extras))
    per_client = pair(phase.loss(student, x[:b], y[:b]))
    for got, want in zip(stacked, per_client, strict=True):
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, **FLOAT64)
    assert torch.equal(per_client[0], map_stage_two_loss(trainer, student, x[:b], y[:b]))
    ce = F.cross_entropy(student(x[:b]), y[:b])
    assert torch.equal(per_client[0], ce) == (init == "none")
