"""Benchmark: the batched engine against the per-client paths: clients, SGD steps and rounds a second.

`speed`: each scenario's run config is run by each engine, every run its own process, one after the
other (on the same device: the ratios compare within one call):

- `batched`: the batched engine (`fedskew.batched.grid.run_batched`), one torch thread a core;
  `batched:1`: with one torch thread (as one Flower actor has);
- `per-client`: today's per-client path in one process (`tests.harness.run_in_process`: the real
  ServerApp and ClientApp, one ClientApp call per message, no Ray): one client after the other;
- `flower:N`, `flower:default`: a real `flwr run` simulation with N Ray actors (default: as
  `fedskew run` picks them); skipped, and said, where Ray is not installed.

Over rounds 2..R (round 1 loads and caches the data): clients a second and SGD steps a second in
the clients' part of a round (`clients-seconds`, from sending to the last reply; the steps from the
sampled partitions' sizes), rounds a second (whole rounds), the busy fraction of all cores and,
where `nvidia-smi` exists, the GPU's (its mean utilization, sampled every 0.5 s), and each engine's
ratio to `per-client`. Scenarios:

- `lenet-10`, `lenet-50`: FedAvg, LeNet on Fashion-MNIST, 100 clients (2 classes each), 10 or 50 a round;
- `pfl`: the shape of pfl-research's CIFAR-10 benchmark on Fashion-MNIST: 1,200 clients of 50
  images (iid; FMNIST's 60,000 / 50), 50 a round, 1 local epoch at batch 10 (5 steps), its 2-conv
  CNN (`pfl-cnn`), no local test split (no client evaluation).

`sync` (a GPU only): the stacked step loop (`fedskew.batched.stacked.train_stacked`: LeNet, 50
clients of unequal sizes, crop and flip, momentum, weight decay and a clip) under
`torch.cuda.set_sync_debug_mode("error")`, which raises at any operation that makes the host wait
for the GPU; prints whether the loop ran without one.

`step`: where a stacked step's time goes on this device. One SGD step (LeNet, batch 64, momentum,
the leaderboard's 5 clients a round, `--clients`) of K clients as one stacked model
(`train_stacked`) against K steps of the per-client loop (`fedskew.training.train_steps`), one
thread, interleaved, best of `--repeats`; then the ops that take the most of each (torch.profiler's
self CPU milliseconds a step), which names what bounds the stacked step.

`accuracy`: FedAvg, LeNet, 20 clients (2 classes each), 10 a round, `--rounds` rounds, the seeds of
`--seeds` on `batched` and `per-client`: each run's final and last-5 global accuracy, and whether
the engines differ by less than the seeds' spread; the same of the last-5 personalized accuracy (the
sampled clients' personalized models on their local test splits: Ditto's v_k) where runs record one.

    .venv/bin/python benchmarks/batched.py speed [--scenarios lenet-10,lenet-50,pfl] [--engines batched,per-client]
        [--rounds 4] [--device auto] [--quick]
    .venv/bin/python benchmarks/batched.py accuracy [--seeds 0,1,2] [--rounds 20]
    python3 benchmarks/batched.py sync --device cuda
    .venv/bin/python benchmarks/batched.py step [--clients 5] [--repeats 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, CpuSampler, GpuSampler, config, in_process_setup, measured_simulation, median

from fedskew.data.clients import client_class_counts
from fedskew.server_app.results import read_jsonl, round_statistics
from fedskew.training import steps_per_round

SCENARIOS: dict[str, tuple[dict[str, Any], int]] = {  # run config, clients
    "lenet-10": ({"model": "lenet", "fraction-train": 0.1}, 100),
    "lenet-50": ({"model": "lenet", "fraction-train": 0.5}, 100),
    "pfl": (
        {
            "model": "pfl-cnn",
            "partition": "iid",
            "local-test-fraction": 0.0,
            "batch-size": 10,
            "local-epochs": 1,
            "fraction-train": 50 / 1200,
        },
        1200,
    ),
    "quick": ({"model": "mlp", "fraction-train": 0.2}, 20),  # --quick
}


def run_one(spec: str) -> None:
    """Child process: one run of `engine` with the config, in-process."""
    in_process_setup()
    job = json.loads(spec)
    if job["engine"].startswith("batched"):
        from fedskew.batched.grid import run_batched
        from fedskew.run.launcher import app_defaults

        threads = 1 if job["engine"] == "batched:1" else None
        run_batched({**app_defaults(ROOT), **job["cfg"]}, job["nodes"], quiet=True, threads=threads)
    else:
        from tests.harness import run_in_process

        run_in_process(job["cfg"], job["nodes"])


def in_child(engine: str, cfg: dict[str, Any], nodes: int) -> None:
    spec = json.dumps({"engine": engine, "cfg": cfg, "nodes": nodes})
    res = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{engine} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")


def measured(engine: str, cfg: dict[str, Any], nodes: int) -> dict[str, Any]:
    """One run of `engine`: its timings and metrics rows, the CPU's and GPU's busy fractions over rounds 2..R."""
    if engine.startswith("flower:"):
        actors = engine.split(":")[1]
        r = measured_simulation(cfg, nodes, None if actors == "default" else int(actors))
        return {"timings": r["timings"], "metrics": r["metrics"], "busy": r["busy"], "gpu": r["gpu busy"]}
    from fedskew.resources import available_cores

    cpu, gpu = CpuSampler(), GpuSampler()
    for sampler in (cpu, gpu):
        sampler.start()
    with tempfile.TemporaryDirectory() as out:
        try:
            in_child(engine, {**cfg, "out-dir": out, "run-name": "bench"}, nodes)
        finally:
            for sampler in (cpu, gpu):
                sampler.done.set()
                sampler.join()
        run = Path(out) / "bench"
        timings, metrics = read_jsonl(run / "timings.jsonl"), read_jsonl(run / "metrics.jsonl")
    steady = timings[1:]
    start, end = steady[0]["started-at"], steady[-1]["started-at"] + steady[-1]["seconds"]
    return {
        "timings": timings,
        "metrics": metrics,
        "busy": cpu.busy_fraction(start, end, available_cores()),
        "gpu": gpu.busy(start, end),
    }


def speed(args: argparse.Namespace) -> None:
    if args.quick:
        args.scenarios, args.engines, args.rounds = "quick", "batched,per-client", 2
    ray = importlib.util.find_spec("ray") is not None
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for name in args.scenarios.split(","):
        over, nodes = SCENARIOS[name]
        cfg = {
            "method": "fedavg",
            **over,
            "num-server-rounds": args.rounds,
            "device": args.device,
            "checkpoint-every": 0,
        }
        print(f"{name}: {nodes} clients, {json.dumps(over)}, rounds 2..{args.rounds}, device {args.device}", flush=True)
        full = config(**cfg, **{"num-partitions": nodes})
        sizes = client_class_counts(full, nodes)[0].sum(1)  # training examples of each partition
        rows = {}
        for engine in args.engines.split(","):
            if engine.startswith("flower:") and not ray:
                print(f"  {engine:<16} not measured: Ray is not installed here", flush=True)
                continue
            t0 = time.perf_counter()
            r = measured(engine, cfg, nodes)
            steady = list(zip(r["timings"][1:], r["metrics"][1:], strict=True))
            clients = median(t["clients-seconds"] for t, _ in steady)
            per_round = statistics.mean(m["replies"] for _, m in steady)
            epochs, batch = full["local-epochs"], full["batch-size"]
            steps = statistics.mean(
                sum(steps_per_round(int(sizes[p]), epochs, batch) for p in m["partitions"]) for _, m in steady
            )
            rows[engine] = {
                "clients/s": per_round / clients,
                "steps/s": steps / clients,
                "rounds/s": 1 / median(t["seconds"] for t, _ in steady),
                "busy": r["busy"],
                "gpu": r["gpu"],
                "wall": time.perf_counter() - t0,
            }
        base = rows.get("per-client")
        for engine, row in rows.items():
            ratio = f"{row['clients/s'] / base['clients/s']:6.2f}" if base else "     -"
            gpu = "-" if row["gpu"] is None else f"{row['gpu']:.0%}"
            print(
                f"  {engine:<16} clients/s {row['clients/s']:8.2f}  steps/s {row['steps/s']:9.1f}  "
                f"rounds/s {row['rounds/s']:7.3f}  ratio to per-client {ratio}  CPU busy {row['busy']:4.0%}  "
                f"GPU busy {gpu}  (run {row['wall']:.0f} s)",
                flush=True,
            )
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def accuracy(args: argparse.Namespace) -> None:
    """Each of `--methods` over whole runs, batched against per-client, seed by seed."""
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for method in args.methods.split(","):
        method_accuracy(method, args)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def method_accuracy(method: str, args: argparse.Namespace) -> None:
    cfg = {"method": method, "model": "lenet", "fraction-train": 0.5, "num-server-rounds": args.rounds}
    cfg |= {"checkpoint-every": 0, "device": args.device, "compute-dtype": args.dtype}
    engines = ("batched", "per-client")
    finals: dict[str, dict[str, list[float]]] = {kind: {e: [] for e in engines} for kind in ACCURACIES}
    for seed in map(int, args.seeds.split(",")):
        curves = {}
        for engine in engines:
            with tempfile.TemporaryDirectory() as out:
                in_child(engine, {**cfg, "seed": seed, "out-dir": out, "run-name": "acc"}, 20)
                rows = read_jsonl(Path(out) / "acc" / "metrics.jsonl")
            stats = round_statistics(rows, 5)
            curves[engine] = [100 * r["global-accuracy"] for r in rows if r.get("global-accuracy") is not None]
            line = f"  {method} seed {seed} {engine:<10} final {100 * stats['final_global_accuracy']:6.2f} %"
            for kind, key in ACCURACIES.items():
                if stats[key] is not None:
                    finals[kind][engine].append(stats[key])
                    line += f"  last 5 rounds {kind} {100 * stats[key]:6.2f} %"
            print(line, flush=True)
        # the diagnostic: the round from which the two engines' global models part (a float rounding
        # that a chaotic method amplifies parts them late and slowly; a defect, from round 1)
        gap = [abs(a - b) for a, b in zip(curves["batched"], curves["per-client"], strict=True)]
        first = next((r + 1 for r, g in enumerate(gap) if g > 0.5), None)
        print(f"  {method} seed {seed}: per-round gap {' '.join(f'{g:.2f}' for g in gap)}; first > 0.5: {first}")
    for kind, by_engine in finals.items():
        if by_engine["per-client"] and len(by_engine["batched"]) == len(by_engine["per-client"]):
            print(engines_compared(f"{method}: last-5 {kind} accuracy", by_engine), flush=True)


# what `accuracy` compares: the last-5 mean of each accuracy a run records (`round_statistics`)
ACCURACIES = {"global": "last5_global_accuracy", "personalized": "last5_personalized_accuracy"}


def engines_compared(what: str, finals: dict[str, list[float]]) -> str:
    """One line: each engine's mean ± spread (population std over the seeds) of `finals` (fractions,
    seed by seed), the same-seed gaps and whether the largest is within the per-client seeds' spread."""
    spread = statistics.pstdev(finals["per-client"])
    gaps = [abs(a - b) for a, b in zip(finals["batched"], finals["per-client"], strict=True)]
    means = ", ".join(
        f"{e} {100 * statistics.mean(v):.2f} ± {100 * statistics.pstdev(v):.2f} %" for e, v in finals.items()
    )
    return (
        f"{what}: {means}; same-seed gaps {' '.join(f'{100 * g:.2f}' for g in gaps)} points, the largest "
        f"{'within' if max(gaps) <= spread else 'beyond'} the seeds' spread"
    )


