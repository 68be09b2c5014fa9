"""Local SGD of many clients at once, as one stacked model (pure torch: no Flower, no trainers).

The K clients of a round train the same network, each from its own weights on its own data. Their
parameters are stacked along a new first dimension (`torch.func.stack_module_state`) and one step of
all of them is one call of `vmap(grad_and_value(loss))`, the loss running the network through
`torch.func.functional_call` on client k's slice: the kernels of K small models become the kernels
of one K times wider model (a grouped convolution, a batched matrix product). Each point below in
full, with its reason: docs/notes/batched-engine.md.

Each client's step is exactly the step of the per-client path (`fedskew.training.train_steps` with
`fedskew.training.sgd`):

- its mini-batches are the ones it would draw (`client_steps`): a permutation of its examples from
  its own generator, cut into batches of B, a fresh permutation once one is used up, each batch's
  augmentation drawn from the same generator right after, all drawn before training;
- the last, smaller batch of a permutation (b < B examples) is padded to B with weight 0, the b real
  examples weighted 1/b in the parameters' dtype: sum_i w_i loss_i is the per-client batch mean;
- torch.optim.SGD's update (dampening 0, no Nesterov), per client and per parameter group
  (`StackedSGD`; lr, momentum mu and weight decay wd of the parameter's group), on the parameters the
  optimiser holds only, the others frozen in the forward pass (FedBABU's head, FedRep's body during
  its head epochs):

      g_k <- g_k * min(1, c / (||g_k|| + 1e-6))        for each clip norm c, in order (clip_grad_norm_)
      d_k = g_k + wd theta_k,   b_k <- mu b_k + d_k,   theta_k <- theta_k - lr b_k
      theta_k <- theta_k - lr r_k                       with a step correction r_k (SCAFFOLD's c - c_i)

  with b_k starting at zero and r_k the trainer's `step_corrections`, outside momentum
  (`fedskew.losses.scaffold.correct_after_step`); where the optimiser clips the gradient and the
  correction together (FedDC's `grad-clip`), after the clips above,

      s_k = min(1, c / (||g_k + r_k|| + 1e-6)),   g_k <- s_k g_k,   r_k <- s_k r_k   (this step only)
- a loss may also return the training loss the client reports (FedDyn's cross-entropy without its
  regulariser) and named scalars (FedProto's prototype distance), each summed apart;
- and the next values of a state carried from step to step (MuPFL's BAVD maps), which replace those
  extras of the clients that took the step, on the device;
- clients are ordered by decreasing number of steps: a step updates the prefix still training
  (views, no copy), and a client that is done is masked at no cost.

The loop holds no host synchronisation: the schedule (`Schedule`, with `BaseTrainer.step_extras`'s
draws) is built on the host and moved to the device once. A network whose training step is not a
pure function of its parameters, buffers and batch (BatchNorm, dropout) is refused
(`fedskew.training.module_refusal`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import grad_and_value, vmap

from fedskew.data.augment import Augmentation, Draw
from fedskew.training import CLIP_NORMS, CORRECTION_CLIP, STEP_CORRECTION, minibatches

# (params, buffers, x [B, ...], y [B], weight [B], extras) -> one client's scalar loss, or the loss
# and the scalar it reports as its training loss, or those and named scalars it reports beside, or
# those and the next values of the extras it carries from step to step
Tensors = dict[str, torch.Tensor]
StackedLoss = Callable[
    [Tensors, Tensors, torch.Tensor, torch.Tensor, torch.Tensor, Tensors],
    torch.Tensor
    | tuple[torch.Tensor, torch.Tensor]
    | tuple[torch.Tensor, torch.Tensor, Tensors]
    | tuple[torch.Tensor, torch.Tensor, Tensors, Tensors],
]


class NotStackable(ValueError):
    """An opted-in trainer whose optimiser is not one the stacked update reproduces (a bug: never
    trained silently otherwise)."""


@dataclass(frozen=True)
class GroupSettings:
    """One parameter group of a torch SGD: the parameters it trains (by name, in its order) and its
    lr, momentum and weight decay (FedRep's biases: a group of weight decay 0)."""

    names: tuple[str, ...]
    lr: float
    momentum: float
    weight_decay: float


@dataclass(frozen=True)
class SGDSettings:
    """What a torch.optim.SGD does in a step: its parameter groups, the gradient-norm clips run
    before it (in order, over all the groups' parameters), whether a correction follows it and the
    norm that clips the gradient and that correction together after those clips (0: none). A
    parameter of the model in no group is frozen: used in the forward pass, never differentiated,
    never moved (FedBABU's head, FedRep's body in its head epochs)."""

    groups: tuple[GroupSettings, ...]
    clip_norms: tuple[float, ...] = ()
    corrected: bool = False  # a per-client correction after each step (`STEP_CORRECTION`)
    correction_clip: float = 0.0  # its clip with the gradient (`CORRECTION_CLIP`)

    @property
    def trained(self) -> tuple[str, ...]:
        """The names of the parameters the optimiser trains, group after group."""
        return tuple(name for g in self.groups for name in g.names)


def sgd_settings(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]) -> SGDSettings:
    """The settings of `optimizer`, a plain torch SGD over some of the model's named `params`, in
    groups that may differ in lr, momentum and weight decay, whose only step hooks are
    `fedskew.training.clip_before_step`'s and a step correction's with its clip, if any, last
    (`fedskew.losses.scaffold.correct_after_step`); raises `NotStackable` naming what differs."""
    if type(optimizer) is not torch.optim.SGD:
        raise NotStackable(f"the optimiser is {type(optimizer).__name__}, not SGD")
    names = {id(p): name for name, p in params.items()}
    groups = []
    for group in optimizer.param_groups:
        if group["nesterov"] or group["dampening"] or group["maximize"]:
            raise NotStackable("the optimiser uses Nesterov, dampening or maximize")
        if any(id(p) not in names for p in group["params"]):
            raise NotStackable("the optimiser trains a tensor that is not one of the model's parameters")
        group_names = tuple(names[id(p)] for p in group["params"])
        groups.append(
            GroupSettings(group_names, float(group["lr"]), float(group["momentum"]), float(group["weight_decay"]))
        )
    trained = [name for g in groups for name in g.names]
    if len(set(trained)) != len(trained):
        raise NotStackable("the optimiser holds a parameter twice")
    clips = tuple(getattr(optimizer, CLIP_NORMS, ()))
    corrected = bool(getattr(optimizer, STEP_CORRECTION, False))
    correction_clip, clip_hook = getattr(optimizer, CORRECTION_CLIP, (0.0, None))
    # the hook lists are torch's own (private) names: an unknown hook would change the step silently
    pre, post = list(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks)
    if len(pre) != len(clips) + (clip_hook is not None) or post != int(corrected):
        raise NotStackable("the optimiser has step hooks beyond gradient clipping and a step correction")
    if clip_hook is not None and pre[-1] != clip_hook:
        raise NotStackable("the optimiser clips its gradient after clipping it with its step correction")
    return SGDSettings(tuple(groups), clips, corrected, float(correction_clip))


