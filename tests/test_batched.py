"""The batched engine (`fedskew.batched`): the stacked SGD against torch's, each client's batches
against the per-client loop's, every opted-in method's uploads against the per-client path's after
one round from the same start, the methods that run per client, failures, and whole runs (the
records of the Flower path's in-process grid, determinism, `fedskew run --engine batched`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedskew.batched.executor import fitting_chunks, stacked_refusal
from fedskew.batched.grid import BatchedGrid, run_batched
from fedskew.batched.stacked import (
    GroupSettings,
    Schedule,
    SGDSettings,
    StackedSGD,
    client_steps,
    sgd_settings,
    stack_schedules,
    train_stacked,
)
from fedskew.client_app.app import app as client_app
from fedskew.client_app.ditto import PERSONAL
from fedskew.client_app.feddc import DRIFT
from fedskew.client_app.fedrep import HEAD, decay_groups
from fedskew.client_app.fedrod import PERSONAL_HEAD
from fedskew.client_app.hpm import HPM_TENSORS
from fedskew.client_app.scaffold import CLIENT_CONTROL
from fedskew.config import validate
from fedskew.data.augment import Augmentation
from fedskew.losses.fedgen import build_generator
from fedskew.losses.scaffold import correct_after_step
from fedskew.methods.feddc import FEDDC_UPDATE
from fedskew.methods.fedgen import FEDGEN_GENERATOR
from fedskew.methods.fedmr import FEDMR_PROTOTYPES
from fedskew.methods.fedproc import FEDPROC_PROTOTYPES
from fedskew.methods.fedproto import FEDPROTO_PROTOTYPES
from fedskew.methods.mupfl import MUPFL_FEATURES, MUPFL_TIMES
from fedskew.models import build_model
from fedskew.registry import get_method
from fedskew.strategies.base import BaseStrategy
from fedskew.training import clip_before_step, module_refusal, sgd, train_steps
from fedskew.wire import CENTRAL_EVAL_METRICS
from tests.conftest import read_metrics
from tests.harness import (
    FLOAT64,
    ROOT,
    WIRE_ROUNDING,
    app_defaults,
    assert_float64_runs_match,
    float32_ratio_rtol,
    run_in_process,
)

STACKED = "fedavg fedprox fedrs fedlc fedgela fednova creff scaffold scaffold-rs feddyn feddc ditto".split()
STACKED += ["fedbabu", "fedrep"]  # a stage trains the parameters its optimiser holds (parameter groups)
STACKED += ["fedproto", "fedproc", "fedmr"]  # their objectives read the features (`feature_loss`)
STACKED += ["fedmmd", "moon"]  # theirs read frozen models' features of the batch too (`frozen_features`)
STACKED += ["fedrod", "fedphp"]  # objectives reading more of the pass (`forward_loss`): a second head, a teacher
STACKED += ["map"]  # a later phase with its own objective: CE + the transfer from the HPM (none in round 1)
STACKED += ["mupfl"]  # BAVD's maps a state carried from step to step (PKCF and the gradients per client around it)
STACKED += ["fedgen"]  # values drawn anew at every step (`step_extras`), a frozen generator run on them
NODES = 40  # 4 of them sampled (fraction-train 0.1): ~1,200 examples each, different sizes (Dirichlet)
ROUND = {"model": "mlp", "partition": "dirichlet", "fraction-train": 0.1, "local-epochs": 2, "batch-size": 32}
# Uploads are compared in float64 (`compute-dtype`), on short clients: 400 nodes, 4 sampled (~100-200
# examples, 6-14 steps). The stacked kernels sum in another order than the per-client ones, and how
# that rounds depends on the CPU's vector width: in float32, 84 of CReFF's 40,000 weights differed by up
# to 6e-5 on an AVX-512 CPU and none on an AVX2 one (over ~100 steps a ReLU flipping on a last bit moves
# weights by 1e-3). In float64 the two orders differ by a few units of its epsilon (2.2e-16) a sum,
# grown over the steps to ~1e-11; the replies are then rounded to float32 (the wire's dtype), so they
# may differ by one float32 rounding (2^-23 relative) plus that difference, which `WIRE_ROUNDING`
# bounds by 1e-9 = 1e7 float64 epsilons: any CPU, and 6e4 times below the float32 discrepancy.
SHORT = {"num-partitions": 400, "fraction-train": 0.01, "compute-dtype": "float64"}
# a method's overrides where the default lr moves its upload by less than the test's 1e-2: the bodies
# of FedBABU and FedRep learn under a frozen head (0.007, 0.006 at lr 0.01); MAP's upload is trained for
# half the local epochs (Algorithm 1's first stage: 0.0099)
MOVED = {"fedbabu": {"lr": 0.05}, "fedrep": {"lr": 0.05}, "map": {"lr": 0.05}}
# metrics of what an objective reports beside its loss (`BaseTrainer.feature_loss`), summed by both engines
REPORTED = ("proto-loss", "intra-loss", "inter-loss", "fedrod-bsm-loss", "fedrod-personal-loss")
REPORTED += ("fedgen-teacher-loss", "fedgen-latent-loss")


@pytest.fixture(autouse=True)
def _one_thread(task_identity: None) -> Any:
    """Both paths with one torch thread (float sums split across threads round differently)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------- the maths
def test_stacked_sgd_is_torch_sgd_per_client_and_leaves_finished_clients_alone() -> None:
    """Three clients of 3, 2 and 1 steps with momentum, weight decay and two clips (the second one
    binding), read from the optimiser a trainer builds: each client equals its own torch SGD; a
    client that is done does not move."""
    g, f64 = torch.Generator().manual_seed(0), torch.float64  # float64: the clips' norms reduce differently
    shapes = {"w": (4, 3), "b": (4,)}
    start = [{k: torch.randn(s, generator=g, dtype=f64) for k, s in shapes.items()} for _ in range(3)]
    steps = [3, 2, 1]
    grads = [
        [{k: 5 * torch.randn(s, generator=g, dtype=f64) for k, s in shapes.items()} for _ in range(n)] for n in steps
    ]
    references = []
    for k in range(3):
        params = [start[k][name].clone().requires_grad_() for name in shapes]
        opt = sgd(params, {"lr": 0.1, "momentum": 0.9, "weight-decay": 0.01, "grad-clip": 50.0})
        clip_before_step(opt, 3.0)  # as FedGELA adds its own
        settings = sgd_settings(opt, dict(zip(shapes, params, strict=True)))
        for grad in grads[k]:
            for p, name in zip(params, shapes, strict=True):
                p.grad = grad[name].clone()
            opt.step()
        references.append([p.detach() for p in params])
    assert settings == SGDSettings((GroupSettings(("w", "b"), 0.1, 0.9, 0.01),), (50.0, 3.0))
    stacked = {name: torch.stack([s[name] for s in start]) for name in shapes}
    optimizer = StackedSGD(stacked, settings)
    for j in range(3):
        active = sum(n > j for n in steps)
        before = {name: t[active:].clone() for name, t in stacked.items()}
        optimizer.step({name: torch.stack([grads[k][j][name] for k in range(active)]) for name in shapes}, active)
        assert all(torch.equal(stacked[name][active:], before[name]) for name in shapes)
    for k in range(3):
        for name, ref in zip(shapes, references[k], strict=True):
            torch.testing.assert_close(stacked[name][k], ref, **FLOAT64)
            assert not torch.allclose(stacked[name][k], start[k][name], atol=1e-2)


def test_sgd_settings_refuses_what_the_stacked_step_does_not_do() -> None:
    params = {"w": torch.zeros(2, requires_grad=True)}
    with pytest.raises(ValueError, match="Adam"):
        sgd_settings(torch.optim.Adam(params.values()), params)
    with pytest.raises(ValueError, match="Nesterov"):
        sgd_settings(torch.optim.SGD(params.values(), lr=0.1, momentum=0.9, nesterov=True), params)
    opt = torch.optim.SGD(params.values(), lr=0.1)
    opt.register_step_post_hook(lambda *a: None)  # e.g. SCAFFOLD's correction
    with pytest.raises(ValueError, match="hooks"):
        sgd_settings(opt, params)
    with pytest.raises(ValueError, match="not one of the model's parameters"):
        sgd_settings(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), params)
    opt = sgd(list(params.values()), {"lr": 0.1, "momentum": 0.0, "weight-decay": 0.0, "grad-clip": 5.0})
    correct_after_step(opt, [torch.ones(2)], 2.0)  # FedDC's clip of the gradient with the correction
    assert sgd_settings(opt, params) == SGDSettings((GroupSettings(("w",), 0.1, 0.0, 0.0),), (5.0,), True, 2.0)
    clip_before_step(opt, 3.0)  # a clip after it: not the order the stacked step clips in
    with pytest.raises(ValueError, match="after clipping it with its step correction"):
        sgd_settings(opt, params)


