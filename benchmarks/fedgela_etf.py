"""Diagnostic (not a timing): does FedGELA's mechanism act under its paper's protocol
(`suites/paper-fedgela.yaml`, default cell `part-a01`: 50 clients, 10 a round, 100 rounds, 10
local epochs, Dirichlet 0.1, LeNet)? Reads the suite's finished runs (their final global models,
`model.pt`, and configs) for each seed:

1. Global accuracy (GA) side: the geometry of each method's global model on the 10,000 test images,
   `class_geometry` (`fedskew/losses/fedgela.py`): within- / between-class variance of the features
   the classifier sees (FedGELA: its head's output, L2-normalised; FedAvg, FedRS: the penultimate
   layer), the cosines between centred class means (a simplex ETF: all -1/(C-1) = -0.111), each class
   mean against its classifier vector (FedGELA: its fixed ETF column), and the worst class's accuracy.
   For FedGELA (and FedGE, its run without local adaptation) the worst class c is traced to its main
   owner k (the client with most of c's training images): phi_k,c, the mean cos(h, m_c) of c's test
   images against their largest cos(h, m_j), j != c, and how k's adapted ETF classifies them. A large
   phi_k,c lets the owner's loss vanish for features barely aligned with m_c, which the global
   model's plain ETF then assigns to other classes.
2. Personalized accuracy (PA) side, the local adaptation: for every `--step`-th client, 10 local
   epochs from the final global model, as a round trains (same batches for all): FedGELA against its
   phi-adapted ETF, evaluated on the client's test split with that adapted ETF (FedGELA's PA) and
   with the plain ETF; FedGELA trained against the plain ETF (`fedgela-adapt` false); and FedAvg-FT
   (FedAvg's global model, plain SGD).

    .venv/bin/python benchmarks/fedgela_etf.py [--runs outputs/suites/paper-fedgela] [--part part-a01]
        [--seeds 0 1 2] [--step 5] [--methods fedavg fedrs fedgela fedge] [--quick]

`--methods fedavg fedgela` reads a cell run without FedRS; `fedge` (the suite's FedGELA without
local adaptation) adds its global model's geometry and worst class. The PA side needs `fedavg` and
`fedgela`; without them (e.g. `--methods fedge`) only the GA side runs.

`--quick` (the test) uses freshly initialised models, 2 clients and 1 epoch.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch
import yaml
from _common import ROOT
from torch import nn

from fedskew.config import validate
from fedskew.data.clients import ClientData, client_class_counts, load_client_data, load_test_set
from fedskew.losses.fedgela import ETFNet, class_geometry, gela_logits, gela_model, local_phi
from fedskew.models import build_model
from fedskew.run.experiments import run_name
from fedskew.run.launcher import app_defaults
from fedskew.strategies.fedgela import FedGELAStrategy
from fedskew.training import clip_before_step, cross_entropy_loss, evaluate, sgd, train_epochs

CPU = torch.device("cpu")
METHODS = ("fedavg", "fedrs", "fedgela", "fedge")
DEFAULT_METHODS = ("fedavg", "fedrs", "fedgela")
ADAPTED = "FedGELA PA (trained and evaluated with the adapted ETF)"
PLAIN_EVAL = "the same model evaluated with the plain ETF"
UNADAPTED = "FedGELA trained and evaluated with the plain ETF (no adaptation)"
FT = "FedAvg-FT (FedAvg's global model, plain SGD)"


def run_config(suite: dict, runs: Path, part: str, method: str, seed: int, quick: bool) -> dict:
    """The run's validated config (its `config.json`), or the `suite`'s for `--quick`."""
    if quick:
        cell = {**suite["base"], **suite["partitions"][part], **suite["methods"][method]}
        cell.pop("num-supernodes", None)  # a suite key (the simulation's size), not a run-config key
        return validate({**app_defaults(ROOT), "method": method, **cell, "seed": seed})
    return validate(json.loads((runs / run_name(part, method, seed) / "config.json").read_text()))


def global_model(cfg: dict, runs: Path, part: str, name: str, quick: bool) -> torch.nn.Module:
    """The final global model of the run of suite method `name` (FedGELA: backbone + plain ETF)."""
    torch.manual_seed(cfg["seed"])
    if cfg["method"] == "fedgela":
        model = FedGELAStrategy(cfg, CPU).build_model()
    else:
        model = build_model(cfg["model"], cfg["dataset"])
    if not quick:
        path = runs / run_name(part, name, cfg["seed"]) / "model.pt"
        model.load_state_dict(torch.load(path, map_location=CPU, weights_only=True))
    return model.eval()


def embed(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the classifier sees and the predictions, batched: (features `[N, d]`, argmax `[N]`).
    FedGELA's features are L2-normalised (head "paper"), so h @ etf holds cos(h, m_c)."""
    with torch.no_grad():
        h = torch.cat([model.features(x[i : i + 2000]) for i in range(0, len(x), 2000)])
        pred = torch.cat([model(x[i : i + 2000]).argmax(1) for i in range(0, len(x), 2000)])
    if getattr(model, "normalize", False):
        h = torch.nn.functional.normalize(h, dim=1)
    return h, pred


