"""Diagnostic (not a timing): what MuPFL's BAVD does to a client's own model under the paper's
Table II protocol (`suites/paper-mupfl.yaml`, IF 10, Dirichlet 0.5, 50 clients, 10 local epochs,
batch 64, lr 0.01, the paper's CNN).

For every `--step`-th client, models trained from the same initialisation on the same batches:
plain SGD; SGD with BAVD (the batch-map mask of Eq. 5-6, `MuPFLTrainer`'s default); that BAVD model
evaluated with its final masks still applied (is the loss of accuracy the mismatch between masked
training and unmasked evaluation?); with `--readings`, the other readings of the batch map (the
literal sign of psi, inverted-dropout rescaling `mupfl-bavd-rescale`, the top-K of the map's
positions, K = 50 % or 90 %); with `--per-sample`, the per-sample masks (`mupfl-bavd-mask`:
"sample-mean", "sample-topk" at K = 50 %, "map-threshold") at each site (`mupfl-bavd-site`: after
both convolutions, after the second only, on the flattened features before the classifier). Prints
each client's accuracy on its local test split, then per reading the mean accuracy, the points over
plain SGD, and the mean fraction of positions and of activation mass its masks zeroed in training.

`--start model.pt` starts every model from a run's global model (e.g. FedAvg's final one on this
split, `outputs/suites/paper-mupfl/if10-a05--fedavg--s0/model.pt`) instead of a random
initialisation: the situation of a federated round, where the client's locally trained model is
its personalized model.

    .venv/bin/python benchmarks/mupfl_bavd.py [--step 5] [--epochs 10] [--readings] [--per-sample]
        [--clients 0,25] [--start model.pt] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import math

import numpy as np
import torch
import yaml
from _common import ROOT

from fedskew.config import validate
from fedskew.data.clients import load_client_data
from fedskew.losses.mupfl import BAVD, attach_bavd, loss_change
from fedskew.models import build_model
from fedskew.run.launcher import app_defaults
from fedskew.training import cross_entropy_loss, evaluate, sgd, train_epochs


class TopK(BAVD):
    """BAVD with a top-K mask of the batch map: the top `top` fraction of each channel's positions of
    the map (instead of those at or above the normalised map's mean)."""

    def mask(self) -> torch.Tensor:
        flat = self.map.detach().float().reshape(self.map.shape[0], -1)
        k = max(1, math.ceil(self.top * flat.shape[1]))
        keep = torch.zeros_like(flat).scatter_(1, flat.topk(k, dim=1).indices, 1.0)
        return (keep * (flat.shape[1] / k) if self.rescale else keep).reshape(self.map.shape)


# name -> the psi sign ("sign"), the layer class ("cls"), its site ("site") and its arguments
READINGS: dict[str, dict] = {
    "bavd, literal psi sign": {"sign": "paper"},
    "bavd, rescaled (mupfl-bavd-rescale)": {"rescale": True},
    "bavd, top-K 50 %": {"cls": TopK, "top": 0.5},
    "bavd, top-K 90 %": {"cls": TopK, "top": 0.9},
    "bavd, top-K 90 %, rescaled": {"cls": TopK, "top": 0.9, "rescale": True},
}
PER_SAMPLE: dict[str, dict] = {
    f"{reading}{' 50 %' if reading == 'sample-topk' else ''} @ {site}": {"reading": reading, "site": site}
    for reading in ("sample-mean", "sample-topk", "map-threshold")
    for site in ("convs", "last-conv", "features")
}


def bavd_loss(layers: list[BAVD], per_epoch: int, sign: str = "improvement"):
    """Cross-entropy that folds each batch into the BAVD maps (lambda restarts every epoch)."""
    state = {"it": 0, "prev": None}

    def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy_loss(model, x, y)
        lam, value = state["it"] % per_epoch, float(loss.detach())
        psi = loss_change(None if lam == 0 else state["prev"], value, sign)
        for layer in layers:
            layer.update(lam, psi)
        state["it"], state["prev"] = state["it"] + 1, value
        return loss

    return loss_fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", type=int, default=5, help="every step-th of the 50 clients")
    ap.add_argument("--clients", help="these clients instead, e.g. 0,25")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--readings", action="store_true", help="also the other readings of the batch map")
    ap.add_argument("--per-sample", action="store_true", help="also the per-sample masks at each site")
    ap.add_argument("--start", help="a global model's state dict (a run's model.pt) to start from")
    ap.add_argument("--quick", action="store_true", help="2 clients, 1 epoch, every reading")
    args = ap.parse_args()
    step, epochs = (25, 1) if args.quick else (args.step, args.epochs)
    torch.set_num_threads(1)
    suite = yaml.safe_load((ROOT / "suites" / "paper-mupfl.yaml").read_text())
    cfg = validate({**app_defaults(ROOT), **suite["base"], **suite["partitions"]["if10-a05"], "seed": 0})
    cpu = torch.device("cpu")
    start = torch.load(args.start, map_location=cpu, weights_only=True) if args.start else None
    variants = {"plain": None, "bavd": {}}
    if args.readings or args.quick:
        variants.update(READINGS)
    if args.per_sample or args.quick:
        variants.update(PER_SAMPLE)
    clients = [int(c) for c in args.clients.split(",")] if args.clients else range(0, suite["num-supernodes"], step)
    rows, dropped = [], {}
    for p in clients:
        d = load_client_data(cfg, p, suite["num-supernodes"])
        row: dict[str, float] = {}
        for variant, spec in variants.items():
            torch.manual_seed(100 + p)  # the same initial model for all
            model = build_model(cfg["model"], cfg["dataset"])
            if start is not None:
                model.load_state_dict(start)
            layers: list[BAVD] = []
            if spec is not None:
                args_ = dict(spec)
                sign, cls, site = args_.pop("sign", "improvement"), args_.pop("cls", BAVD), args_.pop("site", "convs")
                layers = attach_bavd(model, functools.partial(cls, **args_), site)
            per_epoch = max(1, math.ceil(len(d.y_train) / cfg["batch-size"]))
            loss_fn = bavd_loss(layers, per_epoch, sign) if layers else cross_entropy_loss
            batches = torch.Generator().manual_seed(p)  # the same batches for all
            train_epochs(model, d.x_train, d.y_train, loss_fn, sgd(model.parameters(), cfg), epochs, 64, batches, cpu)
            row[variant] = evaluate(model, d.x_test, d.y_test, 1024, cpu)[1]
            fractions = [f for f in (layer.dropped() for layer in layers) if f is not None]
            if fractions:
                dropped.setdefault(variant, []).append(np.mean(fractions, axis=0))
            if variant == "bavd":
                model.train()  # BAVD masks apply in train mode (the CNN has no dropout or batch norm)
                with torch.no_grad():
                    masked = model(d.x_test).argmax(1)
                row["bavd, masks kept at evaluation"] = float((masked == d.y_test).float().mean())
        rows.append(row)
        print(f"client {p:2d} ({len(d.y_train)} train): " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
    means = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    print(f"mean over clients: plain {means['plain']:.4f}")
    print(f"ratio bavd / plain accuracy {means['bavd'] / means['plain']:.3f}")
    print("reading: accuracy, points over plain (clients better / worse), what its masks zeroed in training")
    for k in means:
        if k == "plain":
            continue
        diffs = [r[k] - r["plain"] for r in rows]
        wins, losses = sum(x > 1e-9 for x in diffs), sum(x < -1e-9 for x in diffs)
        gain = 100 * (means[k] - means["plain"])
        zeroed = ""
        if k in dropped:
            positions, mass = np.mean(dropped[k], axis=0)
            zeroed = (
                f", zeroed positions {positions:.3f} / activation mass {mass:.3f} (activations kept {1 - mass:.3f})"
            )
        print(f"{k}: {means[k]:.4f}, {gain:+.2f} points over plain, better on {wins}, worse on {losses}{zeroed}")


if __name__ == "__main__":
    main()