def test_sgd_settings_reads_a_part_of_the_model_in_parameter_groups() -> None:
    """FedRep's body epochs: the body's weights at the run's weight decay, its biases at 0, the head
    in no group (frozen); the groups keep the optimiser's order."""
    model = build_model("mlp", "fashion-mnist")
    opt = sgd(decay_groups(model, model.features), {"lr": 0.1, "momentum": 0.5, "weight-decay": 0.01, "grad-clip": 0})
    settings = sgd_settings(opt, dict(model.named_parameters()))
    weights, biases = settings.groups
    assert weights.weight_decay == 0.01 and biases.weight_decay == 0.0 and biases.lr == weights.lr == 0.1
    assert all("bias" in n for n in biases.names) and not any("bias" in n for n in weights.names)
    assert set(settings.trained) == {n for n, _ in model.named_parameters() if n.startswith("features.")}


def test_client_steps_are_the_batches_the_per_client_loop_draws() -> None:
    """With crop and flip, 2 passes and a part of a third: the drawn steps give the very batches
    `train_steps` trains on (the cycling loader)."""
    x, y = torch.randn(23, 3, 8, 8), torch.arange(23) % 10
    augment = Augmentation(2, True, (0.5, -0.5, 0.0))
    seen: list[torch.Tensor] = []

    def spy(model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        seen.append(xb)
        return model(xb.flatten(1)).sum()

    model = torch.nn.Linear(3 * 64, 1)
    g = torch.Generator().manual_seed(7)
    train_steps(model, x, y, spy, torch.optim.SGD(model.parameters(), lr=0.0), 12, 5, g, torch.device("cpu"), augment)
    steps = client_steps(23, 12, 5, torch.Generator().manual_seed(7), augment)
    assert [len(idx) for idx, _ in steps] == [5, 5, 5, 5, 3] * 2 + [5, 5]
    assert len(seen) == len(steps)
    for xb, (idx, draw) in zip(seen, steps, strict=True):
        assert draw is not None
        assert torch.equal(xb, augment.apply(x[idx], draw))


def test_stack_schedules_pads_short_batches_with_zero_weight() -> None:
    a = [(torch.tensor([4, 0]), None), (torch.tensor([1, 3]), None), (torch.tensor([2]), None)]
    b = [(torch.tensor([1, 0]), None)]
    s = stack_schedules([a, b], [0, 5], 2)
    assert s.active == [2, 1, 1]
    assert s.rows[0].tolist() == [[4, 0], [1, 3], [2, 0]]
    assert s.rows[1, 0].tolist() == [6, 5]
    assert s.weight[0].tolist() == [[0.5, 0.5], [0.5, 0.5], [1.0, 0.0]]
    assert s.weight[1, 0].tolist() == [0.5, 0.5]
    assert s.flip is None and s.shift is None
    with pytest.raises(ValueError, match="decreasing"):
        stack_schedules([b, a], [0, 2], 2)


def test_a_carried_state_passes_from_step_to_step_and_ends_per_client() -> None:
    """A loss that returns next values of an extra (a step count, the sum of its batches' labels):
    each step reads the value the step before left (the gradient of (count + 1) w is count + 1), a
    client that is done keeps its last, and `carried` receives every client's last values."""
    steps = [[(torch.tensor([0, 1]), None)] * 3, [(torch.tensor([0]), None)]]
    schedule = stack_schedules(steps, [0, 2], 2)
    x, y = torch.zeros(3, 1), torch.tensor([1.0, 2.0, 5.0])
    params = {"w": torch.zeros(2, 1)}
    extras = {"count": torch.zeros(2), "labels": torch.zeros(2), "fixed": torch.ones(2)}

    def loss(params: dict, buffers: dict, xb: torch.Tensor, yb: torch.Tensor, weight: torch.Tensor, extras: dict):
        out = ((extras["count"] + extras["fixed"]) * params["w"]).sum()
        labels = extras["labels"] + (yb * weight).sum()
        return out, out, {}, {"count": extras["count"] + 1, "labels": labels}

    settings = SGDSettings((GroupSettings(("w",), 1.0, 0.0, 0.0),))
    carried: dict[str, torch.Tensor] = {}
    train_stacked(loss, params, {}, extras, x, y, schedule, settings, carried=carried)
    assert carried.keys() == {"count", "labels"}
    assert carried["count"].tolist() == [3.0, 1.0] and carried["labels"].tolist() == [4.5, 5.0]
    assert params["w"].flatten().tolist() == [-6.0, -1.0]  # -(1 + 2 + 3), -1
    assert extras["fixed"].tolist() == [1.0, 1.0]


def test_fitting_chunks_fill_the_budget() -> None:
    assert fitting_chunks(10.0, [0, 0, 0, 0, 0], 30.0) == [3, 2]
    assert fitting_chunks(10.0, [5, 5, 50, 5], 30.0) == [2, 1, 1]  # a client too big alone: by itself
    assert fitting_chunks(10.0, [], 30.0) == []


def test_which_methods_and_models_are_stacked() -> None:
    defaults = app_defaults()
    for method in STACKED:
        assert stacked_refusal({**defaults, "method": method}) is None, method
    subclass = type("Sub", (get_method("fedrs").trainer_class(),), {})  # an opt-in is never inherited
    assert "Sub does not express its local step" in subclass.stacked_refusal(defaults)
    assert "gradient shares" in stacked_refusal({**defaults, "method": "fedmr", "fedmr-grad-share-every": 5})
    assert "Lite" in stacked_refusal({**defaults, "method": "fedmr", "fedmr-lite-n": 8})
    assert "BatchNorm2d" in stacked_refusal({**defaults, "model": "resnet8"})
    assert "grad-clip > 0" in stacked_refusal({**defaults, "method": "feddyn", "grad-clip": 1.0})  # its own clip
    assert "BatchNorm1d" in stacked_refusal({**defaults, "method": "fedgela", "fedgela-head": "code"})
    assert module_refusal(build_model("pfl-cnn", "fashion-mnist")) is None
    assert "Dropout" in module_refusal(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout()))


# ---------------------------------------------------------------------------------------- one round
def with_generator(messages: list[Message], server_round: int = 2, seed: int = 0) -> list[Message]:
    """`messages` as FedGen's server sends them from round 2 on: `server_round` in the config and a
    generator G (seeded weights; BatchNorm statistics away from 0 and 1, which eval mode reads)."""
    k, d = messages[0].content["arrays"].to_torch_state_dict()["classifier.weight"].shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        generator = build_generator(app_defaults(), k, d)
        norm = generator.hidden[1]
        norm.running_mean.normal_(0.0, 0.5)
        norm.running_var.uniform_(0.5, 2.0)
    records = {"config": ConfigRecord({"attempt": 0, "server-round": server_round})}
    records[FEDGEN_GENERATOR] = ArrayRecord(generator.state_dict())
    return [
        Message(
            RecordDict({**dict(m.content.items()), **records}),
            dst_node_id=m.metadata.dst_node_id,
            message_type=MessageType.TRAIN,
        )
        for m in messages
    ]


# a method's round-1 messages made those of a round its objective acts in (FedGen's G from round 2)
LATER = {"fedgen": with_generator}


def first_round(method: str, **overrides: Any) -> tuple[BatchedGrid, list[Message]]:
    """A batched grid of `num-partitions` nodes (`NODES` unless overridden) and the server's round-1
    train messages of `method`."""
    grid, _, messages = served_round(method, **overrides)
    return grid, messages


def served_round(method: str, **overrides: Any) -> tuple[BatchedGrid, BaseStrategy, list[Message]]:
    """`first_round` with the strategy that sent its messages."""
    cfg = {**app_defaults(), **ROUND, "method": method, "num-partitions": NODES, **overrides}
    grid = BatchedGrid(cfg["num-partitions"], cfg)
    strategy = get_method(method).strategy_class()(validate(cfg))
    config = ConfigRecord({"attempt": 0})
    return grid, strategy, list(strategy.configure_train(1, strategy.initial_arrays(), config, grid))


def per_client(grid: BatchedGrid, messages: list[Message], states: list[RecordDict] | None = None) -> list[Message]:
    """The ClientApp's replies (the Flower path's code), on other nodes serving the same partitions,
    the i-th message's node holding `states[i]` (kept there: the node's state after its round; none
    given: fresh states)."""
    replies = []
    for msg, state in zip(messages, states or [RecordDict() for _ in messages], strict=True):
        node = grid.contexts[msg.metadata.dst_node_id]
        context = Context(1, node.node_id, dict(node.node_config), state, dict(node.run_config))
        replies.append(client_app(msg, context))
    return replies


