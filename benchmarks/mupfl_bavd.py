"""Diagnostic (not a timing): what MuPFL's BAVD does to a client's own model under the paper's
Table II protocol (`suites/paper-mupfl.yaml`, IF 10, Dirichlet 0.5, 50 clients, 10 local epochs,
batch 64, lr 0.01, the paper's CNN).

For every `--step`-th client, three models trained from the same initialisation on the same batches:
plain SGD; SGD with BAVD (the mask of the running activation map, Eq. 5-6, as `MuPFLTrainer` applies
it); and the BAVD model evaluated with its final masks still applied (is the loss of accuracy the
mismatch between masked training and unmasked evaluation?). Prints each client's accuracy on its
local test split, the fraction of activations the final masks keep, and the means.

    .venv/bin/python benchmarks/mupfl_bavd.py [--step 5] [--epochs 10] [--quick]
"""

from __future__ import annotations

import argparse
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


def bavd_loss(layers: list[BAVD], per_epoch: int):
    """Cross-entropy that folds each batch into the BAVD maps (lambda restarts every epoch)."""
    state = {"it": 0, "prev": None}

    def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy_loss(model, x, y)
        lam, value = state["it"] % per_epoch, float(loss.detach())
        psi = loss_change(None if lam == 0 else state["prev"], value, "improvement")
        for layer in layers:
            layer.update(lam, psi)
        state["it"], state["prev"] = state["it"] + 1, value
        return loss

    return loss_fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", type=int, default=5, help="every step-th of the 50 clients")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="2 clients, 1 epoch")
    args = ap.parse_args()
    step, epochs = (25, 1) if args.quick else (args.step, args.epochs)
    torch.set_num_threads(1)
    suite = yaml.safe_load((ROOT / "suites" / "paper-mupfl.yaml").read_text())
    cfg = validate({**app_defaults(ROOT), **suite["base"], **suite["partitions"]["if10-a05"], "seed": 0})
    cpu = torch.device("cpu")
    rows = []
    for p in range(0, suite["num-supernodes"], step):
        d = load_client_data(cfg, p, suite["num-supernodes"])
        row: dict[str, float] = {}
        for variant in ("plain", "bavd"):
            torch.manual_seed(100 + p)  # the same initial model for both
            model = build_model(cfg["model"], cfg["dataset"])
            layers = attach_bavd(model) if variant == "bavd" else []
            per_epoch = max(1, math.ceil(len(d.y_train) / cfg["batch-size"]))
            loss_fn = bavd_loss(layers, per_epoch) if layers else cross_entropy_loss
            batches = torch.Generator().manual_seed(p)  # the same batches for both
            train_epochs(model, d.x_train, d.y_train, loss_fn, sgd(model.parameters(), cfg), epochs, 64, batches, cpu)
            row[variant] = evaluate(model, d.x_test, d.y_test, 1024, cpu)[1]
            if layers:
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


if __name__ == "__main__":
    main()
