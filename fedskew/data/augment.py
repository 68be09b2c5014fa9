"""Training augmentation as the papers' code does it, on whole mini-batches on the training device.

The FedRS/MAP authors' code (`lxcnju/FedRepo`, `datasets/cifar_data.py`) trains CIFAR with
torchvision's `RandomCrop(32, padding=4)` + `RandomHorizontalFlip()`; FedMR's and FedGELA's code
(`MediaBrain-SJTU/FedMR`, `.../FedGELA`, `load_data.py`) use the same crop and flip for CIFAR-100
(plus a 15-degree rotation, left out here) and for CIFAR-10 in FedMR (reflect padding there), and
nothing for MNIST, Fashion-MNIST and SVHN. `augment="auto"` therefore gives:

- cifar10, cifar100: random crop (pad 4) + horizontal flip;
- svhn: random crop only. A mirrored digit is another glyph (or none), so the flip is not
  label-preserving; the crop (a shift of up to 4 pixels) is the usual "weak" SVHN augmentation of the
  semi-supervised literature. The authors' SVHN runs use none: `augment="none"` reproduces them;
- fashion-mnist, mnist and `hf:` data: none (`augment="crop"` / `"crop-flip"` switch it on).

Both act on the normalised batch: the padding is black (the value a 0 pixel has after
normalisation, as torchvision pads before `Normalize`), the crop offsets and flips are drawn from the
trainer's seeded generator (so a run is reproducible), and one gather does crop and flip for the whole
batch: no per-sample Python, no CPU round trip for the pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedskew.data import DatasetInfo

AUTO = {"cifar10": "crop-flip", "cifar100": "crop-flip", "svhn": "crop"}


@dataclass(frozen=True)
class Draw:
    """One batch's random choices (CPU tensors): which images are flipped `[b]` (None: no flip) and
    the crop offsets `[2, b]`, rows then columns, in [0, 2 pad] (None: no crop)."""

    flip: torch.Tensor | None
    shift: torch.Tensor | None


@dataclass(frozen=True)
class Augmentation:
    """Random crop after padding each side by `pad` (0 = no crop) and, with `flip`, a horizontal flip
    with probability 1/2; `fill` is the per-channel value of the padding."""

    pad: int
    flip: bool
    fill: tuple[float, ...]

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Augment a batch `[B, C, H, W]`; the draws come from `generator` (a CPU generator)."""
        return self.apply(x, self.draw(x.shape[0], generator))

    def draw(self, b: int, generator: torch.Generator) -> Draw:
        """The random choices for a batch of `b` images, drawn from `generator` (flips, then offsets):
        drawn apart from `apply` so that the batched engine can draw every step of a round first, in
        the order `__call__` draws them (`fedskew.batched.stacked.client_steps`)."""
        flip = torch.rand(b, generator=generator) < 0.5 if self.flip else None
        shift = torch.randint(0, 2 * self.pad + 1, (2, b), generator=generator) if self.pad else None
        return Draw(flip, shift)

    def fill_value(self, x: torch.Tensor) -> torch.Tensor:
        """The padding's value `[1, C, 1, 1]`, on `x`'s device."""
        return torch.tensor(self.fill, dtype=x.dtype, device=x.device).view(1, len(self.fill), 1, 1)

    def apply(self, x: torch.Tensor, draw: Draw, fill: torch.Tensor | None = None) -> torch.Tensor:
        """Augment a batch `[B, C, H, W]` with the choices `draw` (on any device); `fill`: the padding's
        `fill_value` when the caller keeps it on the device (no copy from the host for each batch)."""
        b, c, h, w = x.shape
        dev, p = x.device, self.pad
        rows = torch.arange(h, device=dev).expand(b, h)
        cols = torch.arange(w, device=dev).expand(b, w)
        if draw.flip is not None:
            flipped = draw.flip.to(dev)
            cols = torch.where(flipped[:, None], w - 1 - cols, cols)
        if draw.shift is not None:
            shift = draw.shift.to(dev)
            rows, cols = rows + shift[0, :, None], cols + shift[1, :, None]
            padded = (self.fill_value(x) if fill is None else fill).repeat(b, 1, h + 2 * p, w + 2 * p)
            padded[:, :, p : p + h, p : p + w] = x
            x = padded
        # output pixel (i, j) of image k is x[k, :, rows[k, i], cols[k, j]]: one gather on flat indices
        flat = (rows[:, :, None] * (w + 2 * p) + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
        return x.reshape(b, c, -1).gather(2, flat).view(b, c, h, w)


def augmentation(cfg: dict[str, Any], info: DatasetInfo) -> Augmentation | None:
    """The configured augmentation (`augment` key) for a data set, or None for none."""
    mode = cfg["augment"]
    if mode == "auto":
        mode = AUTO.get(cfg["dataset"], "none")
    if mode == "none":
        return None
    pad = max(1, round(info.size / 8))  # 4 at 32x32, the papers' padding
    fill = tuple(-m / s for m, s in zip(info.mean, info.std, strict=True))  # a black pixel, normalised
    return Augmentation(pad if mode.startswith("crop") else 0, mode.endswith("flip"), fill)