def state_arrays(state: RecordDict) -> dict[str, torch.Tensor]:
    """Every array a client keeps (its `context.state`'s ArrayRecords), by record and name."""
    return {
        f"{name}/{k}": t
        for name, record in state.items()
        if isinstance(record, ArrayRecord)
        for k, t in record.to_torch_state_dict().items()
    }


def uploads(reply: Message) -> dict[str, torch.Tensor]:
    assert not reply.has_error(), reply.error.reason
    return reply.content["arrays"].to_torch_state_dict()


def chunk_sizes_seen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The list that will receive the size of every chunk `StackedTrainer.train_chunk` trains."""
    from fedskew.batched.executor import StackedTrainer

    sizes: list[int] = []
    train_chunk = StackedTrainer.train_chunk
    monkeypatch.setattr(
        StackedTrainer,
        "train_chunk",
        lambda self, chunk, probe=False: sizes.append(len(chunk)) or train_chunk(self, chunk, probe),
    )
    return sizes


def assert_same_arrays(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same names and, to the wire's float32 rounding, the same arrays."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **WIRE_ROUNDING)


@pytest.mark.parametrize(
    "method, overrides",
    [pytest.param(m, MOVED.get(m, {}), id=m) for m in STACKED]
    + [pytest.param("fedbabu", {**MOVED["fedbabu"], "fedbabu-finetune-part": "head"}, id="fedbabu-head-finetuning")]
    + [pytest.param("fedbabu", {**MOVED["fedbabu"], "fedbabu-finetune-every": 0}, id="fedbabu-round-without-tuning")]
    + [pytest.param("fedavg", {"augment": "crop-flip"}, id="fedavg-crop-flip")]
    + [pytest.param("fedphp", {"fedphp-transfer": "mmd"}, id="fedphp-mmd")]  # a batch statistic, masked
    + [pytest.param("map", {**MOVED["map"], "map-hpm-init": "initial", "map-transfer": "mmd"}, id="map-mmd-w0")]
    + [pytest.param("fedgen", {"augment": "crop-flip"}, id="fedgen-crop-flip")]  # two streams of draws a step
    + [pytest.param("fedrs", {"batched-chunk": 1}, id="fedrs-chunks-of-1")]
    + [pytest.param("fedrs", {"personalized-central-eval": True}, id="fedrs-central-eval")]
    + [pytest.param("scaffold", {"grad-clip": 1.0}, id="scaffold-clipped")]  # binds on every step
    + [pytest.param("fednova", {"classifier-bias": True, "input-scaling": "unit"}, id="fednova-bias-unit")],
)
def test_each_client_uploads_what_the_per_client_path_uploads(method: str, overrides: dict[str, Any]) -> None:
    grid, messages = first_round(method, **SHORT, **overrides)
    messages = LATER.get(method, list)(messages)
    batched = list(grid.send_and_receive(messages))
    states = [RecordDict() for _ in messages]
    reference = per_client(grid, messages, states)
    steps = [r.content["metrics"]["train-steps"] for r in reference]
    sizes = [r.content["metrics"]["num-examples"] for r in reference]
    assert len(set(steps)) > 1 and any(n % ROUND["batch-size"] for n in sizes)  # unequal, short last batches
    start = messages[0].content["arrays"].to_torch_state_dict()
    for got, want in zip(batched, reference, strict=True):
        b = uploads(want)
        if start:  # a method whose model travels (not FedProto's)
            assert max(float((b[k] - start[k]).abs().max()) for k in b if k in start) > 1e-2  # training moved it
        m, n = got.content["metrics"], want.content["metrics"]
        for key in ("personal-accuracy", *CENTRAL_EVAL_METRICS):  # the central ones with personalized-central-eval
            if key in n:
                assert m[key] == pytest.approx(n[key], abs=0.01), key
        assert ("personal-central-accuracy" in n) == bool(overrides.get("personalized-central-eval"))
    assert_replies_match(grid, messages, batched, reference, states)


def reply_arrays(reply: Message) -> dict[str, torch.Tensor]:
    """Every array of a reply: the upload and the uplink records (prototypes, CReFF's gradients)."""
    assert not reply.has_error(), reply.error.reason
    return {
        f"{key}/{k}": t
        for key, record in reply.content.items()
        if isinstance(record, ArrayRecord)
        for k, t in record.to_torch_state_dict().items()
    }


def assert_replies_match(
    grid: BatchedGrid,
    messages: list[Message],
    batched: list[Message],
    reference: list[Message],
    states: list[RecordDict],
) -> None:
    """The batched engine's replies and kept client states are the per-client path's: every array
    (float32 on the wire) within one rounding, the same records and metric names, the same counts and
    the training loss (and what the objective reports, e.g. `proto-loss`) to 1e-5."""
    for got, want in zip(batched, reference, strict=True):
        assert got.content.keys() == want.content.keys()
        assert_same_arrays(reply_arrays(got), reply_arrays(want))
        m, n = got.content["metrics"], want.content["metrics"]
        assert m.keys() == n.keys()
        for key in ("num-examples", "partition-id", "train-steps", "participations", "observed-classes"):
            assert m.get(key) == n.get(key), key
        for key in ("train-loss", *REPORTED):
            if key in n:
                assert m[key] == pytest.approx(n[key], rel=1e-5, abs=1e-9), key
    for msg, state in zip(messages, states, strict=True):  # and the client state (SCAFFOLD's c_i)
        kept, want_kept = state_arrays(grid.contexts[msg.metadata.dst_node_id].state), state_arrays(state)
        assert kept.keys() == want_kept.keys()
        for k in kept:
            torch.testing.assert_close(kept[k], want_kept[k], **WIRE_ROUNDING)


# method -> its prototype record, and the weight of its feature term at 0 and at a value that acts.
# FedMR's intra term standardises each class's features (eps 1e-8 under the square root): dimensions
# of near-zero variance make it ill-conditioned, so its paper-scale mu1 (0.01: the replies then agree
# to 2e-13, float64 roundings) and not 0.1 (which grows them to 5e-8 in 10 steps, on both paths alike).
FEATURE_TERMS = {
    "fedproto": (FEDPROTO_PROTOTYPES, {"fedproto-lambda": 0.0}, {"fedproto-lambda": 1.0}),
    "fedproc": (
        FEDPROC_PROTOTYPES,
        {"fedproc-schedule": "constant", "fedproc-alpha": 0.0},
        {"fedproc-schedule": "constant", "fedproc-alpha": 0.5},
    ),
    "fedmr": (FEDMR_PROTOTYPES, {"fedmr-mu1": 0.0, "fedmr-mu2": 0.0}, {"fedmr-mu1": 0.01, "fedmr-mu2": 1.0}),
}


def with_global_prototypes(messages: list[Message], record: str) -> list[Message]:
    """`messages` with seeded global prototypes in `record`, valid for every class but the last (whose
    examples the prototype terms leave out), in place of round 1's none."""
    shape = messages[0].content[record]["prototypes"].shape
    protos = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    valid = torch.arange(shape[0]) < shape[0] - 1
    return [
        Message(
            RecordDict({**dict(m.content.items()), record: ArrayRecord({"prototypes": protos, "valid": valid})}),
            dst_node_id=m.metadata.dst_node_id,
            message_type=MessageType.TRAIN,
        )
        for m in messages
    ]


def trained_model(grid: BatchedGrid, msg: Message, reply: Message) -> dict[str, torch.Tensor]:
    """A client's trained model: its upload, or the model it keeps where none travels (FedProto)."""
    if arrays := uploads(reply):
        return arrays
    kept, prefix = state_arrays(grid.contexts[msg.metadata.dst_node_id].state), "tensors.fedproto-model/"
    return {k.removeprefix(prefix): t.float() for k, t in kept.items() if k.startswith(prefix)}


@pytest.mark.parametrize("method", FEATURE_TERMS)
def test_a_feature_term_stacks_and_reaches_the_gradient(method: str) -> None:
    """With global prototypes for all classes but one, a method whose objective reads the features
    (`feature_loss`) gives on the batched engine the per-client path's replies, reported terms and
    kept states (float64); at the term's weight 0 each client's trained model is FedAvg's from the
    same start and batches, at a weight > 0 it is not: the term's gradient reaches the parameters
    through the stacked features."""
    record, zero, acting = FEATURE_TERMS[method]
    fedavg_grid, fedavg_messages = first_round("fedavg", **SHORT)
    fedavg = [uploads(r) for r in fedavg_grid.send_and_receive(fedavg_messages)]
    for weights in (zero, acting):
        grid, messages = first_round(method, **SHORT, **weights)
        assert [m.metadata.dst_node_id for m in messages] == [m.metadata.dst_node_id for m in fedavg_messages]
        messages = with_global_prototypes(messages, record)
        batched = list(grid.send_and_receive(messages))
        gaps = []
        for msg, reply, avg in zip(messages, batched, fedavg, strict=True):
            model = trained_model(grid, msg, reply)
            assert model.keys() == avg.keys()
            gaps.append(max(float((model[k] - avg[k]).abs().max()) for k in avg))
        if weights is zero:
            assert max(gaps) <= 1e-6, gaps
            continue
        assert min(gaps) > 1e-3, gaps
        states = [RecordDict() for _ in messages]
        assert_replies_match(grid, messages, batched, per_client(grid, messages, states), states)
        assert all(r.content["metrics"].get(k, 1.0) > 0 for r in batched for k in REPORTED)


# method -> its term of frozen models' features (`frozen_features`): the weight's key, and the round
# it acts in (MOON's negative is the client's model of its previous participation: none in round 1)
FROZEN_TERMS = {"fedmmd": ("fedmmd-lambda", 1), "moon": ("moon-mu", 2)}


@pytest.mark.parametrize("method", FROZEN_TERMS)
def test_a_frozen_model_s_features_stack_and_reach_the_gradient(method: str) -> None:
    """A method whose objective compares the batch's features with a frozen model's (FedMMD: the
    global model's; MOON: the global and the previous local model's, run under `vmap` on each
    client's weights) gives on the batched engine, in the round its term acts in: at the term's
    weight 0 each client's upload FedAvg's from the same start and batches, at weight 1 every
    client's upload > 1e-3 away from it (the term's gradient reaches the parameters through the
    stacked features) and the per-client path's replies, reported term and states (float64)."""
    key, acting = FROZEN_TERMS[method]
    fedavg_grid, fedavg_messages = first_round("fedavg", **SHORT)
    start = fedavg_messages[0].content["arrays"]
    if acting > 1:
        fedavg_messages = next_round(fedavg_messages, start, acting)
    fedavg = [uploads(r) for r in fedavg_grid.send_and_receive(fedavg_messages)]
    for weight in (0.0, 1.0):
        grid, messages = first_round(method, **SHORT, **{key: weight})
        assert [m.metadata.dst_node_id for m in messages] == [m.metadata.dst_node_id for m in fedavg_messages]
        states = [RecordDict() for _ in messages]
        for server_round in range(1, acting + 1):
            if server_round > 1:
                messages = next_round(messages, start, server_round)
            batched = list(grid.send_and_receive(messages))
            reference = per_client(grid, messages, states) if weight else []
        gaps = [max(float((uploads(r)[k] - a[k]).abs().max()) for k in a) for r, a in zip(batched, fedavg, strict=True)]
        if not weight:
            assert max(gaps) <= 1e-6, gaps
            continue
        assert min(gaps) > 1e-3, gaps
        assert_replies_match(grid, messages, batched, reference, states)
        name = {"fedmmd": "mmd-loss", "moon": "moon-loss"}[method]
        for got, want in zip(batched, reference, strict=True):
            m, n = got.content["metrics"], want.content["metrics"]
            assert m[name] > 0 and m[name] == pytest.approx(n[name], rel=1e-9), name


def next_round(messages: list[Message], arrays: ArrayRecord, server_round: int) -> list[Message]:
    """The train messages of `server_round` to the same nodes, with `arrays` as the global model."""
    return train_messages([m.metadata.dst_node_id for m in messages], arrays, server_round)


def train_messages(nodes: list[int], arrays: ArrayRecord, server_round: int) -> list[Message]:
    """The train messages of `server_round` to `nodes`, with `arrays` as the global model."""
    config = ConfigRecord({"attempt": 0, "server-round": server_round})
    return [
        Message(RecordDict({"arrays": arrays, "config": config}), dst_node_id=node, message_type=MessageType.TRAIN)
        for node in nodes
    ]


def assert_two_rounds_as_per_client(method: str, kept: str, metrics: tuple[str, ...], **overrides: Any) -> None:
    """`method`'s stacked clients get the per-client path's uploads, kept state (with a record
    `kept`) and metrics (`metrics` to float64 roundings) in float64, after round 1 and after round 2,
    which reads what round 1 kept (against another global model: a round-1 upload)."""
    grid, messages = first_round(method, **SHORT, **overrides)
    states = [RecordDict() for _ in messages]
    for server_round in (1, 2):
        batched = list(grid.send_and_receive(messages))
        reference = per_client(grid, messages, states)
        for got, want in zip(batched, reference, strict=True):
            assert_same_arrays(uploads(got), uploads(want))
            m, n = got.content["metrics"], want.content["metrics"]
            assert m.keys() == n.keys()
            assert m["train-steps"] == n["train-steps"] and m["participations"] == n["participations"] == server_round
            assert m["personal-accuracy"] == n["personal-accuracy"]
            for key in ("personal-loss", "train-loss", *metrics):
                assert m[key] == pytest.approx(n[key], rel=1e-9), key
        for msg, state in zip(messages, states, strict=True):
            kept_here, want_kept = state_arrays(grid.contexts[msg.metadata.dst_node_id].state), state_arrays(state)
            assert kept_here.keys() == want_kept.keys() and any(k.startswith(f"tensors.{kept}/") for k in kept_here)
            for k in kept_here:
                torch.testing.assert_close(kept_here[k], want_kept[k], **FLOAT64)
        messages = next_round(messages, batched[0].content["arrays"], server_round + 1)


def test_ditto_s_personal_models_and_metrics_are_the_per_client_path_s_over_two_rounds() -> None:
    """Ditto's two phases stacked (the global updates, then the personal models against each
    client's w^t) give each client the per-client path's upload, kept v_k and personalized metrics,
    in float64: after round 1 (v_k from w^0) and after round 2, which reads the v_k kept in round 1
    (against another w^t). 3 personal epochs to the global update's 2: the phase draws its own steps
    from the client's generator where the global update's left it."""
    overrides = {"ditto-personal-epochs": 3, "ditto-lambda": 0.5}
    assert_two_rounds_as_per_client("ditto", PERSONAL, ("ditto-loss", "ditto-distance"), **overrides)


def test_fedrep_s_heads_and_metrics_are_the_per_client_path_s_over_two_rounds() -> None:
    """FedRep's two stacked stages (the heads with the bodies frozen, then the bodies with the heads
    frozen, each with its biases in a group without weight decay) give each client the per-client
    path's body upload, kept head h_i and personalized metrics, in float64: after round 1 (h_i from
    w^0's head) and after round 2, which reads the h_i kept in round 1 under another body. Weight
    decay 0.01 (the bias groups' 0 matters) and a binding gradient clip (1.0: it moves the uploads by
    0.5), over the optimiser's parameters only."""
    overrides = {"lr": 0.05, "weight-decay": 0.01, "grad-clip": 1.0, "fedrep-head-epochs": 3}
    assert_two_rounds_as_per_client("fedrep", HEAD, ("fedrep-head-loss",), **overrides)


def test_moon_s_previous_models_and_metrics_are_the_per_client_path_s_over_two_rounds() -> None:
    """MOON's stacked clients (each with its global and previous model's tensors as extras) get the
    per-client path's uploads, kept local models and metrics in float64: in round 1 without a
    negative (CE alone, `moon-negative` 0), in round 2 against the model each kept in round 1."""
    assert_two_rounds_as_per_client("moon", "moon-previous", ("moon-loss", "moon-negative"))


def test_fedrod_s_personal_heads_and_terms_are_the_per_client_path_s_over_two_rounds() -> None:
    """FedRoD stacked (body, G-head and the client's P-head in one stacked step, the log prior an
    extra) gives each client the per-client path's generic upload, kept P-head and both terms'
    means, in float64: after round 1 (the P-head from w^0's) and after round 2, which reads the P-head
    kept in round 1 under another generic model. Weight decay 0.01 and a binding clip (0.5) over all
    three parts together, as the per-client optimiser clips them."""
    overrides = {"weight-decay": 0.01, "grad-clip": 0.5}
    assert_two_rounds_as_per_client("fedrod", PERSONAL_HEAD, ("fedrod-bsm-loss", "fedrod-personal-loss"), **overrides)


def test_fedrod_s_generic_parts_follow_their_own_loss_and_the_personal_head_moves() -> None:
    """Stacked FedRoD at gamma 0 (L_BSM is then the cross-entropy) uploads FedAvg's trained model from
    the same start and batches: the P-head's term, on detached features and logits, reaches neither
    body nor G-head; at gamma 1 (the balanced softmax) every client's upload differs from FedAvg's.
    Either way each kept P-head has moved away from w^0's head, where it started."""
    fedavg_grid, fedavg_messages = first_round("fedavg", **SHORT)
    fedavg = [uploads(r) for r in fedavg_grid.send_and_receive(fedavg_messages)]
    start = fedavg_messages[0].content["arrays"].to_torch_state_dict()["classifier.weight"]  # w^0's head
    for gamma in (0.0, 1.0):
        grid, messages = first_round("fedrod", **SHORT, **{"fedrod-gamma": gamma})
        gaps = []
        for msg, reply, avg in zip(messages, grid.send_and_receive(messages), fedavg, strict=True):
            upload = uploads(reply)
            assert upload.keys() == avg.keys()
            gaps.append(max(float((upload[k] - avg[k]).abs().max()) for k in avg))
            head = state_arrays(grid.contexts[msg.metadata.dst_node_id].state)[f"tensors.{PERSONAL_HEAD}/weight"]
            assert float((head.float() - start).abs().max()) > 1e-3
        assert max(gaps) <= 1e-9 if gamma == 0.0 else min(gaps) > 1e-3, (gamma, gaps)


def test_fedphp_s_hpms_and_metrics_are_the_per_client_path_s_over_two_rounds() -> None:
    """FedPHP stacked (each client's HPM a frozen teacher whose tensors are its extras, run on the
    batch under vmap) gives each client the per-client path's upload, kept HPM psi and counter, and
    mu, in float64: after round 1 (the teacher w^0, mu 0: psi the trained model) and after round 2,
    which distils from the psi kept in round 1 and averages into it (mu 0.9: int(Q T) = 0 counts as 1)."""
    assert_two_rounds_as_per_client("fedphp", HPM_TENSORS, ("hpm-mu",), **{"fedphp-transfer-weight": 0.5})


def test_fedphp_s_transfer_reaches_the_stacked_gradient() -> None:
    """Stacked FedPHP at transfer weight 0 uploads FedAvg's trained model from the same start and
    batches; at 0.5 every client's upload differs from it: the teacher's term, from each client's own
    HPM tensors, reaches the gradient."""
    fedavg_grid, fedavg_messages = first_round("fedavg", **SHORT)
    fedavg = [uploads(r) for r in fedavg_grid.send_and_receive(fedavg_messages)]
    for lam in (0.0, 0.5):
        grid, messages = first_round("fedphp", **SHORT, **{"fedphp-transfer-weight": lam})
        gaps = []
        for reply, avg in zip(grid.send_and_receive(messages), fedavg, strict=True):
            upload = uploads(reply)
            gaps.append(max(float((upload[k] - avg[k]).abs().max()) for k in avg))
        assert max(gaps) <= 1e-9 if lam == 0.0 else min(gaps) > 1e-3, (lam, gaps)


MAP_METRICS = ("stage2-loss", "stage2-accuracy", "hpm-mu", "hpm-participations", "hpm-transfer")


@pytest.mark.parametrize("transfer", ["distill", "mmd"])
def test_map_s_stages_and_hpms_are_the_per_client_path_s_with_and_without_a_teacher_in_one_stack(
    transfer: str,
) -> None:
    """MAP stacked (stage 1 FedRS's stacked steps, stage 2 a later phase on CE + lam L_tr, each
    client's HPM a frozen teacher in its extras) gives each client the per-client path's upload,
    stage-2 and HPM metrics and kept HPM and counter, in float64: in round 1 (no HPM: stage 2 plain
    CE, mu 0) and in round 2, whose stack mixes two clients of round 1 (their HPM the teacher, mu > 0)
    with two first participations (a stand-in teacher at weight 0: exactly CE)."""
    grid, messages = first_round("map", **SHORT, **{"map-transfer": transfer, "map-transfer-weight": 0.5})
    first = [m.metadata.dst_node_id for m in messages]
    others = [n for n in grid.contexts if n not in first][:2]
    states = {node: RecordDict() for node in [*first, *others]}
    for server_round in (1, 2):
        batched = list(grid.send_and_receive(messages))
        nodes = [m.metadata.dst_node_id for m in messages]
        reference = per_client(grid, messages, [states[n] for n in nodes])
        for got, want in zip(batched, reference, strict=True):
            assert_same_arrays(uploads(got), uploads(want))
            m, n = got.content["metrics"], want.content["metrics"]
            assert m.keys() == n.keys()
            for key in ("train-steps", "participations", "personal-accuracy", *MAP_METRICS[1:]):
                assert m[key] == n[key], key
            for key in ("train-loss", "personal-loss", "stage2-loss"):
                assert m[key] == pytest.approx(n[key], rel=1e-9), key
        transfers = [r.content["metrics"]["hpm-transfer"] for r in batched]
        assert transfers == ([0] * 4 if server_round == 1 else [1, 1, 0, 0])  # round 2: a mixed stack
        for node in nodes:
            kept, want_kept = state_arrays(grid.contexts[node].state), state_arrays(states[node])
            assert kept.keys() == want_kept.keys() and any(k.startswith(f"tensors.{HPM_TENSORS}/") for k in kept)
            for k in kept:
                torch.testing.assert_close(kept[k], want_kept[k], **FLOAT64)
        messages = train_messages([*first[:2], *others], batched[0].content["arrays"], 2)


def map_hpms(**overrides: Any) -> list[dict[str, torch.Tensor]]:
    """The HPMs that stacked MAP keeps after round 1 on `first_round`'s clients."""
    grid, messages = first_round("map", **SHORT, **overrides)
    assert all(uploads(r) for r in grid.send_and_receive(messages))
    prefix = f"tensors.{HPM_TENSORS}/"
    states = (state_arrays(grid.contexts[m.metadata.dst_node_id].state) for m in messages)
    return [{k.removeprefix(prefix): t for k, t in kept.items() if k.startswith(prefix)} for kept in states]


@pytest.mark.parametrize("transfer", ["distill", "mmd"])
def test_map_s_transfer_reaches_the_stacked_stage_two(transfer: str) -> None:
    """Stacked MAP with every HPM starting at w^0 (`map-hpm-init="initial"`: a teacher in round 1,
    mu 0: the HPM the stage-2 model): at transfer weight 0 each client's HPM is the one trained
    without a teacher (plain CE, `map-hpm-init="none"`); at 0.5 every client's differs from it."""
    plain = map_hpms(**{"map-transfer": transfer})
    for lam in (0.0, 0.5):
        hpms = map_hpms(**{"map-transfer": transfer, "map-hpm-init": "initial", "map-transfer-weight": lam})
        gaps = [max(float((h[k] - p[k]).abs().max()) for k in p) for h, p in zip(hpms, plain, strict=True)]
        assert max(gaps) <= 1e-12 if lam == 0.0 else min(gaps) > 1e-3, (lam, gaps)


# MuPFL's configurations: the default (each sample's top half of its features kept, the maps
# restarting each epoch); the map's own mask ("batch"), rescaled, the maps kept across rounds
# ("never": round 2 starts from the maps round 1 kept); the map's threshold at both conv blocks of
# LeNet (two C x H x W maps), psi with the paper's sign, the maps restarting each round
MUPFL = {
    "default": {},
    "batch-kept": {"mupfl-bavd-mask": "batch", "mupfl-bavd-rescale": True, "mupfl-bavd-reset": "never"},
    "convs-threshold": {
        "model": "lenet",
        "mupfl-bavd-site": "convs",
        "mupfl-bavd-mask": "map-threshold",
        "mupfl-psi-sign": "paper",
        "mupfl-bavd-reset": "round",
    },
}


def mupfl_next_round(
    strategy: BaseStrategy, grid: BatchedGrid, messages: list[Message], replies: list[Message], server_round: int
) -> list[Message]:
    """MuPFL's train messages of `server_round` to the nodes of `messages`: the strategy's after
    `replies` (the global model, its classifier, PKCF's synthetic features of the classes seen so far),
    one for every node under init "global"."""
    arrays, _ = strategy.aggregate_train(server_round - 1, replies)
    sent = next(iter(strategy.configure_train(server_round, arrays, ConfigRecord({"attempt": 0}), grid)))
    content = dict(sent.content.items())
    return [
        Message(RecordDict(content), dst_node_id=m.metadata.dst_node_id, message_type=MessageType.TRAIN)
        for m in messages
    ]


@pytest.mark.parametrize("overrides", MUPFL.values(), ids=MUPFL)
def test_mupfl_s_replies_states_and_metrics_are_the_per_client_path_s_over_two_rounds(overrides: dict) -> None:
    """MuPFL's stacked steps, BAVD's maps carried from step to step on the device, give each client
    the per-client path's upload, flat maps, class gradients and kept maps (float64), and its
    metrics: after round 1 and after round 2, whose PKCF fine-tunes each classifier on the server's
    synthetic features before the steps (the client's generator drawn in the per-client order: the
    fine-tune's batches, the steps', the gradients' samples)."""
    grid, strategy, messages = served_round("mupfl", **SHORT, **overrides)
    states = [RecordDict() for _ in messages]
    batched: list[Message] = []
    for server_round in (1, 2):
        if server_round == 2:
            messages = mupfl_next_round(strategy, grid, messages, batched, server_round)
            assert MUPFL_FEATURES in messages[0].content
        batched = list(grid.send_and_receive(messages))
        reference = per_client(grid, messages, states)
        assert_replies_match(grid, messages, batched, reference, states)
        for got, want in zip(batched, reference, strict=True):
            m, n = got.content["metrics"], want.content["metrics"]
            assert m["bavd-dropped-positions"] == n["bavd-dropped-positions"] > 0  # counts: exact in float32
            # float32 on both paths (`dropped_fractions`), averaged over < 32 passes; k: the largest site
            k = ROUND["batch-size"] * (6 * 24 * 24 if overrides.get("model") == "lenet" else 200)
            assert m["bavd-dropped-mass"] == pytest.approx(n["bavd-dropped-mass"], rel=float32_ratio_rtol(k, 32))
            assert m["bavd-seconds"] == 0.0  # inside the stacked step
            for key in ("finetune-loss", "pkcf-accuracy"):  # per client before the steps, on both paths
                assert (key in m) == (key in n) == (server_round == 2) and m.get(key) == n.get(key), key
            real_norm = got.content[MUPFL_TIMES]["real-norm"]
            assert real_norm == pytest.approx(want.content[MUPFL_TIMES]["real-norm"], rel=1e-9)
    kept = [k for msg in messages for k in state_arrays(grid.contexts[msg.metadata.dst_node_id].state)]
    assert any(k.startswith("tensors.mupfl-maps/") for k in kept) == (overrides.get("mupfl-bavd-reset") == "never")


def test_mupfl_s_bavd_masks_the_stacked_step() -> None:
    """On the batched engine, round 1 (no synthetic features yet): with BAVD off each client's upload
    is FedAvg's from the same start and batches; with each sample's top half kept (the default), or
    with the carried map's mask ("batch": none at the first step, then the map's), every client's is
    > 1e-4 away from it (the default drops the weaker half of each sample's features, little of their
    mass: most are 0 after the ReLU): the masks act in the stacked step, the carried map's too."""
    fedavg_grid, fedavg_messages = first_round("fedavg", **SHORT)
    fedavg = [uploads(r) for r in fedavg_grid.send_and_receive(fedavg_messages)]
    for overrides in ({"mupfl-bavd": False}, {}, {"mupfl-bavd-mask": "batch"}):
        grid, messages = first_round("mupfl", **SHORT, **overrides)
        assert [m.metadata.dst_node_id for m in messages] == [m.metadata.dst_node_id for m in fedavg_messages]
        replies = list(grid.send_and_receive(messages))
        gaps = [max(float((uploads(r)[k] - a[k]).abs().max()) for k in a) for r, a in zip(replies, fedavg, strict=True)]
        if overrides.get("mupfl-bavd", True):
            assert min(gaps) > 1e-4, (overrides, gaps)
            assert all(r.content["metrics"]["bavd-dropped-positions"] > 0 for r in replies)
        else:
            assert max(gaps) <= 1e-6, gaps


def test_fedgen_s_regulariser_reaches_the_stacked_gradient() -> None:
    """Stacked FedGen in round 2 (with G) at alpha = beta = 0 uploads FedAvg's trained model from the
    same start and batches (the draws leave the mini-batch stream alone); at alpha = beta = 1 every
    client's upload differs from it and both terms are reported."""
    fedavg_grid, fedavg_messages = first_round("fedavg", **SHORT)
    fedavg_messages = next_round(fedavg_messages, fedavg_messages[0].content["arrays"], 2)
    fedavg = [uploads(r) for r in fedavg_grid.send_and_receive(fedavg_messages)]
    for weight in (0.0, 1.0):
        grid, messages = first_round("fedgen", **SHORT, **{"fedgen-alpha": weight, "fedgen-beta": weight})
        replies = list(grid.send_and_receive(with_generator(messages)))
        gaps = [max(float((uploads(r)[k] - a[k]).abs().max()) for k in a) for r, a in zip(replies, fedavg, strict=True)]
        assert max(gaps) <= 1e-9 if weight == 0.0 else min(gaps) > 1e-3, (weight, gaps)
        assert all(r.content["metrics"]["fedgen-teacher-loss"] > 0 for r in replies)


def test_fedgen_s_drawn_steps_are_the_per_client_draws() -> None:
    """The values a FedGen client draws for all its steps before training (`step_extras`, as the
    batched engine does: padded to the batch size) are, step by step, those its per-client loss
    draws at the step (recorded while `local_train` runs) and those the loss drew before it was
    written in hooks (`Generator.noise`, then the labels, then their noise), short batches included:
    their b rows, zeros after."""
    from fedskew.client_app.app import client_trainer
    from fedskew.client_app.fedgen import NOISE, SAMPLED, SAMPLED_NOISE

    grid, messages = first_round("fedgen", **SHORT)
    msg = with_generator(messages)[0]
    context = grid.contexts[msg.metadata.dst_node_id]
    trainer = client_trainer(msg, context, set_threads=False)
    trainer.begin(msg.content)
    batch, n = trainer.cfg["batch-size"], len(trainer.data.y_train)
    sizes = [len(idx) for idx, _ in client_steps(n, trainer.local_steps(), batch, trainer.ctx.generator, None)]
    assert min(sizes) < batch and sizes.count(batch) > 1  # full batches and short ones (a pass's last)
    start = trainer.noise_rng.get_state()
    drawn = trainer.step_extras(sizes, batch)
    assert drawn[NOISE].shape[:2] == (len(sizes), batch) and drawn[SAMPLED].shape[0] == len(sizes)

    per_client = client_trainer(msg, context, set_threads=False)
    started = per_client.begin(msg.content)
    seen: list[dict[str, torch.Tensor]] = []
    forward_loss = per_client.forward_loss

    def spy(data: torch.Tensor, fwd: Any, y: torch.Tensor, weight: Any, extras: dict) -> Any:
        seen.append({k: extras[k].clone() for k in (NOISE, SAMPLED, SAMPLED_NOISE)})
        return forward_loss(data, fwd, y, weight, extras)

    per_client.forward_loss = spy  # type: ignore[method-assign]
    per_client.local_train(started.model, msg.content)
    before = torch.Generator()
    before.set_state(start)
    generator, gen_batch = trainer.generator, trainer.cfg["fedgen-gen-batch-size"]
    assert generator is not None and len(seen) == len(sizes)
    for s, (b, step) in enumerate(zip(sizes, seen, strict=True)):
        assert step[NOISE].shape[0] == b and torch.equal(step[NOISE], drawn[NOISE][s, :b])
        assert not drawn[NOISE][s, b:].any()
        assert all(torch.equal(step[k], drawn[k][s]) for k in (SAMPLED, SAMPLED_NOISE))
        assert torch.equal(step[NOISE], generator.noise(b, before))
        assert torch.equal(step[SAMPLED], torch.randint(generator.num_classes, (gen_batch,), generator=before))
        assert torch.equal(step[SAMPLED_NOISE], generator.noise(gen_batch, before))


def test_stack_schedules_stacks_each_step_s_values() -> None:
    """Per-step values of clients of 3 and 1 steps: `[K, S, ...]`, zeros after a client's last step,
    sliced per step for its active clients, cut with the schedule."""
    steps = [[(torch.tensor([0]), None)] * 3, [(torch.tensor([0]), None)]]
    values = [{"v": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])}, {"v": torch.tensor([[7.0, 8.0]])}]
    s = stack_schedules(steps, [0, 1], 1, values)
    assert s.values["v"].tolist() == [[[1, 2], [3, 4], [5, 6]], [[7, 8], [0, 0], [0, 0]]]
    assert s.step_values(0)["v"].tolist() == [[1, 2], [7, 8]] and s.step_values(2)["v"].tolist() == [[5, 6]]
    assert isinstance(s.first(1), Schedule) and s.first(1).values["v"].shape == (2, 1, 2)


