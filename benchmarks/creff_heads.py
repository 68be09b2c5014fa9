"""Diagnostic (not a timing): does CReFF's re-trained classifier beat the classifier it replaces?

CReFF (`fedskew/strategies/creff.py`) evaluates theta^{t+1}'s backbone with W^{t+1}, a fresh
classifier re-trained on the federated features; the clients go on training theta^{t+1} with its own
sample-averaged classifier. For each run's last checkpoint this prints the central test accuracy and
balanced accuracy of the same backbone with each of the two classifiers, and the norms of their
class weights (a re-trained classifier whose rows differ much in norm favours the classes of the
large ones), and the mean norm of the real test features against the federated ones it was trained
on. The paper's claim (Shang et al., IJCAI'22, section 4) is that the re-trained one is the better
on long-tailed data.

    .venv/bin/python benchmarks/creff_heads.py outputs/suites/paper-mupfl/if10-a05--creff--s0 [...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from _common import ROOT, in_process_setup

from fedskew.config import validate
from fedskew.data.clients import load_test_set
from fedskew.diagnostics import balanced_accuracy, per_class_accuracy
from fedskew.losses.mupfl import feature_norm
from fedskew.models import build_model
from fedskew.run.launcher import app_defaults
from fedskew.training import confusion, extract_features


def head_scores(run: Path) -> dict[str, tuple[float, float, float, float]]:
    """{'averaged' | 're-trained': (accuracy %, balanced %, smallest and largest class-weight norm),
    'round': the checkpoint's, 'feature-norms': (mean norm of the test set's features, of the federated
    features S)}."""
    saved = json.loads((run / "config.json").read_text())
    defaults = app_defaults(ROOT)
    cfg = validate({**defaults, **{k: v for k, v in saved.items() if k in defaults}})
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True, map_location="cpu")  # tensors only, no code
    x, y = load_test_set(cfg)
    model = build_model(cfg["model"], cfg["dataset"])
    model.load_state_dict({k: torch.as_tensor(v) for k, v in ckpt["arrays"].items()})
    heads = {"averaged": model.classifier.weight.detach().clone(), "re-trained": ckpt["strategy"]["classifier"]}
    out = {}
    for name, weight in heads.items():
        with torch.no_grad():
            model.classifier.weight.copy_(torch.as_tensor(weight))
        _, cm = confusion(model, x, y, 1000, torch.device("cpu"))
        norms = torch.as_tensor(weight).norm(dim=1)
        out[name] = (
            100 * float(np.trace(cm) / cm.sum()),
            100 * float(balanced_accuracy(per_class_accuracy(cm))),
            float(norms.min()),
            float(norms.max()),
        )
    with torch.no_grad():
        real = extract_features(model, x, 1000, torch.device("cpu"))
    out["round"] = ckpt["round"]
    out["feature-norms"] = (feature_norm(real), feature_norm(ckpt["strategy"]["features"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="CReFF run folders (each with its checkpoint.pt)")
    args = ap.parse_args()
    in_process_setup()
    print(
        "| run | round | averaged head: acc / balanced (%) | re-trained head: acc / balanced (%) "
        "| class-weight norms, averaged | re-trained | feature norm: real / federated |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        s = head_scores(run)
        a, r = s["averaged"], s["re-trained"]
        print(
            f"| {run.name} | {s['round']} | {a[0]:.2f} / {a[1]:.2f} | {r[0]:.2f} / {r[1]:.2f} "
            f"| {a[2]:.2f}-{a[3]:.2f} | {r[2]:.2f}-{r[3]:.2f} "
            f"| {s['feature-norms'][0]:.2f} / {s['feature-norms'][1]:.2f} |"
        )


if __name__ == "__main__":
    main()
