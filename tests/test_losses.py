"""FedRS restricted softmax and FedProx: the properties of FedRS spec §9."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedskew.losses import fedrs_scale, proximal_term, restricted_softmax_cross_entropy

C, D, B = 6, 5, 16


def _batch(seed: int = 0, observed: tuple[int, ...] = (0, 2, 3), dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, D, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(C, D, generator=g, dtype=dtype, requires_grad=True)
    y = torch.tensor(observed)[torch.randint(0, len(observed), (B,), generator=g)]
    counts = np.bincount(y.numpy(), minlength=C) * 10
    return h, w, y, counts


def _grads(loss: torch.Tensor, *ts: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, ts))


def test_alpha_one_is_cross_entropy() -> None:
    h, w, y, counts = _batch()
    rs = restricted_softmax_cross_entropy(h @ w.T, y, fedrs_scale(counts, 1.0))
    ce = F.cross_entropy(h @ w.T, y)
    assert torch.allclose(rs, ce)
    for a, b in zip(_grads(rs, h, w), _grads(ce, h, w), strict=True):
        assert torch.allclose(a, b)


def test_no_missing_class_means_no_effect() -> None:
    h, w, y, _ = _batch()
    full = np.full(C, 5)
    for alpha in (0.0, 0.3, 0.9):
        rs = restricted_softmax_cross_entropy(h @ w.T, y, fedrs_scale(full, alpha))
        assert torch.allclose(rs, F.cross_entropy(h @ w.T, y))


def test_alpha_zero_zeroes_missing_rows_but_keeps_them_in_the_denominator() -> None:
    h, w, y, counts = _batch()
    s = fedrs_scale(counts, 0.0)
    missing = counts == 0
    loss = restricted_softmax_cross_entropy(h @ w.T, y, s)
    (gw,) = _grads(loss, w)
    assert torch.equal(gw[torch.from_numpy(missing)], torch.zeros(int(missing.sum()), D))
    zeroed = (h @ w.T).masked_fill(torch.from_numpy(missing), 0.0)
    assert torch.allclose(loss, F.cross_entropy(zeroed, y))
    obs = torch.from_numpy(~missing).nonzero().squeeze(1)
    remap = {int(c): i for i, c in enumerate(obs)}
    only_observed = F.cross_entropy((h @ w.T)[:, obs], torch.tensor([remap[int(v)] for v in y]))
    assert not torch.allclose(loss, only_observed)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 1.0])
def test_analytic_gradients(alpha: float) -> None:
    h, w, y, counts = _batch(1, dtype=torch.float64)  # autograd's and the formula's sums: in float64
    s = fedrs_scale(counts, alpha)
    gh, gw = _grads(restricted_softmax_cross_entropy(h @ w.T, y, s), h, w)
    p = torch.softmax((h @ w.T) * s, dim=1)
    g = (p - F.one_hot(y, C).double()) * s
    assert torch.allclose(gw, g.T @ h / B, atol=1e-12)
    assert torch.allclose(gh, g @ w / B, atol=1e-12)
    for c in np.flatnonzero(counts == 0):  # Eq. 10: missing rows are only pushed, scaled by alpha
        assert torch.allclose(gw[c], alpha * (p[:, c : c + 1] * h).sum(0) / B, atol=1e-12)


def test_reparametrisation_scales_gradient_per_row() -> None:
    h, w, y, counts = _batch(2, dtype=torch.float64)  # (h W^T) s and h (W s)^T round differently in float32
    s = fedrs_scale(counts, 0.4)
    (gw,) = _grads(restricted_softmax_cross_entropy(h @ w.T, y, s), w)
    w2 = (w * s[:, None]).detach().requires_grad_(True)
    (gw2,) = _grads(F.cross_entropy(h @ w2.T, y), w2)
    assert torch.allclose(gw, gw2 * s[:, None], atol=1e-12)


def test_scale_vector_rules() -> None:
    counts = np.array([19, 20, 0, 50, 1, 0])
    s = fedrs_scale(counts, 0.3, tau=20)
    assert s.dtype == torch.float32 and s.shape == (6,)
    assert s.tolist() == pytest.approx([0.3, 1.0, 0.3, 1.0, 0.3, 0.3])
    c = fedrs_scale(counts, 0.3, tau=1, mode="count")
    assert c[3] == 1.0 and c[2] == pytest.approx(0.3) and ((c >= 0.3 - 1e-7) & (c <= 1.0)).all()
    equal = np.array([7, 7, 0, 7, 0, 0])
    assert torch.equal(fedrs_scale(equal, 0.5, mode="count"), fedrs_scale(equal, 0.5))
    with pytest.raises(ValueError):
        fedrs_scale(counts, 1.5)


def test_proximal_term_value_and_gradient() -> None:
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    g = [torch.tensor([0.0, 0.0]), torch.tensor([[1.0]])]
    term = proximal_term(w, g, mu=0.5)
    assert term.item() == pytest.approx(0.25 * (1 + 4 + 4))
    term.backward()
    assert torch.allclose(w[0].grad, 0.5 * (w[0] - g[0]))
    assert float(proximal_term(g, g, 3.0)) == 0.0