def test_fedgen_runs_at_other_rounds_train_together_as_each_alone(monkeypatch) -> None:
    """FedGen clients of three runs in one `StackedTrainer.train` (as `fedskew.batched.many` gathers
    them): one in round 1 (no G: FedAvg's step), two in rounds 2 and 3 (other generators, other
    alpha_t, beta_t: each client's extras). The round-1 clients stack apart (other extras), the
    others together; each client's reply is the one its run gets alone (float64)."""
    from fedskew.batched.executor import StackedTrainer

    def runs() -> list[tuple[BatchedGrid, list[Message]]]:
        out = []
        for seed, server_round in enumerate((1, 2, 3)):
            grid, messages = first_round("fedgen", **SHORT, seed=seed)
            out.append((grid, with_generator(messages, server_round, seed) if server_round > 1 else messages))
        return out

    alone = [list(grid.send_and_receive(messages)) for grid, messages in runs()]
    chunks = chunk_sizes_seen(monkeypatch)
    shared, clients = StackedTrainer(torch.device("cpu")), []
    for run, (grid, messages) in enumerate(runs()):
        done, prepared = grid.executor.prepare(messages, grid.contexts, run)
        assert not done
        clients += prepared
    together = shared.train(clients)
    assert sorted(chunks) == [4, 8]
    for run, replies in enumerate(alone):
        for i, want in enumerate(replies):
            got = together[(run, i)]
            assert_same_arrays(reply_arrays(got), reply_arrays(want))
            m, n = got.content["metrics"], want.content["metrics"]
            assert m.keys() == n.keys() and ("fedgen-teacher-loss" in m) == (run > 0)
            for key in ("train-loss", "fedgen-teacher-loss", "fedgen-latent-loss"):
                if key in n:
                    assert m[key] == pytest.approx(n[key], rel=1e-9), key


