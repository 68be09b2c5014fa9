"""Plain PyTorch training and evaluation on in-memory tensors (no Flower, no DataLoader).

Mini-batches are slices of a seeded permutation of the local tensors, which is the fastest loop for
small images: no per-item Python, no worker processes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedskew.resources import MAX_PROCESSOR_NAME, processor_name
from fedskew.schema import ConfigError

Loss = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a batch's loss, or (loss, the training loss reported)
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], Loss]  # (model, x, y) -> the batch's `Loss`
M = TypeVar("M", bound=nn.Module)
Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]  # (batch, generator) -> augmented batch


def seed_everything(*parts: int) -> torch.Generator:
    """Seed python, numpy and torch from a tuple (e.g. seed, partition-id, round); return a
    torch generator seeded the same way for mini-batch order."""
    seed = int(np.random.SeedSequence(list(parts)).generate_state(1)[0])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def built_with_seed(build: Callable[[], M], seed: int) -> M:
    """`build()` under torch's global generator seeded with `seed`, which is left as it was: the run's
    initial network, the same on the server (`BaseStrategy.initial_arrays`) and on a client that
    builds it itself because no model reaches it (FedProto, FedPHP's first HPM)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def compute_dtype(cfg: dict[str, Any]) -> torch.dtype:
    """The clients' floating dtype (`compute-dtype`): torch.float32, or torch.float64 for checks."""
    return torch.float64 if cfg.get("compute-dtype") == "float64" else torch.float32


def pick_device(name: str = "auto") -> torch.device:
    """`auto` gives cuda when present, else cpu; a CUDA device that is not here raises ConfigError.
    A CUDA device is put in deterministic mode first (`cuda_deterministic`)."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name!r} is not allowed: CUDA is not available here")
        if (device.index or 0) >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ConfigError(f"device={name!r} is not allowed: this machine has {count} CUDA devices")
        cuda_deterministic()
    return device


def processor(device: torch.device) -> str:
    """What ran a run's arithmetic: the GPU's name on cuda, else the CPU model with the vector kernels
    torch picked (AVX2, AVX512). One seed gives the same metrics only on the same processor: the
    kernels sum float32 in different orders, which 40 rounds amplify."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{processor_name()} ({torch.backends.cpu.get_cpu_capability()})"
    return name.strip()[:MAX_PROCESSOR_NAME].strip()  # within what a result file keeps


def cuda_deterministic() -> None:
    """The same seed gives the same metrics on a GPU too: cuDNN's autotuner off and deterministic
    kernels (cuDNN's convolution backward and cuBLAS otherwise sum in a run-dependent order: with 1
    and 2 actors, `docs/benchmarks.md`, "How many clients a second do actors sharing the GPU
    train?"). cuBLAS needs its workspace setting before its first handle, i.e. before this
    process's first CUDA matrix product."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


@contextlib.contextmanager
def torch_threads(device: torch.device, threads: int) -> Iterator[None]:
    """Run the block with `threads` torch threads when `device` is a CPU and `threads` > 0 (the
    server's own training, as many threads as a client uses: no oversubscription of the cores the
    clients fill), restoring the previous number after."""
    before = torch.get_num_threads()
    if device.type == "cpu" and threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def minibatches(n: int, batch_size: int, generator: torch.Generator, device: torch.device) -> Iterator[torch.Tensor]:
    """Index tensors of a fresh random permutation of range(n), `batch_size` at a time, on `device`.

    The permutation is drawn on the CPU (the same indices on every device) and copied once: a copy
    of each batch's indices from pageable memory would make the host wait for the GPU every step."""
    perm = torch.randperm(n, generator=generator)
    yield from perm.to(device).split(batch_size)


def steps_per_round(num_examples: int, epochs: int, batch_size: int) -> int:
    """The local SGD steps of one round, K = E * ceil(n / B): what `train_epochs` takes (the last
    batch of an epoch may be short), so that a server can compute a client's K from the partition
    size it knows instead of trusting a reported count."""
    return epochs * math.ceil(num_examples / batch_size)


def warmup_lr(lr: float, server_round: int, warmup_rounds: int) -> float:
    """Linear warm-up over rounds, `lr * min(r / W, 1)` (the FedRS/MAP authors' code, `lxcnju/FedRepo`,
    W = 5): it keeps round-2 models from diverging at lr 0.03 on label-skewed clients. W = 0: `lr`."""
    if warmup_rounds <= 0:
        return lr
    return lr * min(max(server_round, 1) / warmup_rounds, 1.0)


def round_lr(cfg: dict[str, Any], server_round: int) -> float:
    """The local lr of round r: warm-up (`lr-warmup-rounds`) times the step decay
    `lr-decay ** floor((r - 1) / lr-decay-every)` (MuPFL §4.1: "decay rate of 0.005 every 3 epochs",
    read as x 0.995 every 3 rounds)."""
    steps = (max(server_round, 1) - 1) // cfg["lr-decay-every"]
    return warmup_lr(cfg["lr"], server_round, cfg["lr-warmup-rounds"]) * cfg["lr-decay"] ** steps


def sgd(params: Any, cfg: dict[str, Any]) -> torch.optim.SGD:
    """The local optimiser of every method, recreated each round (clients keep no momentum); with
    `grad-clip` > 0 every step clips the gradient norm first (the MAP/FedRS authors' code: 100)."""
    opt = torch.optim.SGD(list(params), lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight-decay"])
    clip_before_step(opt, cfg["grad-clip"])
    return opt


CLIP_NORMS = "fedskew_clip_norms"  # the optimiser's attribute listing the norms `clip_before_step` clips to
# the optimiser's attribute marking its one step post-hook as a fixed per-parameter correction
# (`fedskew.losses.scaffold.correct_after_step`), which the batched engine applies as it does
STEP_CORRECTION = "fedskew_step_correction"
# the optimiser's attribute (norm, hook id) of its step pre-hook clipping the gradient and that
# correction together, as one vector (FedDC's clip: `correct_after_step`'s `max_norm`)
CORRECTION_CLIP = "fedskew_correction_clip"


def clip_before_step(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Clip the gradient norm of the optimiser's parameters before every `step()`. The norm is also
    listed in the optimiser's `CLIP_NORMS` attribute, in the order the hooks run, so that the batched
    engine (`fedskew.batched.stacked.sgd_settings`) clips as this optimiser does."""
    if max_norm <= 0:
        return
    setattr(optimizer, CLIP_NORMS, (*getattr(optimizer, CLIP_NORMS, ()), max_norm))
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    optimizer.register_step_pre_hook(hook)


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def train_epochs(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    epochs: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    augment: Augment | None = None,
) -> dict[str, float]:
    """Run `epochs` passes of mini-batch SGD (each batch through `augment` when given, e.g.
    `fedskew.data.augment.Augmentation`); return mean loss and the number of steps."""
    steps = steps_per_round(len(x), epochs, batch_size)
    return train_steps(model, x, y, loss_fn, optimizer, steps, batch_size, generator, device, augment)


def train_steps(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    steps: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    augment: Augment | None = None,
) -> dict[str, float]:
    """Run `steps` steps of mini-batch SGD over a cycling loader: the batches of one random
    permutation, then of a fresh one when it is used up (a shuffled DataLoader restarted when
    exhausted), so `epochs x ceil(n / B)` steps are `epochs` passes and any other count a fraction
    of one. Returns mean loss and the number of steps. `loss_fn` may return (loss, reported): the
    step descends `loss`, the mean is of `reported` (FedDyn reports its cross-entropy alone)."""
    model.train()
    x, y = x.to(device), y.to(device)
    total, done = torch.zeros((), device=device), 0
    if len(x) and steps > 0:
        passes = (minibatches(len(x), batch_size, generator, device) for _ in itertools.count())
        for idx in itertools.islice(itertools.chain.from_iterable(passes), steps):
            xb = x[idx] if augment is None else augment(x[idx], generator)
            loss = loss_fn(model, xb, y[idx])
            loss, reported = (loss, loss) if isinstance(loss, torch.Tensor) else loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += reported.detach()
            done += 1
    return {"train-loss": float(total) / max(done, 1), "train-steps": float(done)}


@torch.no_grad()
def extract_features(model: nn.Module, x: torch.Tensor, batch_size: int, device: torch.device) -> torch.Tensor:
    """`model.features` of every row of `x` (eval mode, no augmentation), on `device`; [0, d] for no rows."""
    model.eval()
    feats = [model.features(x[i : i + batch_size].to(device)) for i in range(0, len(x), batch_size)]
    return torch.cat(feats) if feats else torch.zeros(0, model.feature_dim, device=device)


def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, device: torch.device
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of `model` (plain logits, argmax) on (x, y)."""
    loss, cm = confusion(model, x, y, batch_size, device)
    n = int(cm.sum())
    return loss, (int(np.trace(cm)) / n if n else float("nan"))


@torch.no_grad()
def confusion(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, device: torch.device
) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of `model` on (x, y) and its `[C, C]` confusion matrix (row: true class,
    column: argmax of the logits; C = the model's number of logits), from the same forward pass:
    the matrix is counted on the device (one `bincount` a batch) and copied to the host once.
    Empty (x, y): (NaN, an empty matrix)."""
    if len(x) == 0:
        return float("nan"), np.zeros((0, 0), dtype=np.int64)
    model.eval()
    weight = next(model.parameters(), None)  # the central test set is float32; a float64 model reads it so
    dtype = x.dtype if weight is None else weight.dtype
    loss, counts = 0.0, None
    for i in range(0, len(x), batch_size):
        xb, yb = x[i : i + batch_size].to(device, dtype), y[i : i + batch_size].to(device)
        out = model(xb)
        c = out.shape[1]
        loss += float(F.cross_entropy(out, yb, reduction="sum"))
        batch = torch.bincount(yb * c + out.argmax(1), minlength=c * c)
        counts = batch if counts is None else counts + batch
    return loss / len(x), counts.cpu().numpy().reshape(c, c)


def train_only(model: nn.Module, part: nn.Module) -> list[nn.Parameter]:
    """Freeze every parameter of `model` but those of its submodule `part` (no gradient reaches the
    rest: no backward pass through a frozen body, no weight decay on a frozen head); return `part`'s
    parameters, for its optimiser."""
    model.requires_grad_(False)
    part.requires_grad_(True)
    return list(part.parameters())


# what a trainer's stacked loss is made of (`fedskew.batched.stacked`: many clients as one model)
def functional_forward(
    model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """`model(x)` computed with `params` and `buffers` in place of the module's own tensors."""
    return functional_call(model, (params, buffers), (x,))


def functional_split_forward(
    model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`model.features(x)`, `model.classifier` of them) with `params` and `buffers` in place of the
    module's own tensors: a `SplitNet`, every tensor under one of its submodules (those under another
    than `features` and `classifier`, FedRoD's P-head, left out: `functional_part` runs them)."""
    children = {name for name, _ in model.named_children()}
    if stray := [k for k in (*params, *buffers) if k.split(".", 1)[0] not in children]:
        raise ValueError(f"not a features / classifier split: {stray[:3]}")
    z = functional_part(model, "features", params, buffers, x)
    return z, functional_part(model, "classifier", params, buffers, z)


def functional_part(
    model: nn.Module, name: str, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], *inputs: Any
) -> torch.Tensor:
    """`model`'s submodule `name` on `inputs`, with its entries of `params` and `buffers` (the whole
    model's, by name) in place of its own tensors."""
    prefix = f"{name}."
    part = tuple({k.removeprefix(prefix): t for k, t in d.items() if k.startswith(prefix)} for d in (params, buffers))
    return functional_call(getattr(model, name), part, inputs)


def weighted_sum(losses: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_i weight_i losses_i: the batch mean when the weights are 1/b on b examples (0 on padding)."""
    return (losses * weight).sum()


def module_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot be trained stacked (None: it can): a normalisation layer with running
    statistics (BatchNorm: per-client buffers updated in training, statistics over the padded batch)
    or dropout (random draws outside the clients' generators)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            return f"its {type(m).__name__} ({name}) keeps running statistics of each client's batches"
        if isinstance(m, nn.modules.dropout._DropoutNd):
            return f"its {type(m).__name__} ({name}) draws random numbers in training"
    return None
