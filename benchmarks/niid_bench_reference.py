"""niid_bench's own FedAvg and FedNova, transcribed, run on this machine outside Flower: what their
code gives on their #C = 2 Fashion-MNIST split, beside their README's numbers and fedskew's.

Transcribed from `adap/flower`, baselines/niid_bench (Apache-2.0) at fdef7afb: `models.py`
(`CNNMnist`, `train_fedavg`, `train_fednova` with `_train_one_epoch[_fednova]`, `test`),
`strategy.py` (`FedNovaStrategy.aggregate_fit_custom`, `aggregate_fednova`) and Flower's FedAvg
`aggregate` (the mean weighted by examples). Their protocol: 10 clients, all every round, 50 rounds,
10 local epochs, batch 64 shuffled, SGD lr 0.01 momentum 0.9 weight decay 1e-5 (a fresh optimiser
every round), ToTensor's [0, 1] pixels, the best of 51 central evaluations (the initial model's too).

What is not theirs: the split comes from fedskew's `label-quantity` at their seed 42, which is theirs
index for index (tests/test_partitions.py); the images from fedskew's reader; the initial model and
the batch order are seeded by `--seed` (theirs are not seeded); clients train one after another in
one process (theirs in Ray actors, each on a fresh copy of the sent model, as here).

    python benchmarks/niid_bench_reference.py --method fednova --seed 0      # about 35 min, one core
    python benchmarks/niid_bench_reference.py --summary                      # best per run, mean +- std

Each run writes outputs/niid-bench-reference/<method>-s<seed>.json (resumable every 10 rounds);
`--export` writes the runs' best accuracies to results/peers/niid-bench-reference.yaml.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.optim import SGD
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedskew.config import validate  # noqa: E402
from fedskew.data import load_arrays  # noqa: E402
from fedskew.data.clients import client_indices  # noqa: E402
from fedskew.files import atomic_write, write_text  # noqa: E402
from fedskew.reports.resultfile import seed_stat  # noqa: E402

OUT = ROOT / "outputs" / "niid-bench-reference"
EXPORT = ROOT / "results" / "peers" / "niid-bench-reference.yaml"
SPLIT = {"partition": "classes-per-client", "classes-per-client": 2, "classes-per-client-mode": "label-quantity"}
SPLIT |= {"partition-seed": 42, "local-test-fraction": 0.0, "num-partitions": 10}
EPOCHS, BATCH, LR, MOMENTUM, WEIGHT_DECAY = 10, 64, 0.01, 0.9, 1e-5
CHECKPOINT_EVERY = 10  # rounds; a resumed run ends as the uninterrupted one (the batch order's generators saved)


class CNNMnist(nn.Module):
    """niid_bench's `CNNMnist(input_dim=256, hidden_dims=[120, 84], num_classes=10)`."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(256, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 4 * 4)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def local_train(net: nn.Module, loader: DataLoader, fednova: bool) -> tuple[list[np.ndarray], int, float]:
    """`train_fedavg` / `train_fednova`: (the upload, examples, a_i). FedAvg uploads the trained
    parameters; FedNova g_i = (x - y_i) / a_i with a_i = (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)."""
    optimizer = SGD(net.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    net.train()
    prev = [p.detach().clone() for p in net.parameters()]
    steps = 0
    for _ in range(EPOCHS):
        for data, target in loader:
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(net(data), target).backward()
            optimizer.step()
            steps += 1
    n = len(loader.dataset)
    if not fednova:
        return [v.cpu().numpy() for v in net.state_dict().values()], n, 0.0
    a_i = (steps - (MOMENTUM * (1 - MOMENTUM**steps) / (1 - MOMENTUM))) / (1 - MOMENTUM)
    return [((p0 - p.detach()) / a_i).numpy() for p0, p in zip(prev, net.parameters(), strict=True)], n, a_i


def aggregate(server: list[np.ndarray], results: list[tuple[list[np.ndarray], int, float]], fednova: bool):
    """Flower's FedAvg `aggregate`, or `aggregate_fit_custom`: x - tau_eff sum_i p_i g_i."""
    total = sum(n for _, n, _ in results)
    if not fednova:
        return [sum(w[k] * n for w, n, _ in results) / total for k in range(len(server))]
    c_fact = sum(a_i * n / total for _, n, a_i in results)
    update = [sum(w[k] * (c_fact * n / total) for w, n, _ in results) for k in range(len(server))]
    return [s - u for s, u in zip(server, update, strict=True)]


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        return float((net(x).argmax(1) == y).float().mean())


def load(params: list[np.ndarray]) -> CNNMnist:
    net = CNNMnist()
    net.load_state_dict(OrderedDict((k, torch.Tensor(v)) for k, v in zip(net.state_dict(), params, strict=True)))
    return net


def run(method: str, seed: int, rounds: int, out: Path) -> dict:
    torch.set_num_threads(1)
    fednova = method == "fednova"
    cfg = validate({"dataset": "fashion-mnist", **SPLIT})
    x, y, xt, yt = load_arrays(cfg)
    to01 = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32) / 255.0)  # noqa: E731  ToTensor
    test_x, test_y = to01(xt), torch.from_numpy(yt.astype(np.int64))
    gens = [torch.Generator().manual_seed(seed * 1000 + k) for k in range(10)]
    loaders = [
        DataLoader(
            TensorDataset(to01(x[tr]), torch.from_numpy(y[tr].astype(np.int64))), BATCH, shuffle=True, generator=g
        )
        for (tr, _), g in zip(client_indices(cfg, 10), gens, strict=True)
    ]
    ckpt = out.with_suffix(".ckpt")
    if ckpt.exists():  # tensors, floats and generator states only: weights_only refuses anything else
        state = torch.load(ckpt, weights_only=True)
        params, acc = [t.numpy() for t in state["params"]], list(state["accuracy"])
        for g, s in zip(gens, state["generators"], strict=True):
            g.set_state(s)
    else:
        torch.manual_seed(seed)
        params = [v.numpy() for v in CNNMnist().state_dict().values()]
        acc = [accuracy(load(params), test_x, test_y)]
    while len(acc) <= rounds:
        results = [local_train(load(params), loader, fednova) for loader in loaders]
        params = aggregate(params, results, fednova)
        acc.append(accuracy(load(params), test_x, test_y))
        print(f"{method} seed {seed} round {len(acc) - 1}: {100 * acc[-1]:.2f}", flush=True)
        if (len(acc) - 1) % CHECKPOINT_EVERY == 0 and len(acc) <= rounds:
            buf = io.BytesIO()
            tensors = [torch.from_numpy(np.asarray(p)) for p in params]
            torch.save({"params": tensors, "accuracy": acc, "generators": [g.get_state() for g in gens]}, buf)
            atomic_write(ckpt, lambda f, data=buf: f.write(data.getvalue()))
    record = {"method": method, "seed": seed, "rounds": rounds, "accuracy": acc, "best": max(acc)}
    write_text(out, json.dumps(record))
    ckpt.unlink(missing_ok=True)
    return record