def test_a_stacked_stage_moves_the_parameters_its_optimiser_holds_and_no_other(monkeypatch) -> None:
    """FedBABU (the body, then a head-only fine-tuning) and FedRep (the head, then the body) each train
    two stacked models a round, with momentum and weight decay on (a frozen part in the step would
    move): each stage moves exactly the parameters its optimiser holds, the others bit-identical."""
    from fedskew.batched.executor import StackedTrainer, describe_engine

    seen: list[tuple[set[str], set[str]]] = []  # per client and stage: (trained, moved)
    train_chunk = StackedTrainer.train_chunk

    def spy(self: StackedTrainer, chunk: list, probe: bool = False) -> list:
        before = [{k: p.detach().clone() for k, p in c.stage.model.named_parameters()} for c in chunk]
        out = train_chunk(self, chunk, probe)
        for c, start in zip(chunk, before, strict=True):
            moved = {k for k, p in c.stage.model.named_parameters() if not torch.equal(p, start[k])}
            seen.append((set(c.stage.settings.trained), moved))
        return out

    monkeypatch.setattr(StackedTrainer, "train_chunk", spy)
    names = {n for n, _ in build_model("mlp", "fashion-mnist").named_parameters()}
    body = {n for n in names if n.startswith("features.")}
    head = names - body
    for method, stages in (("fedbabu", (body, head)), ("fedrep", (head, body))):
        assert f"{method} trains each round's clients as one stacked model" in describe_engine(
            {**app_defaults(), "method": method}
        )
        overrides = {"weight-decay": 0.01, "fedbabu-finetune-part": "head", "fedrep-head-epochs": 1}
        grid, messages = first_round(method, **SHORT, **overrides)
        assert all(uploads(r) for r in grid.send_and_receive(messages))
        assert seen == [(stages[0], stages[0])] * len(messages) + [(stages[1], stages[1])] * len(messages)
        seen.clear()


