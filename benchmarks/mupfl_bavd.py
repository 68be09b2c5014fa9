"""Diagnostic (not a timing): what MuPFL's BAVD does to a client's own model under the paper's
Table II protocol (`suites/paper-mupfl.yaml`, IF 10, Dirichlet 0.5, 50 clients, 10 local epochs,
batch 64, lr 0.01, the paper's CNN).

For every `--step`-th client, models trained from the same initialisation on the same batches:
plain SGD; SGD with BAVD (the mask of the running activation map, Eq. 5-6, as `MuPFLTrainer` applies
it); that BAVD model evaluated with its final masks still applied (is the loss of accuracy the
mismatch between masked training and unmasked evaluation?); and, with `--readings`, the other
readings of Eq. 5-6 the spec lists (`../shared/methods/mupfl.md` 2.1, A1): the literal sign of psi,
inverted-dropout rescaling of the kept activations (`mupfl-bavd-rescale`), and the top-K mask of
section 3.6 (K = 50 % or 90 % of each channel's positions; the paper never gives K). Prints each
client's accuracy on its local test split, the fraction of activations the final masks keep, and
the means.

`--start model.pt` starts every model from a run's global model (e.g. FedAvg's final one on this
split, `outputs/suites/paper-mupfl/if10-a05--fedavg--s0/model.pt`) instead of a random
initialisation: the situation of a federated round, where the client's locally trained model is
its personalized model.

    .venv/bin/python benchmarks/mupfl_bavd.py [--step 5] [--epochs 10] [--readings] [--start model.pt] [--quick]
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
from fedskew.launcher import app_defaults
from fedskew.losses.mupfl import BAVD, attach_bavd, bavd_mask, loss_change
from fedskew.models import build_model
from fedskew.training import cross_entropy_loss, evaluate, sgd, train_epochs


class TopK(BAVD):
    """BAVD with the top-K mask section 3.6 suggests: the top `top` fraction of each channel's
    positions of the map (instead of those at or above the normalised map's mean)."""

    def __init__(self, top: float, rescale: bool = False) -> None:
        super().__init__(rescale)
        self.top = top

    def mask(self) -> torch.Tensor:
        flat = self.map.detach().float().reshape(self.map.shape[0], -1)
        k = max(1, math.ceil(self.top * flat.shape[1]))
        keep = torch.zeros_like(flat).scatter_(1, flat.topk(k, dim=1).indices, 1.0)
        return (keep * (flat.shape[1] / k) if self.rescale else keep).reshape(self.map.shape)


READINGS: dict[str, dict] = {  # name -> psi sign and the layer's arguments (BAVD, or TopK with "top")
    "bavd, literal psi sign": {"sign": "paper"},
    "bavd, rescaled (mupfl-bavd-rescale)": {"rescale": True},
    "bavd, top-K 50 %": {"top": 0.5},
    "bavd, top-K 90 %": {"top": 0.9},
    "bavd, top-K 90 %, rescaled": {"top": 0.9, "rescale": True},
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
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--readings", action="store_true", help="also the other readings of Eq. 5-6")
    ap.add_argument("--start", help="a global model's state dict (a run's model.pt) to start from")
    ap.add_argument("--quick", action="store_true", help="2 clients, 1 epoch, every reading")
    args = ap.parse_args()
    step, epochs = (25, 1) if args.quick else (args.step, args.epochs)
    torch.set_num_threads(1)
    suite = yaml.safe_load((ROOT / "suites" / "paper-mupfl.yaml").read_text())
    cfg = validate({**app_defaults(ROOT), **suite["base"], **suite["partitions"]["if10-a05"], "seed": 0})
    cpu = torch.device("cpu")
    start = torch.load(args.start, map_location=cpu, weights_only=True) if args.start else None
    rows = []
    for p in range(0, suite["num-supernodes"], step):
        d = load_client_data(cfg, p, suite["num-supernodes"])
        row: dict[str, float] = {}
        for variant in ("plain", "bavd", *(READINGS if args.readings or args.quick else ())):
            torch.manual_seed(100 + p)  # the same initial model for all
            model = build_model(cfg["model"], cfg["dataset"])
            if start is not None:
                model.load_state_dict(start)
            reading = dict(READINGS.get(variant, {}))
            sign = reading.pop("sign", "improvement")
            make = functools.partial(TopK if "top" in reading else BAVD, **reading)
            layers = [] if variant == "plain" else attach_bavd(model, make)
            per_epoch = max(1, math.ceil(len(d.y_train) / cfg["batch-size"]))
            loss_fn = bavd_loss(layers, per_epoch, sign) if layers else cross_entropy_loss
            batches = torch.Generator().manual_seed(p)  # the same batches for all
            train_epochs(model, d.x_train, d.y_train, loss_fn, sgd(model.parameters(), cfg), epochs, 64, batches, cpu)
            row[variant] = evaluate(model, d.x_test, d.y_test, 1024, cpu)[1]
            if variant == "bavd":
                model.train()  # BAVD masks apply in train mode (the CNN has no dropout or batch norm)
                with torch.no_grad():
                    masked = model(d.x_test).argmax(1)
                row["bavd, masks kept at evaluation"] = float((masked == d.y_test).float().mean())
                row["activations kept"] = float(np.mean([float(bavd_mask(layer.map).mean()) for layer in layers]))
        rows.append(row)
        print(f"client {p:2d} ({len(d.y_train)} train): " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
    means = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    print("mean over clients: " + ", ".join(f"{k} {v:.4f}" for k, v in means.items()))
    print(f"ratio bavd / plain accuracy {means['bavd'] / means['plain']:.3f}")
    for k in means:
        if k not in ("plain", "activations kept"):
            diffs = [r[k] - r["plain"] for r in rows]
            wins, losses = sum(d > 1e-9 for d in diffs), sum(d < -1e-9 for d in diffs)
            gain = 100 * (means[k] - means["plain"])
            print(f"{k}: {gain:+.2f} points over plain, better on {wins}, worse on {losses}")


if __name__ == "__main__":
    main()