def runs() -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for path in sorted(OUT.glob("*.json")):
        record = json.loads(path.read_text())
        found.setdefault(record["method"], []).append(record)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=("fedavg", "fednova"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--summary", action="store_true", help="print each method's best accuracy over its runs")
    ap.add_argument("--export", action="store_true", help=f"write the runs' best accuracies to {EXPORT}")
    args = ap.parse_args(argv)
    if args.method:
        OUT.mkdir(parents=True, exist_ok=True)
        suffix = "" if args.rounds == 50 else f"-r{args.rounds}"
        run(args.method, args.seed, args.rounds, OUT / f"{args.method}-s{args.seed}{suffix}.json")
    found = {m: [r for r in rs if r["rounds"] == 50] for m, rs in runs().items()}
    if args.summary or args.export:
        for method, rs in found.items():
            stat = seed_stat([100 * r["best"] for r in rs])  # as the peers' table computes it
            spread = f" +- {stat.std:.2f}" if len(rs) > 1 else ""
            print(f"{method}: best {stat.mean:.2f}{spread} over seeds {[r['seed'] for r in rs]}")
    if args.export:
        table = {m: {r["seed"]: round(100 * r["best"], 2) for r in rs} for m, rs in found.items() if rs}
        header = "# niid_bench's own FedAvg and FedNova code on their #C = 2 split, run here: each seed's best\n"
        header += "# central accuracy (%) over 51 evaluations; written by benchmarks/niid_bench_reference.py --export\n"
        body = {"format": 1, "setting": "c2", "best": table}
        write_text(EXPORT, header + yaml.safe_dump(body, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
