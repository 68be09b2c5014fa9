"""Experiment trackers fed by the ServerApp: TensorBoard event files in the run folder and, when
asked for and installed, Weights & Biases.

TensorBoard (`tensorboard` run-config key, on by default): `torch.utils.tensorboard.SummaryWriter`
writes `events.out.tfevents.*` beside `metrics.jsonl`, so `tensorboard --logdir outputs` shows every
run side by side. Each round's scalars are the numbers of its `metrics.jsonl` line under the same
names (step = the round); a per-class list (`diagnostics.PER_CLASS`) becomes one scalar per class,
`<key>/<class>` (zero-padded, so that classes sort). TensorBoard keeps scalars as float32. At the
end the per-class heatmap (`per-class.png`) is added as the image `per-class-accuracy`, and at the
start the partition's skew (`partition/...`, step 0) and the run config (text). A resumed run
writes a new event file whose first event purges the steps from the resumed round on (TensorBoard's
`purge_step`), so the curves show each round once.

Weights & Biases (`wandb-project`, off by default): when the key names a project and `wandb` is
importable, the same scalars and the heatmap go to `wandb.init(project=..., dir=<run folder>)`
(its own settings, e.g. `WANDB_MODE=offline`, apply); when it is not installed the run says so
once and goes on without it. fedskew never requires it.

A tracker never costs a run: any error a tracker raises (`wandb.init` without an API key or a
terminal, a `log` or `finish` that fails, a TensorBoard writer on a full disk) is logged once, as a
warning naming the tracker and the error, and the run goes on without that tracker; the run's own
files (`metrics.jsonl`, `summary.json`) do not depend on it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedskew.diagnostics import is_per_class

log = logging.getLogger("flwr.fedskew")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a `metrics.jsonl` row as named scalars: plain numbers under their key, each
    per-class list entry under `<key>/<class>` (None and non-finite values are left out)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "round":
            continue
        if isinstance(value, list) and is_per_class(key):
            width = len(str(max(len(value) - 1, 0)))
            out.update({f"{key}/{c:0{width}d}": float(v) for c, v in enumerate(value) if _finite(v)})
        elif _finite(value):
            out[key] = float(value)
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Trackers:
    """The run's TensorBoard writer and W&B run (each None when off, or once it has failed)."""

    def __init__(self, cfg: dict[str, Any], run_dir: Path, first_round: int) -> None:
        self.tensorboard: Any = None
        self.wandb: Any = None
        if cfg["tensorboard"]:
            self.tensorboard = self._guard("tensorboard", lambda: _tensorboard_writer(cfg, run_dir, first_round))
        if cfg["wandb-project"]:
            try:
                import wandb
            except ImportError:
                log.warning("fedskew: wandb-project=%r, but wandb is not installed: not logged", cfg["wandb-project"])
            else:
                start = functools.partial(
                    wandb.init, project=cfg["wandb-project"], name=run_dir.name, dir=str(run_dir), config=cfg
                )
                self.wandb = self._guard("wandb", start)

    def _guard(self, tracker: str, call: Callable[[], Any]) -> Any:
        """`call()`'s value; on any error from the tracker, a warning and None, and that tracker is off
        for the rest of the run (one warning per tracker: its next calls would fail alike)."""
        try:
            return call()
        except Exception as e:  # a tracker's own errors, whatever their kind: never the run's
            log.warning(
                "fedskew: %s failed (%s: %s); the run goes on without it",
                tracker,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            setattr(self, tracker, None)
            return None

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        if self.tensorboard is not None:
            writer = self.tensorboard

            def write() -> None:
                for tag, value in values.items():
                    writer.add_scalar(tag, value, step)
                writer.flush()  # visible while the run goes on

            self._guard("tensorboard", write)
        if self.wandb is not None:
            self._guard("wandb", lambda: self.wandb.log(values, step=step))

    def log_partition(self, skew: dict[str, Any]) -> None:
        """The partition's skew (`partition_skew`) at step 0."""
        self.log_scalars(
            {
                "partition/classes-per-client": skew["classes-per-client"]["mean"],
                "partition/label-distance": skew["label-distance"]["mean"],
                "partition/dominated-classes": len(skew["dominated-classes"]),
            },
            0,
        )

    def log_round(self, row: dict[str, Any]) -> None:
        """One `metrics.jsonl` row (`scalars`), at step `row["round"]`."""
        self.log_scalars(scalars(row), int(row["round"]))

    def log_figure(self, tag: str, figure: Any, step: int) -> None:
        """A matplotlib `Figure` as an image."""
        if self.tensorboard is not None:
            self._guard("tensorboard", lambda: self.tensorboard.add_figure(tag, figure, step, close=False))
        if self.wandb is not None:

            def log_image() -> None:
                import wandb

                self.wandb.log({tag: wandb.Image(figure)}, step=step)

            self._guard("wandb", log_image)

    def close(self) -> None:
        if self.tensorboard is not None:
            self._guard("tensorboard", self.tensorboard.close)
        if self.wandb is not None:
            self._guard("wandb", self.wandb.finish)


def _tensorboard_writer(cfg: dict[str, Any], run_dir: Path, first_round: int) -> Any:
    """TensorBoard's writer in the run folder, the run config as its first text."""
    from torch.utils.tensorboard import SummaryWriter  # about 0.05 s once Flower is imported

    writer = SummaryWriter(str(run_dir), purge_step=first_round if first_round > 1 else None)
    writer.add_text("config", "```\n" + json.dumps(cfg, indent=1, sort_keys=True) + "\n```", 0)
    return writer
