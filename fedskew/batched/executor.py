"""The batched engine's client side: a round's messages in, their replies out, in one process.

Each train message gets the method's trainer exactly as the ClientApp builds it
(`fedskew.client_app.app.client_trainer`: the same checks, seeding and lr) and the same reply
(`train_reply`: participations counted in the node's state); a message whose checks fail, or whose
training raises, is answered with an `Error` as Flower answers a ClientApp that raised, so the
server logs and counts it the same way. Other messages (`query.info`) go to the ClientApp itself.

For a method whose trainer opts in (`BaseTrainer.stacked_refusal` is None) each client runs its
`begin` (records checked, model built, global model loaded and evaluated), draws its trainer's
`local_steps` steps from its own generator (`fedskew.batched.stacked.client_steps`) and the
values its loss draws at each of them (`BaseTrainer.step_extras`: FedGen's noise), and the
round's clients then train as stacked models (`train_stacked`) in chunks; each client's trained
weights go back into its own model. A stage trains the parameters its optimiser holds, by group
(`sgd_settings`): the rest of the model is frozen, in the forward pass as it is (FedBABU's head).
A chunk's clients then go on as `BaseTrainer.local_train` does: `after_steps`, then each of their
`later_phases` (Ditto's personal update, FedRep's body epochs) as one more stacked model
(`Stage`: the phase's model, its steps drawn from the client's generator where the main steps left
it, its loss and extras), the phase's `end` after it; and their trainer's `finish` writes each reply
(personalized evaluation, upload, extras). A state a stage's loss carries from step to step (MuPFL's
BAVD maps) ends in each client's trainer's `carried`, before `after_steps`. Any other method runs
`fit` per client, its ordinary trainer: never stacked unless it says it can be.

Chunks: `batched-chunk` clients per stacked model, or (0) on a CPU every client of the round, on a
GPU as many as fit: one step of two clients (their copies) is run first and its peak memory taken as
what a client costs beside its data and its drawn per-step values, and clients are added to a chunk
while those costs stay within `MEMORY_SHARE` of the memory the device has free (`fitting_chunks`). A
chunk (or a phase of it) that still runs out of memory is split in two and run again (nothing is
written back before a stacked model ends).

Data resident on the device: each partition's training tensors are copied to a GPU once and kept
there across rounds (`ResidentData`, at most `RESIDENT_SHARE` of the GPU's memory, least recently
used dropped first); the data of a partition is fixed for a run, so its partition id names it.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Context, Error, Message, MessageType
from flwr.common.constant import ErrorCode
from torch import nn
from torch.func import stack_module_state

from fedskew.batched.stacked import (
    NotStackable,
    SGDSettings,
    Step,
    client_steps,
    sgd_settings,
    stack_schedules,
    train_stacked,
)
from fedskew.client_app.app import app as client_app
from fedskew.client_app.app import client_trainer, train_reply
from fedskew.client_app.base import BaseTrainer, FunctionalLoss, Phase, Started
from fedskew.config import validate
from fedskew.data.clients import PARTITION_KEYS, ClientData
from fedskew.registry import get_method
from fedskew.resources import available_cores
from fedskew.training import module_refusal, pick_device

log = logging.getLogger("fedskew.client")
MEMORY_SHARE = 0.8  # of the GPU memory free before a chunk, what its stacked steps may take
RESIDENT_SHARE = 0.25  # of the GPU's memory, what the clients' resident data may take


def stacked_refusal(run_config: Mapping[str, Any]) -> str | None:
    """Why the batched engine trains the configured method's clients one by one (None: stacked)."""
    cfg = validate(dict(run_config))
    return get_method(cfg["method"]).trainer_class().stacked_refusal(cfg)


def describe_engine(run_config: Mapping[str, Any]) -> str:
    """One line for `fedskew run`: the engine's device and the path the configured method takes."""
    cfg = validate(dict(run_config))
    device = pick_device(cfg["device"])
    where = f"batched engine in one process on {device}"
    if device.type == "cpu":
        where += f" ({available_cores()} torch threads)"
    refusal = stacked_refusal(cfg)
    if refusal is None:
        return f"{where}: {cfg['method']} trains each round's clients as one stacked model"
    return f"{where}: {cfg['method']} trains its clients one by one, as the ClientApp does ({refusal})"


