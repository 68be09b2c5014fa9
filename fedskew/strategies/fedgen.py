"""FedGen server (Zhu, Hong & Zhou, ICML'21): FedAvg of the models plus a conditional generator of
features trained against the ensemble of the clients' classifiers. Client side:
`fedskew/client_app/fedgen.py`; maths, the authors' code read (zhuangdizhu/FedGen at commit
dd5807c5625404e99035d97e2ef8c712c2e007a6) and every deviation: `fedskew/losses/fedgen.py`.

Round t on the server:
1. broadcast the model and, once it has been trained (t >= 2), the generator G (`fedgen-generator`:
   its weights and BatchNorm statistics; the clients run it in eval mode);
2. screen the replies; each carries the model and the client's label counts (`fedgen-counts`,
   int64 >= 0, one per class, summing to the reply's `num-examples`, equal to its partition's where
   the server knows the partitions); the classifiers are the uploads after `bound_updates`;
3. train G for `fedgen-iterations` Adam steps against the uploaded classifiers W_k weighted per
   label by the counts (the code trains it on the selected users' trained models, then averages);
   the lr is `fedgen-lr` x 0.98^(rounds trained so far);
4. the global model is the sample-weighted average (FedAvg, the code's `aggregate_parameters`).

Server state (`state_dict`, in every checkpoint so that a resumed run equals an uninterrupted one):
G's weights and BatchNorm statistics, Adam's moments and step counts, and the number of rounds G
has been trained (its lr decay). Its randomness (labels, noise) comes from a generator seeded by
(seed, round).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, RecordDict

from fedskew.losses.fedgen import GENERATOR_LR_DECAY, build_generator, train_generator
from fedskew.methods.fedgen import FEDGEN_COUNTS, FEDGEN_GENERATOR
from fedskew.records import Rejected
from fedskew.strategies.base import BaseStrategy
from fedskew.training import torch_threads

GENERATOR, ADAM = "generator.", "adam."


class FedGenStrategy(BaseStrategy):
    """FedAvg plus a server-trained generator G(z | y) of classifier inputs."""

    def __init__(self, cfg: dict[str, Any], device: torch.device | None = None) -> None:
        super().__init__(cfg, device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg["seed"])
            self.generator = build_generator(cfg, self.dims.num_classes, self.dims.feature_dim).to(self.device)
        self.optimizer = torch.optim.Adam(
            self.generator.parameters(), lr=cfg["fedgen-lr"], weight_decay=cfg["fedgen-weight-decay"]
        )
        self.rounds = 0  # rounds G has been trained

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """G's state dict, Adam's per-parameter state and the rounds trained, all as tensors."""
        state = {GENERATOR + k: v.detach().cpu().clone() for k, v in self.generator.state_dict().items()}
        names = [name for name, _ in self.generator.named_parameters()]
        for i, per_param in self.optimizer.state_dict()["state"].items():
            state.update({f"{ADAM}{names[i]}.{k}": v.detach().cpu().clone() for k, v in per_param.items()})
        state["rounds"] = torch.tensor(self.rounds)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.load_state_dict(
            {k.removeprefix(GENERATOR): v for k, v in state.items() if k.startswith(GENERATOR)}
        )
        names = [name for name, _ in self.generator.named_parameters()]
        adam = {
            i: {k.removeprefix(f"{ADAM}{n}."): v for k, v in state.items() if k.startswith(f"{ADAM}{n}.")}
            for i, n in enumerate(names)
        }
        saved = self.optimizer.state_dict()
        saved["state"] = {i: s for i, s in adam.items() if s}
        self.optimizer.load_state_dict(saved)
        self.rounds = int(state["rounds"])

    # ------------------------------------------------------------------ downlink
    def broadcast(self, server_round: int) -> dict[str, Any]:
        if not self.rounds:
            return {}
        return {FEDGEN_GENERATOR: ArrayRecord({k: v.detach().cpu() for k, v in self.generator.state_dict().items()})}

    # ------------------------------------------------------------------ uplink
    def check_reply(self, content: RecordDict, partition: int) -> None:
        """The base's rules, and label counts that add up to the reply's `num-examples` and, where the
        server knows the partitions, equal the partition's training class counts (the weights G is
        trained under are the server's numbers: a client cannot claim one class to steer G)."""
        super().check_reply(content, partition)
        counts, n = content[FEDGEN_COUNTS]["counts"].numpy(), content["metrics"]["num-examples"]
        total = counts.sum(dtype=np.float64)  # int64 would wrap around for hostile counts
        if total != n:
            raise Rejected(f"label counts sum to {total:.0f}, not to num-examples {n}")
        expected = self.partition_class_counts(partition)
        if expected is not None and not np.array_equal(counts, expected):
            raise Rejected(f"label counts {counts.tolist()} differ from partition {partition}'s {expected.tolist()}")

    def aggregate_extras(self, server_round: int, replies: list[Message]) -> dict[str, Any]:
        """Train G on this round's classifiers and label counts; the generator's and clients' losses."""
        classifiers = torch.stack(
            [torch.from_numpy(m.content["arrays"]["classifier.weight"].numpy().copy()) for m in replies]
        )
        counts = torch.stack([torch.from_numpy(m.content[FEDGEN_COUNTS]["counts"].numpy().copy()) for m in replies])
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg["fedgen-lr"] * GENERATOR_LR_DECAY**self.rounds
        seed = np.random.SeedSequence([self.cfg["seed"], server_round, 7]).generate_state(1)[0]
        with torch_threads(self.device, self.cfg["torch-threads"]):
            stats = train_generator(
                self.generator,
                self.optimizer,
                classifiers.to(self.device),
                counts,
                self.cfg["fedgen-iterations"],
                self.cfg["batch-size"],
                self.cfg["fedgen-eta"],
                torch.Generator().manual_seed(int(seed)),
            )
        self.rounds += 1
        return {f"generator-{k}": v for k, v in stats.items()}
