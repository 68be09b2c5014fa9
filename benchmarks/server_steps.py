"""Benchmark: each server-side step's time against the number of replies per round N.

Steps, each the strategy's own method on N replies:
- FedAvg aggregation `FedAvgStrategy.aggregate_arrays` (weighted average of the uploaded arrays),
  LeNet and the larger MLP; and the whole `aggregate_train` (reply screening + aggregation + metrics);
- FedMR prototype aggregation `FedMRStrategy.aggregate_extras`;
- MuPFL ACMU `MuPFLStrategy.aggregate_arrays` (updates, silhouette-chosen k-means, cluster update,
  weighted average) and PKCF `MuPFLStrategy.aggregate_extras` (class-gradient mean, feature synthesis).

The replies are realistic: one real reply per method comes from the real ClientApp (round 1 on real
Fashion-MNIST), and N copies are made with client-specific content: the model update of client i is
one of three cluster directions plus noise, its class counts / prototypes / class gradients are
rotated by i classes, its BAVD map is jittered. Prints, per step and N, the median seconds over
`--repeats` (interleaved over N), t(N) / t(N_min) and the cost per client.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/server_steps.py [--clients 5,10,20,50,100] [--quick]

ACMU's SVD (`clustering.low_rank`) runs on numpy's BLAS, which by default uses every core; on a shared
2-core machine that made ACMU several times slower and very noisy, hence one BLAS thread above.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _common import TimedGrid, config, in_process_setup, median, private_cache, run_config
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedskew.methods.fedmr import FEDMR_PROTOTYPES as PROTO_RECORD
from fedskew.methods.mupfl import MUPFL_GRADS as GRADS
from fedskew.methods.mupfl import MUPFL_MAPS as MAPS
from fedskew.registry import get_method
from fedskew.strategies.base import arrays_to_numpy
from fedskew.strategies.fedavg import FedAvgStrategy

Template = tuple[dict[str, Any], ArrayRecord, RecordDict]  # (run config, global arrays, real reply content)


def real_reply(method: str, model: str) -> Template:
    """One real round-1 reply of `method` (partition 0 of 20) and the arrays it was trained from."""
    rc = run_config(method=method, model=model, **{"fraction-train": 1.0})
    strategy = get_method(method).strategy_class()(config(**rc))
    grid = TimedGrid(20, rc, visible=1)
    arrays = strategy.initial_arrays()
    (reply,) = grid.send_and_receive(list(strategy.configure_train(1, arrays, ConfigRecord(), grid)))
    return rc, arrays, reply.content


def client_reply(content: RecordDict, base: dict[str, np.ndarray], i: int, rng: np.random.Generator) -> RecordDict:
    """Client i's reply made from a real one: its own update, partition id and (rotated) classes."""
    out: dict[str, Any] = {}
    direction = np.random.default_rng(i % 3)  # three clusters of clients
    for key, rec in content.items():
        if key == "arrays":
            arrays = {}
            for name, value in base.items():
                if value.dtype.kind == "f":
                    step = direction.standard_normal(value.shape) + 0.5 * rng.standard_normal(value.shape)
                    value = (value + 0.01 * step).astype(value.dtype)
                arrays[name] = torch.from_numpy(np.array(value, order="C"))
            out[key] = ArrayRecord(arrays)
        elif key == "metrics":
            out[key] = MetricRecord({**rec, "partition-id": i, "num-examples": int(rec["num-examples"]) + i})
        elif key == PROTO_RECORD:
            out[key] = ArrayRecord({k: torch.from_numpy(np.roll(v.numpy(), i, axis=0)) for k, v in rec.items()})
        elif key == GRADS:
            c = len(base["classifier.weight"])
            out[key] = ArrayRecord({str((int(k) + i) % c): v for k, v in rec.items()})
        elif key == MAPS:
            m = rec["map"].numpy()
            out[key] = ArrayRecord({"map": torch.from_numpy((m * (1 + 0.1 * rng.random(m.shape))).astype(m.dtype))})
        else:
            out[key] = rec
    return RecordDict(out)


def replies_and_strategy(tpl: Template, n: int, seed: int) -> tuple[FedAvgStrategy, list[Message]]:
    """A fresh strategy of the template's method that sent round 2 to n nodes, and their replies."""
    rc, arrays, content = tpl
    strategy = get_method(rc["method"]).strategy_class()(config(**rc))
    base = arrays_to_numpy(arrays)
    strategy.sent_arrays = arrays
    strategy.num_partitions = 0  # as nodes with their own data: num-examples bounded by the training set's size
    strategy.node_partitions = {i + 1: i for i in range(n)}
    if hasattr(strategy, "bases"):  # MuPFL: every client started from the global model
        strategy.bases = dict.fromkeys(range(n), base)
    rng = np.random.default_rng(seed)
    replies = []
    for i in range(n):
        request = Message(RecordDict(), dst_node_id=i + 1, message_type="train")
        replies.append(Message(client_reply(content, base, i, rng), reply_to=request))
    return strategy, replies


def acmu(s: Any, replies: list[Message]) -> Any:
    return s.aggregate_arrays(2, replies)


def pkcf(s: Any, replies: list[Message]) -> Any:
    return s.aggregate_extras(2, replies)


# step name -> (method, model, timed call, untimed call that must run first)
STEPS: dict[str, tuple[str, str, Callable, Callable | None]] = {
    "fedavg aggregate_arrays lenet": ("fedavg", "lenet", lambda s, r: s.aggregate_arrays(2, r), None),
    "fedavg aggregate_arrays mlp": ("fedavg", "mlp", lambda s, r: s.aggregate_arrays(2, r), None),
    "fedavg aggregate_train mlp": ("fedavg", "mlp", lambda s, r: s.aggregate_train(2, r), None),
    "fedmr prototypes (aggregate_extras)": ("fedmr", "lenet", lambda s, r: s.aggregate_extras(2, r), None),
    "mupfl ACMU (aggregate_arrays)": ("mupfl", "lenet", acmu, None),
    "mupfl PKCF (aggregate_extras)": ("mupfl", "lenet", pkcf, acmu),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="5,10,20,50,100", help="replies per round N, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny: N in 3,6 and 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.repeats = "3,6", 1
    ns = sorted(int(n) for n in args.clients.split(","))
    in_process_setup()
    torch.set_num_threads(1)  # as the server runs PKCF (torch-threads = 1)
    with private_cache():
        templates = {(m, model): real_reply(m, model) for m, model, _, _ in STEPS.values()}
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        for n in ns:
            for name, (method, model, timed, before) in STEPS.items():
                strategy, replies = replies_and_strategy(templates[(method, model)], n, seed=rep)
                if before is not None:
                    before(strategy, replies)
                t0 = time.perf_counter()
                timed(strategy, replies)
                times.setdefault((name, n), []).append(time.perf_counter() - t0)
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset (all cores)")
    print(f"server steps, median of {args.repeats} (torch threads 1, OPENBLAS_NUM_THREADS {blas})")
    print(f"  {'step':<36} {'N':>4} {'seconds':>9} {'t(N)/t(' + str(ns[0]) + ')':>10} {'ms/client':>10}")
    for name in STEPS:
        first = median(times[(name, ns[0])])
        for n in ns:
            t = median(times[(name, n)])
            print(f"  {name:<36} {n:>4} {t:9.4f} {t / first:10.2f} {1000 * t / n:10.3f}")


if __name__ == "__main__":
    main()