def per_class_accuracy(pred: torch.Tensor, y: torch.Tensor) -> list[float]:
    return [float((pred[y == c] == c).float().mean()) for c in range(int(y.max()) + 1)]


def geometry(model: torch.nn.Module, h: torch.Tensor, pred: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """`class_geometry` of what the classifier sees (`embed`), plus accuracy and the worst class's accuracy."""
    w = model.etf.T if hasattr(model, "etf") else model.classifier.weight.detach()
    per_class = per_class_accuracy(pred, y)
    accuracy = float((pred == y).float().mean())
    return {"accuracy": accuracy, "worst class": min(per_class), **class_geometry(h, y, w, len(per_class))}


def worst_class(
    model: ETFNet, h: torch.Tensor, pred: torch.Tensor, y: torch.Tensor, counts: np.ndarray
) -> dict[str, float]:
    """The plain-ETF global model's worst class c and its main owner k (module doc, 1): with `h`,
    `pred` from `embed`, cos(h, m_c) of c's test images against max_{j != c} cos(h, m_j), and the
    accuracy of the owner's adapted logits s * phi_k,j * cos(h, m_j) on them."""
    per_class = per_class_accuracy(pred, y)
    c = int(np.argmin(per_class))
    k = int(counts[:, c].argmax())
    phi = local_phi(counts[k])
    cos = h @ model.etf
    mine = cos[y == c]
    others = mine.clone()
    others[:, c] = -2.0
    adapted = gela_logits(h[y == c], model.etf, model.scale, phi, model.mode, normalize=False).argmax(1)
    return {
        "class": c,
        "plain-ETF accuracy": per_class[c],
        "owner": k,
        "owner's share of its training images": float(counts[k, c] / max(counts[:, c].sum(), 1)),
        "phi_k,c": float(phi[c]),
        "cos(h, m_c)": float(mine[:, c].mean()),
        "max other cos(h, m_j)": float(others.max(1).values.mean()),
        "cos(h, m_y), all test images": float(cos[torch.arange(len(y)), y].mean()),
        "owner's adapted-ETF accuracy": float((adapted == c).float().mean()),
    }


def fine_tune(model: nn.Module, start: nn.Module, cfg: dict, data: ClientData, epochs: int, seed: int) -> nn.Module:
    """`model` from `start`'s weights after `epochs` local epochs as a round trains them (the
    method's optimiser and clipping, the same batches for every model of a client)."""
    model.load_state_dict(start.state_dict())
    opt = sgd(model.parameters(), cfg)
    if cfg["method"] == "fedgela":
        clip_before_step(opt, cfg["fedgela-clip"])
    batches = torch.Generator().manual_seed(seed)
    train_epochs(model, data.x_train, data.y_train, cross_entropy_loss, opt, epochs, cfg["batch-size"], batches, CPU)
    return model.eval()


def personalized(
    cfgs: dict[str, dict], starts: dict[str, nn.Module], num_clients: int, step: int, epochs: int
) -> dict[str, float]:
    """Mean accuracy on the clients' test splits of the four locally trained models (module doc),
    from the runs' configs and final global models (`cfgs`, `starts`: by method)."""
    gcfg, acfg, start_g, start_a = cfgs["fedgela"], cfgs["fedavg"], starts["fedgela"], starts["fedavg"]
    rows = []
    for p in range(0, num_clients, step):
        d = load_client_data(gcfg, p, num_clients)
        if len(d.y_test) == 0:
            continue
        batches = 1000 * gcfg["seed"] + p
        adapted = fine_tune(gela_model(gcfg, start_g.etf, local_phi(d.train_counts)), start_g, gcfg, d, epochs, batches)
        plain_eval = gela_model(gcfg, start_g.etf)
        plain_eval.load_state_dict(adapted.state_dict())
        models = {
            ADAPTED: adapted,
            PLAIN_EVAL: plain_eval.eval(),
            UNADAPTED: fine_tune(gela_model(gcfg, start_g.etf), start_g, gcfg, d, epochs, batches),
            FT: fine_tune(build_model(acfg["model"], acfg["dataset"]), start_a, acfg, d, epochs, batches),
        }
        rows.append({k: evaluate(m, d.x_test, d.y_test, 1024, CPU)[1] for k, m in models.items()})
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=str(ROOT / "outputs" / "suites" / "paper-fedgela"))
    ap.add_argument("--part", default="part-a01")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--step", type=int, default=5, help="every step-th client for the PA side")
    ap.add_argument("--quick", action="store_true", help="fresh models, 2 clients, 1 epoch, seed 0")
    ap.add_argument(
        "--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS), help="PA side: fedavg and fedgela"
    )
    args = ap.parse_args()
    methods = [m for m in METHODS if m in args.methods]
    pa_side = {"fedavg", "fedgela"} <= set(methods)
    if not pa_side:
        print(f"--methods {' '.join(methods)}: GA side only (the PA side compares fedavg and fedgela)", flush=True)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.ERROR)  # the strategy's note on fraction_evaluate
    runs, quick = Path(args.runs), args.quick
    seeds, step = ([0], 25) if quick else (args.seeds, args.step)
    geo: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    pa: list[dict[str, float]] = []
    suite = yaml.safe_load((ROOT / "suites" / "paper-fedgela.yaml").read_text())
    num_clients = int(suite["partitions"][args.part].get("num-supernodes", suite["num-supernodes"]))
    for seed in seeds:
        cfgs = {m: run_config(suite, runs, args.part, m, seed, quick) for m in methods}
        starts = {m: global_model(cfgs[m], runs, args.part, m, quick) for m in methods}
        x, y = load_test_set(cfgs[methods[0]])
        counts, _ = client_class_counts(cfgs[methods[0]], num_clients)  # same split for every method
        for m in methods:
            h, pred = embed(starts[m], x)
            geo[m].append(geometry(starts[m], h, pred, y))
            print(f"seed {seed} {m:8s} " + ", ".join(f"{k} {v:.4f}" for k, v in geo[m][-1].items()), flush=True)
            if m in ("fedgela", "fedge"):
                w = worst_class(starts[m], h, pred, y, counts)
                print(f"seed {seed} {m:8s} worst class: " + ", ".join(f"{k} {v:.4g}" for k, v in w.items()), flush=True)
        if pa_side:
            epochs = 1 if quick else cfgs["fedgela"]["local-epochs"]
            pa.append(personalized(cfgs, starts, num_clients, step, epochs))
            print(f"seed {seed} PA: " + ", ".join(f"{k} {v:.4f}" for k, v in pa[-1].items()), flush=True)
    print(f"\nglobal models, mean over seeds {seeds} (a simplex ETF: cos between class means -0.111):")
    for m in methods:
        print(f"  {m:8s} " + ", ".join(f"{k} {np.mean([g[k] for g in geo[m]]):.4f}" for k in geo[m][0]))
    if not pa_side:
        return
    print("personalized models (mean accuracy on the clients' test splits, mean over seeds):")
    means = {k: float(np.mean([r[k] for r in pa])) for k in pa[0]}
    for k, v in means.items():
        print(f"  {k}: {100 * v:.2f} %")
    adapted, plain, ft = (means[k] for k in (ADAPTED, PLAIN_EVAL, FT))
    print(f"ratio adapted / plain-ETF evaluation {adapted / plain:.3f}")
    print(f"ratio FedGELA PA / FedAvg-FT {adapted / ft:.3f}")


if __name__ == "__main__":
    main()
