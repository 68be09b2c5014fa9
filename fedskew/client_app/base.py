"""The base of every fedskew trainer (client side): one `train` message per round.

Check every record the server sent (`receive`: the round config and the method's declared downlink
records, its card's wire; the model arrays in `load_global`), evaluate the global model on the local
test split (`client-global-accuracy`: MuPFL's Table II "average client test accuracy", FedGELA's PA),
train locally, evaluate the personalized model on the same split (`personal-accuracy`; with
`personalized-central-eval` also on the central test set, split into the classes the client holds
and those it lacks, as FedGELA §5 and FedRoD report for P-FL methods), and reply with the upload, the
sample count, the metrics and the method's uplink records. A method subclasses `BaseTrainer` and
overrides only the hooks that differ (FL-bench style); its records are its card's `wire`. The hooks
in full, each with its default and the methods that override it: docs/notes/trainer.md.

    build_model      the network (default: `model` from the run config)
    receive          checks the server's records first; a method reads its extras from `self.received`
    load_global      how the downloaded arrays enter the model (checked by `checked_arrays`)
    example_losses   the data loss of a batch's logits, per example or the batch mean (default: CE)
    feature_loss     that loss with terms of the features z = `features(x)`, and named reports (FedProto)
    forward_loss     the same with the rest of the pass, a `Forward` (FedRoD's P-head, `frozen_features`)
    penalty          a term on the trainable parameters (FedProx's, FedDyn's; default: none)
    step_extras      values drawn anew at every local step from the trainer's generator (FedGen's)
    loss             the local objective on one mini-batch, derived from the hooks above (MuPFL: its own)
    optimizer        the local optimiser (default: `sgd`, fresh each round); what it does not hold is frozen
    local_train      the whole local procedure (default: `run_steps` on `loss`, then `after_steps`,
                     then `later_phases`)
    after_steps      a client state's update from the trained model (SCAFFOLD's c_i, FedDyn's g_k)
    later_phases     further stages of SGD, each a `Phase` (Ditto's v_k), run by both engines
    received_global_model  the global model for `client-global-accuracy` (default: after `load_global`)
    personalized_model  what "personalized accuracy" measures (default: the trained model)
    upload           the ArrayRecord sent back (default: the whole state dict)
    extra_records    the method's uplink records (prototypes, counts, gradients ...)
    train_metrics    metrics of the local training beside loss and steps (FedRS's observed classes)

The batched engine (`fedskew.batched`) stacks a trainer class that sets `batched = True` in its own
body (never inherited) and writes its objective in the hooks above: the base derives `loss` and the
engine's `functional_loss` from them (the contract: docs/methods.md, "The batched engine's contract";
a state carried from step to step, MuPFL's maps: docs/notes/trainer.md). `tests/test_objectives.py`
holds the two forms to one value in float64, `tests/test_batched.py` the stacked clients to the
per-client path's uploads.

`parameter_state` / `save_parameter_state` keep a client state shaped like the trainable parameters
(control variates, gradient state, drift) across rounds, zeros where the client has none. Other
helpers: `run_epochs` / `run_steps` (mini-batch SGD, whole passes or a number of steps),
`initial_model` (the run's seeded w^0) and `restore` / `keep` (a module's weights in
`self.ctx.state`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import nn
from torch.func import functional_call

from fedskew.client_app.state import ClientState
from fedskew.data import dataset_info
from fedskew.data.augment import augmentation
from fedskew.data.clients import ClientData
from fedskew.diagnostics import held_and_missing_accuracy
from fedskew.models import SplitNet, initial_model, run_model
from fedskew.records import ArraysSpec, Rejected, Tensor, check_arrays, decoded_content, tensor_like
from fedskew.registry import DeclaredWire
from fedskew.training import (
    Loss,
    LossFn,
    compute_dtype,
    confusion,
    evaluate,
    functional_forward,
    functional_part,
    functional_split_forward,
    module_refusal,
    sgd,
    steps_per_round,
    train_steps,
    weighted_sum,
)
from fedskew.wire import MODEL, Dims

log = logging.getLogger("fedskew.client")


def checked_arrays(
    content: RecordDict, expected: dict[str, torch.Tensor], key: str = "arrays"
) -> dict[str, torch.Tensor]:
    """The server's arrays as tensors, after checking names, shapes, dtypes, finite and bounded values
    (`fedskew.records.check_tensor`) against `expected`; raises `Rejected` naming the first problem
    (the server logs it as this node's failure)."""
    if key not in content:
        raise Rejected(f"server message lacks the {key!r} ArrayRecord")
    spec = ArraysSpec({name: wire_form(t) for name, t in expected.items()})
    return as_tensors(check_arrays(content[key], spec, f"server {key}"))


def wire_form(t: torch.Tensor) -> Tensor:
    """The form a tensor like `t` has on the wire: its shape and dtype, float32 for a floating one
    (a client computing in float64, `compute-dtype`, still receives and sends float32)."""
    form = tensor_like(t)
    return Tensor(form.shape, "float32") if t.is_floating_point() else form


def to_wire(content: RecordDict) -> RecordDict:
    """`content` with every floating array of its ArrayRecords in float32 (the wire's dtype)."""
    out = RecordDict()
    for key, record in content.items():
        if isinstance(record, ArrayRecord):
            record = ArrayRecord(
                {k: t.float() if t.is_floating_point() else t for k, t in record.to_torch_state_dict().items()}
            )
        out[key] = record
    return out


def frozen(model: nn.Module) -> nn.Module:
    """`model` in eval mode without gradients: a fixed teacher or reference (global, previous model)."""
    return model.eval().requires_grad_(False)


def frozen_extras(prefix: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict (parameters and buffers) as extras named `prefix` + name: a model that does
    not train travels to the objective (`batch_extras`), stacked over the clients by the engine."""
    return {prefix + k: t.detach() for k, t in model.state_dict().items()}


def frozen_state(prefix: str, extras: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors that `frozen_extras` put in `extras` under `prefix`, by their model's own names."""
    return {k.removeprefix(prefix): t for k, t in extras.items() if k.startswith(prefix)}


def frozen_features(net: nn.Module, prefix: str, x: torch.Tensor, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """`features(x)` without gradient of the model that `frozen_extras` put in `extras` under
    `prefix`, run in `net` (a frozen copy of the network: eval mode, as the per-client path runs a
    teacher) with those tensors in place of its own (`torch.func.functional_call`): on the per-client
    path the model's own forward, under `vmap` each client's own model's (in `forward_loss`)."""
    with torch.no_grad():
        return functional_call(net.features, frozen_state(prefix + "features.", extras), (x,))


def as_tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.copy()) for k, v in arrays.items()}  # decoded arrays are read-only


@dataclass
class Started:
    """A round up to its local training (`BaseTrainer.begin`): the model holding the received global
    model, when the round started and the received global model's (loss, accuracy) on the local test
    split (None: no global model reaches the client)."""

    model: nn.Module
    t0: float
    global_eval: tuple[float, float] | None


Tensors = dict[str, torch.Tensor]
# (model, params, buffers, x, y, weight, extras) -> a client's loss on one batch, or (loss, reported),
# or (loss, reported, reports): `BaseTrainer.functional_loss`'s form
FunctionalLoss = Callable[
    [nn.Module, Tensors, Tensors, torch.Tensor, torch.Tensor, torch.Tensor, Tensors],
    "Loss | tuple[torch.Tensor, torch.Tensor, Tensors]",
]
Penalty = Callable[[Tensors, Tensors], "torch.Tensor | None"]  # (params, extras) -> a term on the parameters


@dataclass
class Forward:
    """A batch's pass through the network (a `SplitNet`), for `forward_loss`: its input `x`, its
    features z = `features(x)` and `logits` = `classifier(z)`, and `run(name, input)`, the network's
    submodule `name` beside those two (FedRoD's P-head) on `input`: in `loss` the modules themselves,
    in `functional_loss` on this client's tensors (under vmap, its slice of the stacked ones)."""

    x: torch.Tensor
    z: torch.Tensor
    logits: torch.Tensor
    run: Callable[[str, torch.Tensor], torch.Tensor]

    @classmethod
    def through(cls, model: nn.Module, x: torch.Tensor) -> Forward:
        """The pass through `model`'s own modules (the per-client path's calls)."""
        z = model.features(x)
        return cls(x, z, model.classifier(z), lambda name, t: getattr(model, name)(t))

    @classmethod
    def functional(cls, model: nn.Module, params: Tensors, buffers: Tensors, x: torch.Tensor) -> Forward:
        """The pass through `model` (a template) on `params` and `buffers` (`torch.func.functional_call`)."""
        z, logits = functional_split_forward(model, params, buffers, x)
        return cls(x, z, logits, lambda name, t: functional_part(model, name, params, buffers, t))


# (logits, y, extras, reduction) -> the data loss per example or its batch mean: `example_losses`' form
ExampleLosses = Callable[[torch.Tensor, torch.Tensor, Tensors, str], torch.Tensor]
# (data, fwd, y, weight, extras) -> (the loss, what it reports): `forward_loss`'s form
ForwardLoss = Callable[
    [torch.Tensor, Forward, torch.Tensor, "torch.Tensor | None", Tensors], tuple[torch.Tensor, Tensors]
]


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, extras: Tensors, reduction: str = "none") -> torch.Tensor:
    """The plain cross-entropy in `example_losses`' form (its default; MAP's stage 2 beside FedRS's loss)."""
    return F.cross_entropy(logits, y, reduction=reduction)