@pytest.mark.parametrize("clip", [0.0, 0.1], ids=["unclipped", "clipped"])
def test_feddc_s_uploads_drift_and_control_are_the_per_client_path_s_over_two_rounds(clip: float, monkeypatch) -> None:
    """FedDC stacked (each client's penalty target w - h_i and correction c - c_i; with `grad-clip`
    the gradient and the correction clipped together, per client) gives each client the per-client
    path's upload, `feddc-update`, metrics and kept h_i, c_i, in float64: after round 1 (h_i = c_i =
    0) and after round 2 (the server's aggregate and c, and the h_i, c_i kept in round 1). At
    `grad-clip` 0.1 the clip binds on some steps (s < 1)."""
    from fedskew.batched import stacked

    scales: list[float] = []
    clip_per_client = stacked.clip_per_client

    def recorded(*args: Any) -> torch.Tensor:
        s = clip_per_client(*args)
        scales.extend(s.tolist())
        return s

    monkeypatch.setattr(stacked, "clip_per_client", recorded)
    grid, strategy, messages = served_round("feddc", **SHORT, **{"grad-clip": clip, "feddc-alpha": 0.1})
    nodes = [m.metadata.dst_node_id for m in messages]
    monkeypatch.setattr(strategy, "sample", lambda server_round, grid: nodes)  # round 2: the same clients
    states = [RecordDict() for _ in messages]
    for server_round in (1, 2):
        batched = list(grid.send_and_receive(messages))
        reference = per_client(grid, messages, states)
        for got, want in zip(batched, reference, strict=True):
            for record in ("arrays", FEDDC_UPDATE):
                assert_same_arrays(*(r.content[record].to_torch_state_dict() for r in (got, want)))
            m, n = got.content["metrics"], want.content["metrics"]
            assert m.keys() == n.keys() and m["participations"] == n["participations"] == server_round
            for key in ("train-loss", "correction-norm", "feddc-drift-norm", "personal-loss"):
                assert m[key] == pytest.approx(n[key], rel=1e-9), key
        for msg, state in zip(messages, states, strict=True):
            kept, want_kept = state_arrays(grid.contexts[msg.metadata.dst_node_id].state), state_arrays(state)
            assert kept.keys() == want_kept.keys()
            assert all(any(k.startswith(f"tensors.{name}/") for k in kept) for name in (DRIFT, CLIENT_CONTROL))
            for k in kept:
                torch.testing.assert_close(kept[k], want_kept[k], **FLOAT64)
        arrays, _ = strategy.aggregate_train(server_round, batched)  # w^{t+1}, and c for the next round
        messages = list(strategy.configure_train(server_round + 1, arrays, ConfigRecord({"attempt": 0}), grid))
    assert (min(scales) < 1.0) if clip else not scales