def clip_per_client(
    grads: dict[str, torch.Tensor], max_norm: float, plus: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for each client (row) of the stacked gradients, in place:
    g <- g * s, s = min(1, max_norm / (||g|| + 1e-6)), ||g|| the 2-norm over all of the client's
    tensors; with `plus` (the clients' step corrections r), ||g + r|| instead, as
    `correct_after_step`'s clip. Returns s `[K]`."""
    rows = {k: g if plus is None else g + plus[k] for k, g in grads.items()}
    norms = torch.stack([torch.linalg.vector_norm(t.flatten(1), dim=1) for t in rows.values()], dim=1)
    coef = (max_norm / (torch.linalg.vector_norm(norms, dim=1) + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(per_row(coef, g))
    return coef


def per_row(coef: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`coef` `[K]` shaped to multiply the rows of `like` `[K, ...]`."""
    return coef.view(-1, *([1] * (like.dim() - 1)))


class StackedSGD:
    """torch.optim.SGD's step (module docstring) on stacked parameters `[K, ...]`, each by its
    group's settings, updated in place; `step(grads, a)` moves the first `a` clients only, and only
    the parameters `grads` holds (the trained ones)."""

    def __init__(self, params: dict[str, torch.Tensor], settings: SGDSettings) -> None:
        self.params, self.s = params, settings
        self.group = {name: g for g in settings.groups for name in g.names}
        self.buffers = {k: torch.zeros_like(params[k]) for k, g in self.group.items() if g.momentum}

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], a: int, corrections: dict[str, torch.Tensor] | None = None) -> None:
        for max_norm in self.s.clip_norms:
            clip_per_client(grads, max_norm)
        if corrections is not None:
            corrections = {k: r[:a] for k, r in corrections.items()}
            if self.s.correction_clip:
                coef = clip_per_client(grads, self.s.correction_clip, corrections)
                corrections = {k: r * per_row(coef, r) for k, r in corrections.items()}
        for k, g in grads.items():
            p, group = self.params[k][:a], self.group[k]
            if group.weight_decay:
                g = g.add(p, alpha=group.weight_decay)
            if group.momentum:
                g = self.buffers[k][:a].mul_(group.momentum).add_(g)
            p.add_(g, alpha=-group.lr)
            if corrections is not None:
                p.sub_(corrections[k], alpha=group.lr)


Step = tuple[torch.Tensor, Draw | None]  # one local step: the batch's example indices and its augmentation draw


def client_steps(
    n: int, steps: int, batch_size: int, generator: torch.Generator, augment: Augmentation | None
) -> list[Step]:
    """A client's `steps` local steps as `fedskew.training.train_steps` draws them from `generator`:
    the batches of `batch_size` of a permutation of range(n), a fresh permutation drawn only when the
    previous one is used up (a cycling loader), each batch's augmentation drawn right after its
    indices are used (the same stream positions)."""
    if n == 0 or steps <= 0:
        return []
    passes = (minibatches(n, batch_size, generator, torch.device("cpu")) for _ in itertools.count())
    return [
        (idx, augment.draw(len(idx), generator) if augment is not None else None)
        for idx in itertools.islice(itertools.chain.from_iterable(passes), steps)
    ]


@dataclass
class Schedule:
    """The stacked steps of K clients, ordered by decreasing number of steps: at step s the first
    `active[s]` clients train on rows `rows[:a, s]` of the stacked data, with weights
    `weight[:a, s]` (1/b on the b real examples, 0 on padding; float64), with augmentation, flips
    `[K, S, B]` and offsets `[K, S, 2, B]`, and the values their loss reads at that step beside their
    extras (`values`, name -> `[K, S, ...]`: `BaseTrainer.step_extras`)."""

    rows: torch.Tensor
    weight: torch.Tensor
    flip: torch.Tensor | None
    shift: torch.Tensor | None
    active: list[int]
    values: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> Schedule:
        move = (None if t is None else t.to(device) for t in (self.rows, self.weight, self.flip, self.shift))
        return Schedule(*move, self.active, {k: t.to(device) for k, t in self.values.items()})

    def first(self, steps: int) -> Schedule:
        """The schedule cut after `steps` steps (the memory probe's)."""
        cut = (None if t is None else t[:, :steps] for t in (self.rows, self.weight, self.flip, self.shift))
        return Schedule(*cut, self.active[:steps], {k: t[:, :steps] for k, t in self.values.items()})

    def step_values(self, s: int) -> dict[str, torch.Tensor]:
        """Step `s`'s values of its active clients, `[a_s, ...]`."""
        a = self.active[s]
        return {k: t[:a, s] for k, t in self.values.items()}

    def draw(self, s: int) -> Draw | None:
        """Step `s`'s augmentation draws of its active clients, as one batch of a_s * B images."""
        a = self.active[s]
        if self.flip is None and self.shift is None:
            return None
        flip = None if self.flip is None else self.flip[:a, s].reshape(-1)
        shift = None if self.shift is None else self.shift[:a, s].transpose(0, 1).reshape(2, -1)
        return Draw(flip, shift)


def stack_schedules(
    clients: list[list[Step]], offsets: list[int], batch_size: int, values: list[dict[str, torch.Tensor]] | None = None
) -> Schedule:
    """The `Schedule` of clients whose steps are `clients` (ordered by decreasing number of steps),
    client k's examples being rows offsets[k] + i of the stacked data; padding repeats the client's
    first row. `values[k]`: client k's per-step values (name -> `[S_k, ...]`, the same names and
    shapes for every client), zeros after its last step."""
    lengths = [len(c) for c in clients]
    if lengths != sorted(lengths, reverse=True):
        raise ValueError("clients must come in decreasing number of steps")
    k, s = len(clients), max(lengths, default=0)
    rows = torch.zeros(k, s, batch_size, dtype=torch.long)
    weight = torch.zeros(k, s, batch_size, dtype=torch.float64)
    draws = [d for c in clients for _, d in c if d is not None]
    flip = torch.zeros(k, s, batch_size, dtype=torch.bool) if any(d.flip is not None for d in draws) else None
    shift = torch.zeros(k, s, 2, batch_size, dtype=torch.long) if any(d.shift is not None for d in draws) else None
    for i, (steps, offset) in enumerate(zip(clients, offsets, strict=True)):
        rows[i] += offset
        for j, (idx, draw) in enumerate(steps):
            b = len(idx)
            rows[i, j, :b] += idx
            weight[i, j, :b] = 1.0 / b
            if draw is not None and draw.flip is not None and flip is not None:
                flip[i, j, :b] = draw.flip
            if draw is not None and draw.shift is not None and shift is not None:
                shift[i, j, :, :b] = draw.shift
    active = [sum(n > j for n in lengths) for j in range(s)]
    stacked: dict[str, torch.Tensor] = {}
    for name, t in values[0].items() if values else ():
        stacked[name] = t.new_zeros(k, s, *t.shape[1:])
        for i, own in enumerate(values or []):
            stacked[name][i, : len(own[name])] = own[name]
    return Schedule(rows, weight, flip, shift, active, stacked)


def train_stacked(
    loss: StackedLoss,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    extras: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    schedule: Schedule,
    settings: SGDSettings,
    augment: Augmentation | None = None,
    corrections: dict[str, torch.Tensor] | None = None,
    reports: dict[str, torch.Tensor] | None = None,
    carried: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run `schedule` (on the device of `x`) on the stacked `params` `[K, ...]`, the ones
    `settings` trains updated in place, the others (frozen) passed to `loss` as they are, without a
    gradient; `buffers`, `extras` and the step `corrections` are stacked `[K, ...]` too, `x`, `y` the
    clients' data stacked by rows; the loss reads each step's `Schedule.values` beside `extras`.
    Returns each client's sum of its reported batch losses `[K]`, on the device, summed in float32 as
    `fedskew.training.train_steps` sums them; `reports` receives each client's sum of every named
    scalar the loss reports beside them (`[K]`, in the scalar's dtype), `carried` each client's last
    values of the extras the loss carries (`[K, ...]`: the ones it returns next values of, written
    into `extras` after each step)."""
    optimizer = StackedSGD(params, settings)
    trained = settings.trained

    def with_report(
        train: Tensors, frozen: Tensors, *args: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, Tensors, Tensors]]:
        out = loss({k: train[k] if k in train else frozen[k] for k in params}, *args)  # the model's order
        if isinstance(out, torch.Tensor):
            return out, (out.detach(), {}, {})
        named, carry = (out[2] if len(out) > 2 else {}), (out[3] if len(out) > 3 else {})
        return out[0], (out[1].detach(), *({k: v.detach() for k, v in d.items()} for d in (named, carry)))

    step = vmap(grad_and_value(with_report, has_aux=True))
    fill = augment.fill_value(x) if augment is not None and augment.pad else None
    first = next(iter(params.values()))
    weights = schedule.weight.to(first.dtype)
    totals = torch.zeros(first.shape[0], device=x.device)
    for s, a in enumerate(schedule.active):
        rows = schedule.rows[:a, s]  # [a, B]
        xb = x[rows]
        draw = schedule.draw(s)
        if augment is not None and draw is not None:
            xb = augment.apply(xb.flatten(0, 1), draw, fill).unflatten(0, rows.shape)
        grads, (_, (reported, named, carry)) = step(
            {name: params[name][:a] for name in trained},
            {name: t[:a] for name, t in params.items() if name not in trained},
            {name: t[:a] for name, t in buffers.items()},
            xb,
            y[rows],
            weights[:a, s],
            {**{name: t[:a] for name, t in extras.items()}, **schedule.step_values(s)},
        )
        optimizer.step(grads, a, corrections)
        totals[:a] += reported
        if reports is not None:
            for name, value in named.items():
                reports.setdefault(name, torch.zeros(first.shape[0], dtype=value.dtype, device=x.device))[:a] += value
        for name, value in carry.items():  # the state the next step reads
            extras[name][:a] = value
            if carried is not None:
                carried[name] = extras[name]
    return totals