@dataclass
class Phase:
    """A stage of a client's local training after its main steps (`BaseTrainer.later_phases`): `steps`
    SGD steps of `optimizer` on `model`, minimising `loss`, their batches drawn from the round's
    generator where the steps before left it (`run_steps`). `end(stats, phase_stats)` gives the
    round's metrics after the phase from those before it and the phase's own (`train-loss`,
    `train-steps`), and keeps what the client keeps of it.

    The batched engine trains the phase of a round's clients as one stacked model: `optimizer` must
    be a plain torch SGD over some of `model`'s parameters, in groups that may differ in lr, momentum
    and weight decay (`fedskew.batched.stacked.sgd_settings`), the others frozen (FedRep's body
    epochs: the head frozen, the biases in a group without weight decay); `functional_loss` is
    `loss` in `BaseTrainer.functional_loss`'s form (called with a copy of `model`), reading this
    client's own tensors from `extras` only: the engine binds the loss of one client's phase (the
    first of a stack) and stacks the clients' `extras`, so every client's phase has the same extras
    keys (MAP's client without a teacher: stand-in tensors and the term's weight 0)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps: int
    loss: LossFn
    functional_loss: FunctionalLoss
    end: Callable[[dict[str, float], dict[str, float]], dict[str, float]]
    extras: Tensors = field(default_factory=dict)


@dataclass
class TrainerContext:
    """Everything a trainer needs for one round on one client."""

    cfg: dict[str, Any]
    data: ClientData
    device: torch.device
    state: ClientState
    partition_id: int
    server_round: int
    generator: torch.Generator
    central_test: tuple[torch.Tensor, torch.Tensor] | None = None  # with `personalized-central-eval`


class BaseTrainer:
    """A fedskew method's client side; subclasses override the hooks that differ; its
    records (`wire`) are its card's (`fedskew/methods/<name>.py`)."""

    wire = DeclaredWire()  # the method's records beyond the model: its card's `MethodSpec.wire`
    batched: ClassVar[bool] = False  # read from the class's own body only (`stacked_refusal`)
    # the client reports its data loss alone as `train-loss`, not with its `penalty` (FedDyn's can be < 0)
    reports_data_loss: ClassVar[bool] = False
    # What its clients keep across rounds that shapes their training ("" when nothing; `kept_state`)
    keeps_state: ClassVar[str] = ""
    # the model-sized arrays among them, one entry a copy: "model" (the network's state dict), "params"
    # (its trainable parameters), "head" (the classifier's state dict); `state.kept_state_bytes`
    kept_arrays: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def kept_state(cls, cfg: dict[str, Any]) -> str:
        """What a client of a run under `cfg` keeps across rounds that shapes its training, '' when
        nothing: a resumed simulation's clients start without it (`MethodSpec.resume_note`)."""
        return cls.keeps_state

    def __init__(self, ctx: TrainerContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.dims = Dims.of(self.cfg)
        self.data = ctx.data
        self.device = ctx.device
        self.dtype = compute_dtype(self.cfg)  # float64 only to compare numerical paths
        if self.dtype != torch.float32:
            x_train, x_test = (x.to(self.dtype) for x in (ctx.data.x_train, ctx.data.x_test))
            self.data = replace(ctx.data, x_train=x_train, x_test=x_test)
        self.augment = augmentation(self.cfg, dataset_info(self.cfg))  # of training batches, per `augment`
        # the sums over the local steps of what `feature_loss` reports, kept by either engine
        self.reported: dict[str, torch.Tensor] = {}
        # the batched engine's last values of the extras a stacked stage's loss carried from step to
        # step (`functional_loss`; MuPFL's BAVD maps), this client's slice, before `after_steps`
        self.carried: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ hooks
    def build_model(self) -> SplitNet:
        return run_model(self.cfg).to(self.device, self.dtype)

    def receive(self, content: RecordDict) -> dict[str, Any]:
        """The server's records but the model arrays, each checked against the method's
        `wire.downlink_schema`: ArrayRecords as dicts of tensors (floating ones in the compute dtype),
        ConfigRecords as they are. A record the method does not declare, or one of another form, is
        refused (raises `Rejected`)."""
        rest = RecordDict({k: v for k, v in content.items() if k != MODEL})
        decoded = decoded_content(rest, self.wire.downlink_schema(self.dims))
        return {k: self.computed(as_tensors(v)) if isinstance(v, dict) else v for k, v in decoded.items()}

    def computed(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` with the floating ones in the compute dtype (`compute-dtype`)."""
        return {k: t.to(self.dtype) if t.is_floating_point() else t for k, t in tensors.items()}

    def load_global(self, model: nn.Module, content: RecordDict) -> None:
        model.load_state_dict(checked_arrays(content, model.state_dict()), strict=True)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
        """The local objective on one mini-batch, derived from what the method writes: its
        `example_losses` of `model(x)` as their batch mean (reduction "mean", the kernel's own) plus its
        `penalty` on the model's parameters (`objective`), both reading `batch_extras` and this step's
        `step_extras` (drawn now, for this batch of len(y) examples)."""
        step = {k: t[0].to(self.device) for k, t in self.step_extras([len(y)], len(y)).items()}
        return self.loss_of(self.penalty, {**self.batch_extras(), **step})(model, x, y)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return sgd(model.parameters(), self.cfg)

    def local_train(self, model: nn.Module, content: RecordDict) -> dict[str, float]:
        stats = self.after_steps(model, self.run_steps(model, self.optimizer(model), self.local_steps()))
        return self.run_later_phases(model, stats)

    def after_steps(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        """The local training's end after its steps (`stats`: their loss and count): a client state's
        update from the trained `model` and its metrics (the batched engine calls it too)."""
        return stats

    def later_phases(self, model: nn.Module) -> Iterator[Phase]:
        """The stages of the local training after the main steps on `model` and `after_steps`, in
        order, each one built once the one before has ended (its `end` called): the per-client path
        runs each with `run_steps` (`run_later_phases`), the batched engine stacks each over the
        round's clients. Default: none."""
        return iter(())

    def run_later_phases(self, model: nn.Module, stats: dict[str, float]) -> dict[str, float]:
        """The round's metrics `stats` after running `later_phases` on this client, one after the other."""
        for phase in self.later_phases(model):
            stats = phase.end(stats, self.run_steps(phase.model, phase.optimizer, phase.steps, phase.loss))
        return stats

    def local_steps(self) -> int:
        """The SGD steps of `local_train`: `local-epochs` passes over the local training split, the
        K_i the server computes too (`fedskew.training.steps_per_round`)."""
        return steps_per_round(len(self.data.y_train), self.cfg["local-epochs"], self.cfg["batch-size"])

    def received_global_model(self, model: nn.Module) -> nn.Module | None:
        """The global model as the server sent it, called right after `load_global`; None when no
        global model reaches the client (FedProto): no `client-global-accuracy` then."""
        return model

    def personalized_model(self, model: nn.Module) -> nn.Module:
        return model

    def upload(self, model: nn.Module) -> ArrayRecord:
        return ArrayRecord(model.state_dict())

    def extra_records(self, model: nn.Module) -> dict[str, Any]:
        return {}

    def train_metrics(self) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------------ batched engine
    @classmethod
    def stacked_refusal(cls, cfg: dict[str, Any]) -> str | None:
        """Why the batched engine trains this method's clients one by one, each with its own trainer
        as the ClientApp does (None: as one stacked model): the class does not opt in itself
        (`batched` in its own body), or the network keeps running statistics or draws random numbers
        in training (BatchNorm, dropout: `fedskew.training.module_refusal`)."""
        if not cls.__dict__.get("batched", False):
            return f"{cls.__name__} does not express its local step functionally"
        return module_refusal(run_model(cfg))

    def batch_extras(self) -> dict[str, torch.Tensor]:
        """This client's own tensors that `functional_loss` reads, on the device (default: none)."""
        return {}

    def step_extras(self, sizes: list[int], width: int) -> dict[str, torch.Tensor]:
        """The values the objective reads at each of the next len(sizes) local steps beside
        `batch_extras`, step s's batch holding sizes[s] real examples: name -> `[len(sizes), ...]` on
        the host (the CPU), a value per example padded (with zeros) to `width` rows. Drawn in step
        order from the trainer's own generator, never the mini-batch stream (the two paths interleave
        them differently): `loss` draws one step at a time (`[b]`, width b) and moves it to the device,
        the batched engine the main steps' all before training (width: the batch size; the padding
        weighs 0) and moves a stacked model's to the device with its schedule, so both read the same
        values. Default: none."""
        return {}

    def step_corrections(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Parameter name -> the correction its optimiser subtracts (times lr) after each step, where
        it applies one (`fedskew.losses.scaffold.correct_after_step`; default: none)."""
        return None

    def functional_loss(
        self,
        model: nn.Module,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        extras: dict[str, torch.Tensor],
    ) -> Loss:
        """`loss` of one client on one mini-batch in functional form, derived from the same two hooks:
        `model`'s forward on `params` and `buffers` (`torch.func.functional_call`), sum_i weight_i l_i
        of its `example_losses` l_i (reduction "none") with weight_i = 1/b on the b examples of the
        batch and 0 on the padding of a short batch (the batch mean), plus its `penalty` on `params`
        (`objective`), reading this client's own values only from `extras` (`batch_extras`): the
        engine calls it under `vmap` on one trainer for all the clients of a round."""
        return self.functional_loss_of(self.penalty)(model, params, buffers, x, y, weight, extras)

    def loss_of(
        self,
        penalty: Penalty | None,
        extras: Tensors,
        example_losses: ExampleLosses | None = None,
        forward_loss: ForwardLoss | None = None,
    ) -> LossFn:
        """The per-client objective on one mini-batch for `penalty` (None: no term) and this client's
        `extras`: the batch mean of `example_losses` (with `forward_loss`'s terms, where given or the
        class reads features) plus `penalty` on the model's parameters (`objective`). `loss` is it for
        the trainer's own hooks; a later phase passes its own penalty (Ditto's proximal term), or its
        own data loss and terms (MAP's stage 2: `cross_entropy` and the transfer from the HPM)."""
        data_loss, forward = self.objective_hooks(example_losses, forward_loss)

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Loss:
            if forward is None:
                data = data_loss(model(x), y, extras, "mean")
                return self.objective(data, self.penalty_of(penalty, dict(model.named_parameters()), extras))
            fwd = Forward.through(model, x)
            data = data_loss(fwd.logits, y, extras, "mean")
            data, reports = forward(data, fwd, y, None, extras)
            for name, value in reports.items():
                self.reported[name] = self.reported.get(name, 0.0) + value.detach()
            return self.objective(data, self.penalty_of(penalty, dict(model.named_parameters()), extras))

        return loss

    def functional_loss_of(
        self,
        penalty: Penalty | None,
        example_losses: ExampleLosses | None = None,
        forward_loss: ForwardLoss | None = None,
    ) -> FunctionalLoss:
        """`loss_of(penalty, ..., example_losses, forward_loss)` in `functional_loss`'s form (extras
        passed in, under vmap)."""
        data_loss, forward = self.objective_hooks(example_losses, forward_loss)

        def functional(
            model: nn.Module,
            params: Tensors,
            buffers: Tensors,
            x: torch.Tensor,
            y: torch.Tensor,
            weight: torch.Tensor,
            extras: Tensors,
        ) -> Loss | tuple[torch.Tensor, torch.Tensor, Tensors]:
            if forward is None:
                logits = functional_forward(model, params, buffers, x)
                data = weighted_sum(data_loss(logits, y, extras, "none"), weight)
                return self.objective(data, self.penalty_of(penalty, params, extras))
            fwd = Forward.functional(model, params, buffers, x)
            data = weighted_sum(data_loss(fwd.logits, y, extras, "none"), weight)
            data, reports = forward(data, fwd, y, weight, extras)
            out = self.objective(data, self.penalty_of(penalty, params, extras))
            return (out, out, reports) if isinstance(out, torch.Tensor) else (*out, reports)

        return functional

    def objective_hooks(
        self, example_losses: ExampleLosses | None, forward_loss: ForwardLoss | None
    ) -> tuple[ExampleLosses, ForwardLoss | None]:
        """(the data loss, the terms of the pass or None: the network runs whole) of `loss_of`: those
        given, else the trainer's `example_losses` and, where the class reads features, `forward_loss`."""
        if forward_loss is None and self.reads_features():
            forward_loss = self.forward_loss
        return example_losses or self.example_losses, forward_loss

    @staticmethod
    def penalty_of(penalty: Penalty | None, params: Tensors, extras: Tensors) -> torch.Tensor | None:
        return None if penalty is None else penalty(params, extras)

    @classmethod
    def reads_features(cls) -> bool:
        """Whether the objective reads the batch's features: the class overrides `feature_loss` (or
        `forward_loss`)."""
        return cls.feature_loss is not BaseTrainer.feature_loss or cls.forward_loss is not BaseTrainer.forward_loss

    def forward_loss(
        self, data: torch.Tensor, fwd: Forward, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """`feature_loss` for an objective that reads more of the batch's pass (`fwd`: the input, the
        logits, another submodule's output) than its features: FedRoD's P-head on the features,
        FedPHP's frozen teacher on the input (its tensors in `extras`). The same contract as
        `feature_loss`'s (`weight` None in `loss`, the engine's weights in `functional_loss`).
        Default: `feature_loss` of the features."""
        return self.feature_loss(data, fwd.z, y, weight, extras)

    def feature_loss(
        self, data: torch.Tensor, z: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None, extras: Tensors
    ) -> tuple[torch.Tensor, Tensors]:
        """The data loss `data` (of `example_losses`) with the method's terms of the batch's features
        `z` [B, d] (`features(x)`, the classifier's input), and the named scalars it reports, each
        summed over the local steps into `reported` by either engine; per-client values read from
        `extras`. Written once for both forms, as `example_losses` is: `weight` None in `loss` (the
        batch as it is: the term's own batch reduction, the per-client path's kernels), and in
        `functional_loss` the weights 1/b on a batch's b examples and 0 on the padding of a short
        batch: the term then weighs its examples by them (an example of weight 0 changes nothing),
        with masks instead of Python branches on tensor values (it runs under `vmap`). Not overridden
        (default): the network runs whole and no features are computed."""
        return data, {}

    def reported_sum(self, name: str) -> float:
        """The sum over the local steps of what `feature_loss` reported as `name` (0 when nothing)."""
        return float(self.reported.get(name, 0.0))

    def example_losses(
        self, logits: torch.Tensor, y: torch.Tensor, extras: dict[str, torch.Tensor], reduction: str = "none"
    ) -> torch.Tensor:
        """The method's data loss of a batch's logits, written once: one value per example
        (`reduction="none"`, what `functional_loss` weighs) or their batch mean (`"mean"`, what
        `loss` descends, from the same kernel call), its per-client values read from `extras`
        (default: cross-entropy)."""
        return cross_entropy(logits, y, extras, reduction)

    def penalty(self, params: dict[str, torch.Tensor], extras: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The method's term on the trainable parameters `params` (name -> tensor: the model's own in
        `loss`, the functional ones in `functional_loss`) added to the data loss, its anchors read
        from `extras` (FedProx's proximal term, FedDyn's regulariser); None: no term (default)."""
        return None

    def objective(self, data: torch.Tensor, penalty: torch.Tensor | None) -> Loss:
        """The loss `loss` and `functional_loss` return: `data + penalty` (`data` without a penalty),
        with `data` as the reported training loss beside it where `reports_data_loss`."""
        if penalty is None:
            return data
        return (data + penalty, data) if self.reports_data_loss else data + penalty

    # ------------------------------------------------------------------ state
    def parameter_state(self, name: str, model: nn.Module) -> list[torch.Tensor]:
        """This client's state `name`, one tensor per trainable parameter of `model` (control variates,
        gradient state, drift), as `save_parameter_state` kept it in an earlier round, on the device;
        zeros when the client has none: its first participation, or a state lost or refused
        (`ClientState.load_round_tensors`), which is how the papers start a client."""
        like = {k: p.detach() for k, p in model.named_parameters()}
        saved = self.ctx.state.load_round_tensors(name, like, self.ctx.server_round)
        if saved is None:
            self.log_new_state(name, "starts at zero")
            return [torch.zeros_like(p) for p in like.values()]
        return [saved[k].to(self.device) for k in like]

    def save_parameter_state(self, name: str, model: nn.Module, tensors: list[torch.Tensor]) -> None:
        names = [k for k, _ in model.named_parameters()]
        self.ctx.state.save_round_tensors(name, dict(zip(names, tensors, strict=True)), self.ctx.server_round)

    def restore(self, name: str, module: nn.Module) -> bool:
        """Load the client state `name` (`keep`, an earlier round) into `module`; False, leaving
        `module` as it is, when the client has none: its first participation, or a state lost or
        refused (`ClientState.load_round_tensors`: other names, shapes or dtypes than the module's, or
        written by a discarded attempt)."""
        saved = self.ctx.state.load_round_tensors(name, module.state_dict(), self.ctx.server_round)
        if saved is None:
            self.log_new_state(name, "starts as the paper starts a new client")
            return False
        module.load_state_dict(saved)
        return True

    def keep(self, name: str, module: nn.Module) -> None:
        """Save `module`'s weights as the client state `name`, tagged with this round (bounded by `state-max-mb`)."""
        self.ctx.state.save_round_tensors(name, module.state_dict(), self.ctx.server_round)

    def log_new_state(self, name: str, start: str) -> None:
        log.info(
            "partition %d, round %d: no %r state (first participation or lost): %s",
            self.ctx.partition_id,
            self.ctx.server_round,
            name,
            start,
        )

    # ------------------------------------------------------------------ helpers
    def run_epochs(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, epochs: int, loss: LossFn | None = None
    ) -> dict[str, float]:
        """`epochs` passes of mini-batch SGD over the local training split (batches through the
        configured augmentation, order from the round's generator) on `loss` (default: `self.loss`)."""
        return self.run_steps(
            model, optimizer, steps_per_round(len(self.data.y_train), epochs, self.cfg["batch-size"]), loss
        )

    def run_steps(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, loss: LossFn | None = None
    ) -> dict[str, float]:
        """`steps` steps of mini-batch SGD over the local training split, fresh permutations as the
        passes are used up (`fedskew.training.train_steps`; `run_epochs` for whole passes)."""
        return train_steps(
            model,
            self.data.x_train,
            self.data.y_train,
            loss or self.loss,
            optimizer,
            steps,
            self.cfg["batch-size"],
            self.ctx.generator,
            self.device,
            self.augment,
        )

    def initial_model(self) -> SplitNet:
        """The run's initial global model w^0 (`fedskew.models.initial_model`), on this device."""
        cfg = self.cfg
        net = initial_model(cfg["model"], dataset_info(cfg), cfg["seed"], cfg["classifier-bias"])
        return net.to(self.device, self.dtype)

    # ------------------------------------------------------------------ the round
    def evaluate_local(self, model: nn.Module) -> tuple[float, float]:
        """(loss, accuracy) of `model` on this client's local test split (NaN when it is empty)."""
        return evaluate(model, self.data.x_test, self.data.y_test, self.cfg["eval-batch-size"], self.device)

    def evaluate_central(self, model: nn.Module) -> dict[str, float]:
        """`personal-central-accuracy` (the whole central test set: the generic accuracy of a
        personalized model, FedGELA Sec. 5, FedRoD), `personal-held-accuracy` and
        `personal-missing-accuracy` of `model` (`held_and_missing_accuracy`; a metric with no class to
        average over is left out)."""
        x, y = self.ctx.central_test
        _, cm = confusion(model, x, y, self.cfg["eval-batch-size"], self.device)
        held, missing = held_and_missing_accuracy(cm, self.data.train_counts > 0)
        whole = float(np.trace(cm) / cm.sum()) if cm.sum() else None
        values = {
            "personal-central-accuracy": whole,
            "personal-held-accuracy": held,
            "personal-missing-accuracy": missing,
        }
        return {k: v for k, v in values.items() if v is not None}

    def begin(self, content: RecordDict) -> Started:
        """The round up to its local training: check the server's records, build the model, load the
        global model and evaluate it on the local test split."""
        t0 = time.perf_counter()
        self.received = self.receive(content)
        model = self.build_model()
        self.load_global(model, content)
        received = self.received_global_model(model)
        return Started(model, t0, self.evaluate_local(received) if received is not None else None)

    def finish(self, started: Started, stats: dict[str, float]) -> RecordDict:
        """The reply content after the local training (`stats`: its loss and steps): the metrics, the
        personalized model's evaluation, the upload and the method's uplink records."""
        model = started.model
        train_seconds = time.perf_counter() - started.t0
        stats = {**stats, **self.train_metrics()}
        personal = self.personalized_model(model)
        p_loss, p_acc = self.evaluate_local(personal)
        metrics = {
            "num-examples": len(self.data.y_train),
            "partition-id": self.ctx.partition_id,
            "personal-num-test": len(self.data.y_test),
            "train-seconds": train_seconds,
            **stats,
            **(self.evaluate_central(personal) if self.ctx.central_test is not None else {}),
        }
        if len(self.data.y_test):
            metrics.update({"personal-accuracy": p_acc, "personal-loss": p_loss})
            if started.global_eval is not None:
                g_loss, g_acc = started.global_eval
                metrics.update({"client-global-accuracy": g_acc, "client-global-loss": g_loss})
        content = RecordDict(
            {"arrays": self.upload(model), "metrics": MetricRecord(metrics), **self.extra_records(model)}
        )
        return content if self.dtype == torch.float32 else to_wire(content)

    def fit(self, content: RecordDict) -> RecordDict:
        """One round: returns the reply content (arrays, metrics and any extra records)."""
        started = self.begin(content)
        return self.finish(started, self.local_train(started.model, content))