def test_ditto_on_the_batched_engine_trains_two_stacked_models_and_lambda_pulls_v_k_to_w_t(monkeypatch) -> None:
    """`describe_engine` says Ditto stacks; a round trains two stacked models (the global updates, the
    personal models) and no client alone; each kept v_k is not its upload, and `ditto-distance` is
    its distance to the w^t received: at lambda 50 (plain SGD, lr lambda 0.5: a contraction) a
    fraction of what it is at lambda 0."""
    from fedskew.batched.executor import describe_engine

    assert "ditto trains each round's clients as one stacked model" in describe_engine(
        {**app_defaults(), "method": "ditto"}
    )
    chunks = chunk_sizes_seen(monkeypatch)
    distances = {}
    for lam in (0.0, 50.0):
        grid, messages = first_round("ditto", **SHORT, momentum=0.0, **{"ditto-lambda": lam})
        replies = list(grid.send_and_receive(messages))
        assert chunks == [len(messages)] * 2
        chunks.clear()
        w = messages[0].content["arrays"].to_torch_state_dict()
        distances[lam] = []
        for msg, reply in zip(messages, replies, strict=True):
            kept = state_arrays(grid.contexts[msg.metadata.dst_node_id].state)
            v = {k: kept[f"tensors.{PERSONAL}/{k}"] for k in w}
            upload = uploads(reply)
            assert max(float((v[k].float() - upload[k]).abs().max()) for k in upload) > 1e-5
            distance = sum(float((v[k] - w[k].double()).pow(2).sum()) for k in w) ** 0.5
            assert reply.content["metrics"]["ditto-distance"] == pytest.approx(distance, rel=1e-6)
            distances[lam].append(distance)
    assert all(d > 0 for d in distances[50.0])
    assert all(a < 0.5 * b for a, b in zip(distances[50.0], distances[0.0], strict=True)), distances


