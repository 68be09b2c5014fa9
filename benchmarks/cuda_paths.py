"""Benchmark: every method's whole round (real ServerApp and ClientApp, in-process) on each device.

For each method and model, one in-process run (`tests.harness.run_in_process`) per device in
`--devices`: `--clients` clients, each holding one of `--partitions` label-skewed partitions of
Fashion-MNIST, all of them every round, `--rounds` rounds, `--epochs` local epochs. Prints, per
run, the last round's global accuracy (and the personalized one where the method has it), the wall
seconds and, on CUDA, the peak GPU memory the run allocated (the method's tensors really lived on
the GPU); then, per method, the accuracy difference cuda - cpu (the same seeds: only float rounding
differs) and the ratio of wall times cpu / cuda. A run that fails prints its error; the script then
exits 1. Run on an H100 (see docs/benchmarks.md, "GPU").

    .venv/bin/python benchmarks/cuda_paths.py [--devices cpu,cuda] [--models lenet] [--methods all]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _common import in_process_setup

from fedskew.registry import METHODS
from fedskew.server_app.results import read_jsonl
from tests.harness import run_in_process


def one_run(method: str, model: str, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """One in-process run; its last metrics row, wall seconds and peak CUDA memory (MiB)."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        cfg = {
            "method": method,
            "model": model,
            "device": device,
            "num-server-rounds": args.rounds,
            "local-epochs": args.epochs,
            "fraction-train": 1.0,
            "checkpoint-every": 0,
            "out-dir": out,
            "run-name": "r",
        }
        t0 = time.perf_counter()
        run_in_process(cfg, args.clients, num_partitions=args.partitions)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        rows = read_jsonl(Path(out) / "r" / "metrics.jsonl")
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    return {"last": rows[-1], "wall": wall, "peak": peak}


def accuracy(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return "    -" if value is None else f"{100 * value:5.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="cpu,cuda", help="comma-separated: cpu, cuda, cuda:N")
    ap.add_argument("--models", default="lenet", help="comma-separated model names")
    ap.add_argument("--methods", default="all", help=f"comma-separated, or all: {', '.join(METHODS)}")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--partitions", type=int, default=20, help="the data split in this many (>= --clients)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny: cpu only, fedavg, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.devices, args.methods, args.rounds = "cpu", "fedavg", 1
    methods = list(METHODS) if args.methods == "all" else args.methods.split(",")
    devices, models = args.devices.split(","), args.models.split(",")
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        raise SystemExit("cuda_paths.py: a cuda device was asked for but torch sees no CUDA here")
    in_process_setup()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"torch {torch.__version__}, GPU: {gpu}, CPU threads {torch.get_num_threads()}", flush=True)
    print(
        f"{args.clients} clients (partitions 0..{args.clients - 1} of {args.partitions}), all of them every round, "
        f"{args.rounds} rounds, {args.epochs} local epoch(s)"
    )
    failed = 0
    for model in models:
        for method in methods:
            runs: dict[str, dict[str, Any]] = {}
            for device in devices:
                try:
                    runs[device] = r = one_run(method, model, device, args)
                except Exception:  # report and go on with the next run
                    failed += 1
                    print(f"  {method:8s} {model:9s} {device:7s} FAILED\n{traceback.format_exc()}", flush=True)
                    continue
                finite = all(math.isfinite(v) for v in r["last"].values() if isinstance(v, float))
                peak = "" if r["peak"] is None else f"  peak GPU memory {r['peak']:8.1f} MiB"
                print(
                    f"  {method:8s} {model:9s} {device:7s} global acc {accuracy(r['last'], 'global-accuracy')}  "
                    f"personalized {accuracy(r['last'], 'personalized-accuracy')}  wall {r['wall']:6.1f} s"
                    f"  finite {finite}{peak}",
                    flush=True,
                )
                failed += not finite
            if "cpu" in runs and len(runs) > 1:
                for device, r in runs.items():
                    if device == "cpu":
                        continue
                    pair = [x["last"].get("global-accuracy") for x in (r, runs["cpu"])]
                    diff = "    -" if None in pair else f"{100 * (pair[0] - pair[1]):+5.2f}"  # none: no global model
                    speed = runs["cpu"]["wall"] / r["wall"]
                    tag = f"{method:8s} {model:9s} {device}"
                    print(f"  {tag} - cpu global acc {diff}  ratio cpu / {device} wall {speed:5.2f}")
    print(f"runs failed: {failed}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