def sync(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.func import stack_module_state

    from fedskew.batched.stacked import (
        GroupSettings,
        SGDSettings,
        Tensors,
        client_steps,
        stack_schedules,
        train_stacked,
    )
    from fedskew.data.augment import Augmentation
    from fedskew.models import build_model
    from fedskew.training import functional_forward, pick_device, weighted_sum

    device = pick_device(args.device)
    sizes = [40 + 37 * k for k in range(50)]  # 40 to 1,853 examples: 1 to 29 steps at batch 64
    models = [build_model("lenet", "fashion-mnist").to(device) for _ in sizes]
    params, buffers = ({k: t.detach() for k, t in part.items()} for part in stack_module_state(models))
    augment = Augmentation(2, True, (0.0,))
    generators = [torch.Generator().manual_seed(k) for k in range(len(sizes))]
    steps = [client_steps(n, steps_per_round(n, 1, 64), 64, g, augment) for n, g in zip(sizes, generators, strict=True)]
    order = sorted(range(len(sizes)), key=lambda k: -len(steps[k]))
    offsets = [sum(sizes[j] for j in order[:i]) for i in range(len(order))]
    schedule = stack_schedules([steps[k] for k in order], offsets, 64).to(device)
    x = torch.randn(sum(sizes), 1, 28, 28, device=device)
    y = torch.randint(0, 10, (sum(sizes),), device=device)
    template = build_model("lenet", "fashion-mnist").to("meta")

    def loss(p: Tensors, b: Tensors, xb: torch.Tensor, yb: torch.Tensor, w: torch.Tensor, e: Tensors) -> torch.Tensor:
        return weighted_sum(F.cross_entropy(functional_forward(template, p, b, xb), yb, reduction="none"), w)

    settings = SGDSettings((GroupSettings(tuple(params), 0.01, 0.9, 1e-4),), (10.0,))
    if device.type != "cuda":  # the loop runs; the check needs a GPU
        totals = train_stacked(loss, params, buffers, {}, x, y, schedule, settings, augment)
        print(
            f"sync: {len(sizes)} clients, {len(schedule.active)} steps on {device}: ran, not checked (no GPU); "
            f"finite losses {bool(torch.isfinite(totals).all())}"
        )
        return
    train_stacked(loss, params, buffers, {}, x, y, schedule.first(2), settings, augment)  # warm-up
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        totals = train_stacked(loss, params, buffers, {}, x, y, schedule, settings, augment)
        ok = "no host synchronisation in the step loop"
    except RuntimeError as e:
        totals, ok = torch.full((1,), float("nan")), f"a host synchronisation in the step loop: {e}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(device)
    finite = bool(torch.isfinite(totals).all())
    print(f"sync: {len(sizes)} clients, {len(schedule.active)} steps on {device}: {ok}; finite losses {finite}")


def step(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch.func import stack_module_state
    from torch.profiler import ProfilerActivity, profile

    from fedskew.batched.stacked import GroupSettings, SGDSettings, Tensors, stack_schedules, train_stacked
    from fedskew.models import build_model
    from fedskew.training import functional_forward, pick_device, sgd, train_steps, weighted_sum

    torch.set_num_threads(1)
    device = pick_device(args.device)
    k, batch, steps = args.clients, 64, 4
    models = [build_model("lenet", "fashion-mnist").to(device) for _ in range(k)]
    x = torch.randn(k * batch * steps, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (k * batch * steps,), device=device)
    cfg = {"lr": 0.01, "momentum": 0.9, "weight-decay": 1e-4, "grad-clip": 0.0}
    template = build_model("lenet", "fashion-mnist").to("meta")

    def loss(p: Tensors, b: Tensors, xb: torch.Tensor, yb: torch.Tensor, w: torch.Tensor, e: Tensors) -> torch.Tensor:
        return weighted_sum(F.cross_entropy(functional_forward(template, p, b, xb), yb, reduction="none"), w)

    rows = [[(torch.arange(batch) + j * batch, None) for j in range(steps)] for _ in range(k)]
    schedule = stack_schedules(rows, [i * batch * steps for i in range(k)], batch).to(device)
    settings = SGDSettings((GroupSettings(tuple(n for n, _ in models[0].named_parameters()), 0.01, 0.9, 1e-4),), ())

    def stacked() -> None:
        params, buffers = ({n: t.detach() for n, t in part.items()} for part in stack_module_state(models))
        train_stacked(loss, params, buffers, {}, x, y, schedule, settings)

    def per_client() -> None:
        for i, model in enumerate(models):
            part = slice(i * batch * steps, (i + 1) * batch * steps)
            generator = torch.Generator().manual_seed(i)
            train_steps(
                model,
                x[part],
                y[part],
                lambda m, a, b: F.cross_entropy(m(a), b),
                sgd(model.parameters(), cfg),
                steps,
                batch,
                generator,
                device,
                None,
            )

    times: dict[str, list[float]] = {"stacked": [], "per-client": []}
    for _ in range(2):  # warm-up
        stacked(), per_client()
    for _ in range(args.repeats):
        for name, fn in (("stacked", stacked), ("per-client", per_client)):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / steps)
    best = {name: min(t) for name, t in times.items()}
    print(f"step: {k} clients, LeNet, batch {batch}, 1 thread on {device}, best of {args.repeats}")
    for name, t in best.items():
        print(
            f"  {name:10s} {1000 * t:7.2f} ms a step of the {k} clients, "
            f"ratio to per-client {t / best['per-client']:.2f}"
        )
    for name, fn in (("stacked", stacked), ("per-client", per_client)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        top = ", ".join(f"{e.key} {e.self_cpu_time_total / 1000 / steps:.1f}" for e in events[:6])
        print(f"  {name}: self CPU ms a step by op: {top}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="?", choices=("speed", "accuracy", "sync", "step"), default="speed")
    ap.add_argument("--scenarios", default="lenet-10,lenet-50,pfl", help=f"of {', '.join(SCENARIOS)}")
    ap.add_argument("--engines", default="batched,per-client", help="batched, batched:1, per-client, flower:N|default")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="auto", help="run-config device: auto (cuda when present), cpu, cuda")
    ap.add_argument("--seeds", default="0,1,2", help="accuracy: the seeds")
    ap.add_argument("--methods", default="fedavg", help="accuracy: the methods (A,B), each on both engines")
    ap.add_argument("--dtype", default="float32", help="accuracy: the clients' compute-dtype (float32, float64)")
    ap.add_argument("--quick", action="store_true", help="tiny: an MLP, 20 clients, 4 a round, 2 rounds")
    ap.add_argument("--clients", type=int, default=5, help="step: the clients stacked")
    ap.add_argument("--repeats", type=int, default=20, help="step: timed repeats of each")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return run_one(args.one)
    {"speed": speed, "accuracy": accuracy, "sync": sync, "step": step}[args.what](args)


if __name__ == "__main__":
    main()