def error_reply(msg: Message, e: Exception) -> Message:
    """The reply Flower sends for a ClientApp that raised `e` (`<class 'T'>:<'message'>`)."""
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(e)}:<'{e}'>"), reply_to=msg)


def fitting_chunks(step_bytes: float, data_bytes: list[int], budget: float) -> list[int]:
    """Sizes of consecutive chunks of clients whose costs (`step_bytes` each plus its data) stay
    within `budget` bytes; a client that does not fit alone gets a chunk of its own."""
    sizes, used, count = [], 0.0, 0
    for data in data_bytes:
        cost = step_bytes + data
        if count and used + cost > budget:
            sizes.append(count)
            used, count = 0.0, 0
        used, count = used + cost, count + 1
    return [*sizes, count] if count else sizes


class ResidentData:
    """Clients' training tensors on the device, kept across rounds by partition id (on a GPU; on a
    CPU they already are where training reads them), within `limit` bytes."""

    def __init__(self, device: torch.device, limit: int) -> None:
        self.device, self.limit = device, limit
        self.kept: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def get(self, key: tuple[int, int], data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
        """`data`'s training tensors on the device; `key` (its run, its partition) names them."""
        if self.device.type == "cpu":
            return data.x_train, data.y_train
        if key in self.kept:
            self.kept.move_to_end(key)
            return self.kept[key]
        pair = (data.x_train.to(self.device), data.y_train.to(self.device))
        self.kept[key] = pair
        while len(self.kept) > 1 and sum(x.nbytes + y.nbytes for x, y in self.kept.values()) > self.limit:
            self.kept.popitem(last=False)
        return pair


@dataclass
class Stage:
    """What a client trains in one stacked model: the parameters of `model` that its optimiser holds
    (`settings`: their groups; the others frozen) for its `steps`, on `loss`
    (`BaseTrainer.functional_loss`'s form) reading its `extras` and, at step s, its `step_extras`'
    s-th values (the main steps' only: `BaseTrainer.step_extras`), `corrections` subtracted after
    each step where its optimiser applies them."""

    model: nn.Module
    steps: list[Step]
    settings: SGDSettings
    loss: FunctionalLoss
    extras: dict[str, torch.Tensor]
    corrections: dict[str, torch.Tensor] | None = None
    step_extras: dict[str, torch.Tensor] = field(default_factory=dict)


def stage(
    trainer: BaseTrainer,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    loss: FunctionalLoss,
    extras: dict[str, torch.Tensor],
    corrections: dict[str, torch.Tensor] | None = None,
) -> Stage:
    """`trainer`'s next `steps` SGD steps of `optimizer` on `model` as a `Stage`, their batches drawn
    from its generator now, as `run_steps` would draw them next; raises `NotStackable` where the
    network or the optimiser is not one the stacked step reproduces."""
    if (reason := module_refusal(model)) is not None:
        raise NotStackable(reason)
    settings = sgd_settings(optimizer, dict(model.named_parameters()))
    if settings.corrected and corrections is None:
        raise NotStackable(f"{type(trainer).__name__}'s optimiser corrects its steps but gives no step_corrections")
    n, batch = len(trainer.data.y_train), trainer.cfg["batch-size"]
    drawn = client_steps(n, steps, batch, trainer.ctx.generator, trainer.augment)
    return Stage(model, drawn, settings, loss, extras, corrections if settings.corrected else None)


@dataclass
class Client:
    """One train message on its way through the engine."""

    index: int  # its position among its run's messages of the round
    msg: Message
    trainer: BaseTrainer
    started: Started
    data_key: tuple[int, int]  # (its run's executor, its partition): its resident data
    stage: Stage  # what it trains next: its main steps, then each of its later phases
    run: int = 0  # which of the runs trained together it belongs to (`StackedTrainer.train`)

    @property
    def key(self) -> tuple[int, int]:
        return (self.run, self.index)

    @property
    def data_bytes(self) -> int:
        return self.trainer.data.x_train.nbytes + self.trainer.data.y_train.nbytes

    @property
    def drawn_bytes(self) -> int:
        """Its stage's per-step values, on the device while its stacked model trains (the probe's one
        step holds one step of them)."""
        return sum(t.nbytes for t in self.stage.step_extras.values())


# Run-config keys that do not enter a client's stacked local step (where and how long a run runs, its
# data split, its server side): clients of runs that differ only in these train as one stacked model.
# A key missing here only keeps runs apart.
NOT_IN_LOCAL_STEP = frozenset(
    {
        # the split (each client's data is its own), not the data set (the network's input)
        *(k for k in PARTITION_KEYS if k in ("seed", "data-root") or not k.startswith(("dataset", "hf-"))),
        "out-dir",
        "run-name",
        "resume",
        "overwrite",
        "num-partitions",
        "checkpoint-every",
        "eval-every",
        "eval-batch-size",
        "class-metrics",
        "personalized-central-eval",
        "tensorboard",
        "wandb-project",
        "plots",
        "device",
        "torch-threads",
        "batched-chunk",
        "min-nodes",
        "round-timeout",
        "min-replies",
        "round-retries",
        "max-update-ratio",
        "max-num-examples",
        "state-max-mb",
    }
)


def stack_key(c: Client) -> tuple:
    """Clients that may train as one stacked model: the same trainer class, SGD settings and network,
    run configs equal but for `NOT_IN_LOCAL_STEP` (the per-client values travel as extras), and
    the same extras and per-step values by name (runs at other rounds: FedGen's clients without a
    generator in round 1 and with one later)."""
    cfg = c.trainer.cfg
    shared = tuple(sorted((k, repr(v)) for k, v in cfg.items() if k not in NOT_IN_LOCAL_STEP))
    names = tuple(sorted(c.stage.extras)), tuple(sorted(c.stage.step_extras))
    return (type(c.trainer), c.stage.settings, shared, names)


class StackedTrainer:
    """Trains clients as stacked models on one device (module docstring): of one run
    (`BatchedExecutor`), or of many runs at once (`fedskew.batched.many`), grouped by `stack_key`."""

    def __init__(self, device: torch.device, chunk: int = 0) -> None:
        self.device, self.chunk = device, chunk
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        self.resident = ResidentData(device, int(RESIDENT_SHARE * total))
        self.step_bytes: dict[tuple, float] = {}  # a client's stacked step on the GPU, measured once a group

    def train(self, clients: list[Client]) -> dict[tuple[int, int], Message]:
        """(run, index) -> reply of every client, its group trained as stacked models in chunks."""
        groups: dict[tuple, list[Client]] = {}
        for c in clients:
            groups.setdefault(stack_key(c), []).append(c)
        replies: dict[tuple[int, int], Message] = {}
        for key, group in groups.items():
            group.sort(key=lambda c: -len(c.stage.steps))  # chunks of clients of similar steps
            start = 0
            for size in self.chunk_sizes(key, group):
                replies.update(self.train_some(group[start : start + size]))
                start += size
        return replies

    def train_some(self, chunk: list[Client]) -> dict[tuple[int, int], Message]:
        """Train `chunk` as `BaseTrainer.local_train` does, its steps as one stacked model, then
        `after_steps`, then its clients' k-th later phases as one more stacked model each, and write
        the replies; a client whose training raises gets Flower's error reply."""
        replies: dict[tuple[int, int], Message] = {}
        going: list[tuple[Client, dict[str, float], Iterator[Phase]]] = []
        for c, s in zip(chunk, self.stacked(chunk, replies), strict=True):
            if s is None:
                continue
            try:
                s = c.trainer.after_steps(c.started.model, s)
                going.append((c, s, c.trainer.later_phases(c.started.model)))
            except Exception as e:
                replies[c.key] = error_reply(c.msg, e)
        while going:
            staged: list[tuple[Client, dict[str, float], Iterator[Phase], Phase]] = []
            for c, s, phases in going:
                try:
                    if (phase := next(phases, None)) is None:
                        replies[c.key] = train_reply(c.trainer, c.msg, c.trainer.finish(c.started, s))
                        continue
                    c.stage = stage(
                        c.trainer, phase.model, phase.optimizer, phase.steps, phase.functional_loss, phase.extras
                    )
                    staged.append((c, s, phases, phase))
                except Exception as e:
                    replies[c.key] = error_reply(c.msg, e)
            going = []
            for (c, s, phases, phase), phase_stats in zip(
                staged, self.stacked([c for c, *_ in staged], replies), strict=True
            ):
                try:
                    if phase_stats is not None:
                        going.append((c, phase.end(s, phase_stats), phases))
                except Exception as e:
                    replies[c.key] = error_reply(c.msg, e)
        return replies

    def stacked(self, chunk: list[Client], replies: dict[tuple[int, int], Message]) -> list[dict[str, float] | None]:
        """Each client's stats after training the `stage`s of `chunk` as one stacked model (halved on
        running out of memory); None for a client whose training raised, its error reply in `replies`."""
        if not chunk:
            return []
        try:
            return self.train_chunk(chunk)
        except torch.OutOfMemoryError:
            if len(chunk) == 1:
                raise
            torch.cuda.empty_cache()
            half = len(chunk) // 2
            log.warning("batched engine: %d clients did not fit at once: %d, then the rest", len(chunk), half)
            return self.stacked(chunk[:half], replies) + self.stacked(chunk[half:], replies)
        except Exception as e:
            replies.update({c.key: error_reply(c.msg, e) for c in chunk})
            return [None] * len(chunk)

    def train_chunk(self, chunk: list[Client], probe: bool = False) -> list[dict[str, float]]:
        """Each client's training stats, in `chunk`'s order, after training the clients' `stage`s
        (of one `stack_key`) as one stacked model, in decreasing number of steps, and writing each
        stage's weights back into its model; `probe`: one step, nothing written back."""
        ranked = sorted(range(len(chunk)), key=lambda k: -len(chunk[k].stage.steps))  # the ones training: a prefix
        stages = [chunk[k].stage for k in ranked]
        models = [st.model for st in stages]
        params, buffers = (
            {k: t.detach() for k, t in part.items()}
            for part in stack_module_state(models)  # type: ignore[arg-type]
        )
        extras = {k: torch.stack([st.extras[k] for st in stages]) for k in stages[0].extras}
        data = [self.resident.get(chunk[k].data_key, chunk[k].trainer.data) for k in ranked]
        offsets = [0]
        for x_k, _ in data[:-1]:
            offsets.append(offsets[-1] + len(x_k))
        x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        first = chunk[0].trainer
        drawn = [st.step_extras for st in stages]
        schedule = stack_schedules([st.steps for st in stages], offsets, first.cfg["batch-size"], drawn)
        schedule = (schedule.first(1) if probe else schedule).to(self.device)
        template = copy.deepcopy(models[0]).to("meta").train()
        loss = functools.partial(stages[0].loss, template)
        settings = stages[0].settings
        if any(st.settings != settings for st in stages):
            raise NotStackable("the clients' optimisers differ in their settings")
        corrections = None
        if settings.corrected:
            corrections = {k: torch.stack([st.corrections[k] for st in stages]) for k in settings.trained}  # type: ignore[index]
        reports: dict[str, torch.Tensor] = {}
        carried: dict[str, torch.Tensor] = {}
        totals = train_stacked(
            loss, params, buffers, extras, x, y, schedule, settings, first.augment, corrections, reports, carried
        )
        if probe:
            return []
        for i, k in enumerate(ranked):  # what each client's loss reported, as its `loss` adds it up
            reported = chunk[k].trainer.reported
            for name, sums in reports.items():
                reported[name] = reported.get(name, 0.0) + sums[i]
            if carried:  # and the state it carried from step to step, as it ended
                chunk[k].trainer.carried = {name: t[i].clone() for name, t in carried.items()}
        with torch.no_grad():
            for k, model in enumerate(models):
                for name, p in model.named_parameters():
                    if name in settings.trained:  # a frozen one is as it was
                        p.copy_(params[name][k])
        sums = totals.tolist()
        stats = [{} for _ in chunk]
        for k, st, total in zip(ranked, stages, sums, strict=True):
            stats[k] = {"train-loss": total / max(len(st.steps), 1), "train-steps": float(len(st.steps))}
        return stats

    def chunk_sizes(self, key: tuple, clients: list[Client]) -> list[int]:
        """How many clients each stacked model holds, in order (module docstring)."""
        if not clients:
            return []
        if self.chunk:
            return [min(self.chunk, len(clients) - i) for i in range(0, len(clients), self.chunk)]
        if self.device.type != "cuda":
            return [len(clients)]
        if key not in self.step_bytes:
            self.step_bytes[key] = self.measure_step(clients[:2])
            log.info(
                "batched engine: a client's stacked step takes %.1f MB of GPU memory", self.step_bytes[key] / 2**20
            )
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        resident = [c.data_bytes + c.drawn_bytes for c in clients]
        return fitting_chunks(self.step_bytes[key], resident, MEMORY_SHARE * free)

    def measure_step(self, sample: list[Client]) -> float:
        """GPU bytes one client's stacked step takes beside its data: the peak of one step of
        `sample` (copies of its clients' weights), less their data, per client."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.train_chunk(sample, probe=True)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        return max(peak - sum(c.data_bytes for c in sample), 0) / len(sample)


class BatchedExecutor:
    """Answers one run's round of messages for the nodes' contexts (module docstring), training its
    stacked clients on `trainer` (its own unless given one that several runs share)."""

    def __init__(self, run_config: Mapping[str, Any], trainer: StackedTrainer | None = None) -> None:
        self.cfg = validate(dict(run_config))
        self.refusal = stacked_refusal(run_config)
        self.trainer = trainer or StackedTrainer(pick_device(self.cfg["device"]), self.cfg["batched-chunk"])

    def run(self, messages: list[Message], contexts: Mapping[int, Context]) -> list[Message]:
        """The replies to `messages` (in their order), each node's state kept in its context."""
        replies, stacked = self.prepare(messages, contexts)
        replies.update({i: reply for (_, i), reply in self.trainer.train(stacked).items()})
        return [replies[i] for i in sorted(replies)]

    def prepare(self, messages: list[Message], contexts: Mapping[int, Context], run: int = 0) -> tuple[dict, list]:
        """({index: reply} of the messages answered here, the train messages to stack as `Client`s):
        a message that is not a train message goes to the ClientApp; a method that is not stacked
        runs its trainer's `fit`; a stacked one its `begin` and the draw of its steps. A check or a
        training that raises is answered with Flower's error reply."""
        replies: dict[int, Message] = {}
        stacked: list[Client] = []
        for i, msg in enumerate(messages):
            context = contexts[msg.metadata.dst_node_id]
            try:
                if msg.metadata.message_type != MessageType.TRAIN:
                    replies[i] = client_app(msg, context)
                    continue
                trainer = client_trainer(msg, context, set_threads=False)
                if self.refusal is not None:
                    replies[i] = train_reply(trainer, msg, trainer.fit(msg.content))
                    continue
                started = trainer.begin(msg.content)
                stacked.append(self.client(i, msg, trainer, started, run))
            except Exception as e:  # what the runtime does with a ClientApp exception
                replies[i] = error_reply(msg, e)
        return replies, stacked

    def client(self, i: int, msg: Message, trainer: BaseTrainer, started: Started, run: int) -> Client:
        """A started trainer as a `Client` whose stage is its main steps (`stage`: drawn from its own
        generator, then the values its loss draws at each of them, `step_extras`, for those
        batches' sizes; raises `NotStackable` when the trainer breaks what stacking needs)."""
        model = started.model
        if type(trainer).local_train is not BaseTrainer.local_train:
            raise NotStackable(f"{type(trainer).__name__} overrides local_train")
        optimizer, steps = trainer.optimizer(model), trainer.local_steps()
        main = stage(
            trainer,
            model,
            optimizer,
            steps,
            trainer.functional_loss,
            trainer.batch_extras(),
            trainer.step_corrections(model),
        )
        main.step_extras = trainer.step_extras([len(idx) for idx, _ in main.steps], trainer.cfg["batch-size"])
        return Client(i, msg, trainer, started, (id(self), trainer.ctx.partition_id), main, run)