def test_a_configuration_that_is_not_stacked_trains_per_client_with_its_own_trainer() -> None:
    grid, messages = first_round("feddyn", **{"grad-clip": 1.0})
    for got, want in zip(grid.send_and_receive(messages), per_client(grid, messages), strict=True):
        a, b = uploads(got), uploads(want)
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_client_that_fails_gets_flower_s_error_reply_and_the_others_train() -> None:
    grid, messages = first_round("fedavg")
    bad = RecordDict({"arrays": messages[1].content["arrays"], "config": ConfigRecord({"server-round": 0})})
    messages[1] = Message(bad, dst_node_id=messages[1].metadata.dst_node_id, message_type=MessageType.TRAIN)
    replies = list(grid.send_and_receive(messages))
    assert [r.has_error() for r in replies] == [False, True, False, False]
    assert "fedskew.records.Rejected" in replies[1].error.reason and "server-round" in replies[1].error.reason
    assert replies[1].metadata.reply_to_message_id == messages[1].metadata.message_id


# ---------------------------------------------------------------------------------------- whole runs
RUN = {**ROUND, "num-server-rounds": 2, "local-epochs": 1, "checkpoint-every": 1, "num-partitions": NODES}


def batched_run(out: Path, name: str, **overrides: Any) -> Path:
    run_batched({**app_defaults(), **RUN, **overrides, "out-dir": str(out), "run-name": name}, NODES, quiet=True)
    return out / name


def test_a_batched_run_writes_the_flower_path_s_records_deterministically(tmp_path: Path) -> None:
    """Two batched runs: the same metrics.jsonl; against the per-client in-process grid (the
    Flower path's code): the same records and replies, accuracies within float noise."""
    first, second = (batched_run(tmp_path, name) for name in ("b1", "b2"))
    assert (first / "metrics.jsonl").read_text() == (second / "metrics.jsonl").read_text()
    run_in_process({**RUN, "out-dir": str(tmp_path), "run-name": "ref"}, NODES)
    rows, ref = read_metrics(first), read_metrics(tmp_path / "ref")
    assert [r.keys() for r in rows] == [r.keys() for r in ref]
    for r, s in zip(rows, ref, strict=True):
        assert r["replies"] == s["replies"] and not r.get("failures")
        assert r["global-accuracy"] == pytest.approx(s["global-accuracy"], abs=2e-3)
        # the server's per-class diagnostics, from the same sampled clients and global model
        assert r["partitions"] == s["partitions"] and r["class-holders"] == s["class-holders"]
        assert r["global-per-class-accuracy"] == pytest.approx(s["global-per-class-accuracy"], abs=5e-3)
    names = {p.name for p in first.iterdir()}
    assert {"metrics.jsonl", "summary.json", "checkpoint.pt", "model.pt", "partition.json"} <= names


def test_fedskew_run_engine_batched_says_which_path_the_method_takes(tmp_path: Path, capsys) -> None:
    from fedskew.cli import main

    config = f'num-server-rounds=1 model="mlp" fraction-train=0.1 out-dir="{tmp_path}" run-name="r"'
    assert main(["run", "--engine", "batched", "-n", "20", "--run-config", config]) == 0
    out = capsys.readouterr().out
    assert "batched engine in one process on cpu" in out and "fedavg trains each round's clients as one stacked" in out
    assert (tmp_path / "r" / "summary.json").is_file()
    config += ' method="feddyn" grad-clip=1.0 run-name="m"'
    assert main(["run", "--engine", "batched", "-n", "20", "--run-config", config]) == 0
    assert "feddyn trains its clients one by one" in capsys.readouterr().out


FLOWER_FLAGS = [["--actors", "2"], ["--ray-address", "127.0.0.1:6379"], ["--federation-config", "x=1"]]


@pytest.mark.parametrize("flag", FLOWER_FLAGS)
def test_fedskew_run_engine_batched_refuses_the_flower_path_s_settings(tmp_path: Path, capsys, flag) -> None:
    from fedskew.cli import main

    config = f'num-server-rounds=1 model="mlp" out-dir="{tmp_path}" run-name="r"'
    assert main(["run", "--engine", "batched", "-n", "20", *flag, "--run-config", config]) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]} is not allowed with engine='batched'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_suite_runs_batched_cells_here_and_a_superlink_only_for_the_others(tmp_path: Path, monkeypatch) -> None:
    from fedskew.run import experiments
    from fedskew.run.experiments import load_suite, run_suite

    text = f"""
name: b
num-supernodes: 20
seeds: [0]
out-dir: {tmp_path}
base: {{num-server-rounds: 1, model: mlp, fraction-train: 0.1, engine: batched}}
methods:
  fedavg: {{}}
  fedrs: {{method: fedrs, engine: flower}}
partitions:
  c2: {{}}
"""
    (tmp_path / "suite.yaml").write_text(text)
    links: list[str] = []
    flower: list[str] = []

    def link(app_dir: Path, head: Any, cluster: Any = None) -> Any:
        links.append("started")
        return contextlib.nullcontext("link")

    def simulation(app_dir: Path, overrides: dict[str, Any], n: int, **kwargs: Any) -> dict[str, Any]:
        assert kwargs["link"] == "link"
        flower.append(overrides["run-name"])
        return {}

    monkeypatch.setattr(experiments, "simulation_link", link)
    monkeypatch.setattr(experiments, "run_simulation", simulation)
    suite = load_suite(tmp_path / "suite.yaml", app_defaults())
    run_suite(suite, ROOT)
    assert links == ["started"] and flower == ["c2--fedrs--s0"]
    assert (suite.folder / "c2--fedavg--s0" / "summary.json").is_file()  # the batched cell, run here
    run_suite(load_suite(tmp_path / "suite.yaml", app_defaults()), ROOT, cells=[suite.cells[0]])  # done: skipped
    assert links == ["started"]  # no Flower cell to run: no SuperLink


# ---------------------------------------------------------------------------------------- many runs
def test_runs_trained_together_write_what_each_writes_alone(tmp_path: Path) -> None:
    """Three runs in one process (`fedskew.batched.many`): two FedAvg runs of other seeds and splits,
    whose clients train as one stacked model, and a FedDyn run with a clip (per client); each writes the
    metrics.jsonl it writes alone on the batched engine (`assert_float64_runs_match`). In float64:
    a stack of other clients sums in another order, and MKL's kernels round with the buffers'
    alignment, which the other runs change (FedDyn's gradient norm was 1 ulp apart on an AVX2 EPYC,
    equal under MKL_CBWR=COMPATIBLE); float32 would show both in the last digits."""
    from fedskew.batched.executor import StackedTrainer
    from fedskew.batched.many import ManyRuns

    runs = {
        "a": {"method": "fedavg", "seed": 0},
        "b": {"method": "fedavg", "seed": 1, "partition": "classes-per-client"},
        "c": {"method": "feddyn", "seed": 2, "grad-clip": 1.0},
    }
    configs = [
        {**app_defaults(), **RUN, **over, "compute-dtype": "float64", "out-dir": str(tmp_path), "run-name": name}
        for name, over in runs.items()
    ]
    for cfg in configs:
        run_batched({**cfg, "run-name": f"{cfg['run-name']}-alone"}, NODES, quiet=True)
    engine = ManyRuns(configs, [NODES] * len(configs), StackedTrainer(torch.device("cpu")))
    stacked: list[int] = []
    train = engine.trainer.train
    engine.trainer.train = lambda clients: stacked.append(len(clients)) or train(clients)  # type: ignore[method-assign]
    assert engine.run() == [None, None, None]
    assert [n for n in stacked if n] == [8, 8]  # the FedAvg runs' 4 + 4 clients a round; FedDyn's per client
    for name in runs:
        assert_float64_runs_match(tmp_path / name, tmp_path / f"{name}-alone", RUN["num-server-rounds"])


@pytest.mark.parametrize("method", ["fednova", "scaffold"])
def test_a_classifier_bias_is_sent_trained_and_uploaded(method: str) -> None:
    """`classifier-bias`: the server's initial arrays hold `classifier.bias`, every client's upload
    moves it, and SCAFFOLD's control variate (sent down) has its entry as for every other parameter."""
    grid, messages = first_round(method, **SHORT, **{"classifier-bias": True})
    start = messages[0].content["arrays"].to_torch_state_dict()
    assert tuple(start["classifier.bias"].shape) == (10,)
    if method == "scaffold":
        assert set(messages[0].content["control"].to_torch_state_dict()) == set(start)
    for reply in per_client(grid, messages):
        moved = uploads(reply)["classifier.bias"] - start["classifier.bias"]
        assert float(moved.abs().max()) > 1e-3
