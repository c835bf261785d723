"""What the noise check tests for correlated and for discrete noise: i.i.d. unit noise, from public values.

Correlated noise (DP-FTRL, :mod:`dpfl_lightning.privacy.matrix_factorization`). Round ``t``'s released
sum is ``y_t = g_t + n_t`` with ``n = L D Z`` across rounds (per coordinate): ``L`` the strategy's left
inverse of ``C`` (``[T, m]``), ``Z``'s ``m`` rows i.i.d. ``N(0, 1)`` and ``D`` the declared std of each
row, ``z sens C_t`` of the round that draws it. Its covariance across rounds is ``S = L D^2 L^T``, and
with the Cholesky factor ``S = R R^T`` (lower triangular), ``e = R^{-1} n`` is i.i.d. ``N(0, 1)``: ``e_t``
is the innovation of ``n_t`` given ``n_0 .. n_{t-1}`` over its std. For a square (lower-triangular)
``C``, ``R = C^{-1} D`` and ``R^{-1} y = D^{-1} C y`` is the mechanism's own release ``C g + Z`` scaled
to unit noise; for a tree (``m > T`` nodes) ``R`` is the same whitening of the prefix-sum noise.
:class:`Whitener` computes ``(R^{-1} y)_t`` round by round (row ``t`` of ``R`` needs only the scales
of rounds ``<= t``). Its signal part ``(R^{-1} g)_t`` is a function of ``g_0 .. g_t``, hence of the
noise of rounds before ``t`` and of the data, independent of ``e_t``: the chi-square lower tail of
:func:`~dpfl_lightning.privacy.audit_bounds.noise_check` holds for ``||(R^{-1} y)_t||^2`` as it does
for independent noise. Every coordinate has the same ``R``; a fixed, evenly spaced subset of
coordinates (:func:`coordinate_subset`) bounds the memory of the history (``T x k`` values).

Discrete noise (:class:`~dpfl_lightning.plugins.discrete_distributed_noise.DiscreteDistributedNoise`).
The decoded sum is ``gamma`` times the inverse rotation of the survivors' integer sum, whose noise is
the sum of their shares: ``n`` i.i.d. integers per coordinate of variance ``v`` each
(:func:`share_variance`: the discrete Gaussian's exact variance, slightly below its parameter
``sigma^2``, Canonne, Kamath, Steinke 2020; Skellam's ``2 lam``, Agarwal, Kairouz, Liu 2021). The
rotation is orthogonal, so each kept coordinate's noise has variance ``n v gamma^2``, uncorrelated,
and is a weighted sum of ``D`` independent integers (Gaussian to a close approximation).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpfl_lightning.errors import require


def coordinate_subset(d: int, cap: int) -> torch.Tensor | None:
    """``min(d, cap)`` evenly spaced coordinates of ``0 .. d-1`` (None: all of them)."""
    if d <= cap:
        return None
    return torch.div(torch.arange(cap, dtype=torch.int64) * d, cap, rounding_mode="floor")


class Whitener:
    """Round by round, ``(R^{-1} y)_t`` for released sums ``y_t`` with correlated noise ``L D Z``
    (module docstring). ``inverse``: the strategy's ``L`` (``[T, m]``); ``rows_per_round``: how many
    rows of ``Z`` each round draws (in order)."""

    def __init__(self, inverse: torch.Tensor, rows_per_round) -> None:
        self.L = inverse.detach().to(torch.float64).cpu()
        T, m = self.L.shape
        self.row_round = torch.repeat_interleave(torch.arange(len(rows_per_round)),
                                                 torch.tensor(list(rows_per_round), dtype=torch.int64))
        require(len(self.row_round) == m and len(rows_per_round) == T, "Whitener", (T, m),
                "the strategy's rows per round do not match its left inverse", "pass the strategy's own rows_per_round")
        self.row_var = torch.zeros(m, dtype=torch.float64)  # D^2: declared row variances, set as rounds arrive
        self.R = torch.zeros(T, T, dtype=torch.float64)
        self.history: list[torch.Tensor] = []  # whitened past rounds

    @property
    def round(self) -> int:
        return len(self.history)

    def next(self, y: torch.Tensor, scale: float) -> torch.Tensor:
        """Round ``self.round``'s whitened value from its released ``y`` and the declared std ``scale``
        of the rows it draws (i.i.d. ``N(0, 1)`` entries when the declared noise is there)."""
        t = self.round
        require(t < self.R.shape[0], "Whitener", t, "every round of the strategy is used", "start a new Whitener")
        require(scale > 0, "Whitener.scale", scale, "must be > 0", "pass the declared std of the round's rows")
        self.row_var[self.row_round == t] = float(scale) ** 2
        col = self.L[: t + 1] @ (self.row_var * self.L[t])  # S[:t+1, t]; rows of later rounds do not enter L[t]
        if t:
            r = torch.linalg.solve_triangular(self.R[:t, :t], col[:t, None], upper=False)[:, 0]
        else:
            r = col[:0]
        diag2 = float(col[t] - r @ r)
        require(diag2 > 0, "Whitener", t, "the noise covariance is singular at this round", "check the strategy")
        self.R[t, :t], self.R[t, t] = r, math.sqrt(diag2)
        x = y.detach().to(torch.float64).cpu().reshape(-1)
        if t:
            x = x - r @ torch.stack(self.history)
        e = x / self.R[t, t]
        self.history.append(e)
        return e


def discrete_gaussian_variance(sigma2: float) -> float:
    """The variance of the discrete Gaussian ``N_Z(0, sigma^2)`` (``P[k] ~ exp(-k^2 / (2 sigma^2))``):
    ``sum k^2 p_k``, summed directly (it is below ``sigma^2``, by a relative ``~exp(-2 pi^2 sigma^2)``
    for large ``sigma``; Canonne, Kamath, Steinke 2020, Prop. 19)."""
    require(sigma2 > 0, "discrete Gaussian", sigma2, "sigma^2 must be > 0", "pass the noise parameter")
    k = np.arange(0, int(math.ceil(12 * math.sqrt(sigma2))) + 12, dtype=np.float64)
    w = np.exp(-k * k / (2 * sigma2))
    w[1:] *= 2  # +k and -k
    return float((k * k * w).sum() / w.sum())


def share_variance(mechanism: str, parameter: float) -> float:
    """One integer share's variance: ``discrete_gaussian`` (``parameter = sigma^2``) or ``skellam``
    (``parameter = lam``, the difference of two Poisson(``lam``): variance ``2 lam``)."""
    if mechanism == "skellam":
        return 2.0 * float(parameter)
    require(mechanism == "discrete_gaussian", "mechanism", mechanism, "unknown", "use discrete_gaussian or skellam")
    return discrete_gaussian_variance(float(parameter))
