"""Everything a run leaves in `<out-dir>/<run-name>/`.

- `config.json`     the validated run config
- `partition.txt/.json/.png`  class counts per client
- `metrics.jsonl`   one line per round (deterministic: no timings), appended and flushed each round
- `timings.jsonl`   seconds per round and per step, and each client's participation count (client state)
- `failures.jsonl`  every lost or dropped reply: round, node, partition, reason
- `summary.json`    method, rounds, wall time and, for global, client-global and personalized accuracy,
                    the final value, the best and the mean of the last 10 rounds (`round_statistics`)
- `model.pt`        the final global model's state dict
- `checkpoint.pt`   every `checkpoint-every` rounds: round, global arrays, strategy state (`resume=true`
                    continues from it; all server randomness is derived from (seed, round))
- `accuracy.png`    global and personalized accuracy per round
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null, numpy scalars plain numbers."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, obj: Any) -> None:
    """Write atomically (temp file then rename), so a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(_clean(row), sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a jsonl file (a torn last line is ignored)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


TRACKED = ("global-accuracy", "client-global-accuracy", "personalized-accuracy")
LAST_ROUNDS = 10


def round_statistics(rows: list[dict[str, Any]], last: int = LAST_ROUNDS) -> dict[str, float | None]:
    """Final value, best and mean of the last `last` rounds of each tracked accuracy in `rows`
    (`metrics.jsonl` lines): `final_<key>`, `best_<key>`, `last<last>_<key>` with `-` -> `_`, and
    for the global accuracy its std over those rounds (`last<last>_global_accuracy_round_std`).

    Label-skewed FL swings several points from round to round, so conclusions are drawn from the
    last-rounds mean; "final" is the last round's value (None when that round has none, e.g. no
    client had a local test split) and the mean runs over the rounds in (R - last, R] with a value.
    """
    final_round = max((int(r["round"]) for r in rows), default=0)
    out: dict[str, float | None] = {}
    for key in TRACKED:
        name = key.replace("-", "_")
        points = [(int(r["round"]), float(r[key])) for r in rows if _finite(r.get(key))]
        tail = [v for rnd, v in points if rnd > final_round - last]
        out[f"final_{name}"] = points[-1][1] if points and points[-1][0] == final_round else None
        out[f"best_{name}"] = max(v for _, v in points) if points else None
        out[f"last{last}_{name}"] = float(np.mean(tail)) if tail else None
        if key == "global-accuracy":  # the oscillation FedRS reports: std over those rounds
            out[f"last{last}_{name}_round_std"] = float(np.std(tail)) if tail else None
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class RunOutput:
    """The results folder of one run."""

    def __init__(self, cfg: dict[str, Any], run_id: int | str) -> None:
        name = cfg["run-name"] or f"{cfg['method']}-{cfg['dataset']}-{cfg['partition']}-s{cfg['seed']}-{run_id}"
        self.dir = Path(cfg["out-dir"]).expanduser().absolute() / name
        self.dir.mkdir(parents=True, exist_ok=True)
        if not cfg["resume"]:
            for stale in ("metrics.jsonl", "timings.jsonl", "failures.jsonl", "summary.json", "checkpoint.pt"):
                (self.dir / stale).unlink(missing_ok=True)
        write_json(self.dir / "config.json", {**cfg, "resume": False})

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write `checkpoint.pt` atomically (tensors and plain values only)."""
        tmp = self.dir / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.dir / "checkpoint.pt")

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The last checkpoint, with the per-round files cut back to its round; None if there is none."""
        path = self.dir / "checkpoint.pt"
        if not path.is_file():
            return None
        state = torch.load(path, weights_only=True)
        (self.dir / "summary.json").unlink(missing_ok=True)
        for name in ("metrics.jsonl", "timings.jsonl", "failures.jsonl"):
            rows = [row for row in read_jsonl(self.dir / name) if row["round"] <= state["round"]]
            tmp = self.dir / f"{name}.tmp"
            tmp.write_text("".join(json.dumps(_clean(row), sort_keys=True) + "\n" for row in rows))
            os.replace(tmp, self.dir / name)
        return state

    def log_round(self, metrics: dict[str, Any], timings: dict[str, Any], failures: list[dict[str, Any]] = ()) -> None:
        """Append the round's metrics, timings and lost replies (`failures.jsonl`)."""
        append_jsonl(self.dir / "metrics.jsonl", metrics)
        append_jsonl(self.dir / "timings.jsonl", timings)
        self.log_failures(metrics["round"], failures)

    def log_failures(self, server_round: int, failures: list[dict[str, Any]]) -> None:
        """Append lost replies (node, partition, reason, attempt) to `failures.jsonl`."""
        for f in failures:
            append_jsonl(self.dir / "failures.jsonl", {"round": server_round, **f})

    def finish(self, summary: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> None:
        torch.save({k: v.cpu() for k, v in state_dict.items()}, self.dir / "model.pt")
        plot_accuracy(read_jsonl(self.dir / "metrics.jsonl"), self.dir / "accuracy.png", summary.get("method", ""))
        write_json(self.dir / "summary.json", summary)


def plot_accuracy(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Global and personalized accuracy against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("global-accuracy", "global"), ("personalized-accuracy", "personalized")):
        pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
