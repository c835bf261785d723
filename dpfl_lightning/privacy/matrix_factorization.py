"""Matrix-factorization mechanisms for DP-FTRL: workloads, strategies, their errors and sensitivities.

Notation (all matrices float64, rounds ``t = 0 .. T-1``):

- the **workload** ``A`` (``T x T``, lower triangular) maps the per-round aggregate gradients ``g``
  (rows, ``[T, d]``) to what training uses: the prefix sums (plain server SGD: ``x_t = x_0 - lr *
  (A g)_t``) or, with server momentum ``beta``, ``(A g)_t = sum_{u<=t} (1 - beta^(t-u+1)) / (1 -
  beta) g_u`` (``m_t = beta m_{t-1} + g_t``, ``x_t = x_{t-1} - lr m_t``).
- a **strategy** is a factorization ``A = B C`` with ``C`` of shape ``[m, T]`` (``m = T`` for square
  strategies, ``m`` = number of tree nodes for a tree) and a left inverse ``L`` (``L C = I``, ``L =
  C^{-1}`` when square). The mechanism releases ``C g + Z`` with ``Z``'s rows iid ``N(0, sigma^2
  sens^2 I_d)``; equivalently the server adds ``(L Z)_t`` to round ``t``'s aggregate before its step,
  so training sees ``A (g + L Z) = A g + B Z`` with ``B = A L``. ``sens`` is ``C``'s L2 sensitivity under
  the participation pattern (:mod:`dpfl_lightning.privacy.mf_sensitivity`), so the release is the
  Gaussian mechanism with noise multiplier ``sigma`` -- the accounting needs only ``sigma``.
- the noise on round ``t`` has covariance ``sigma^2 sens^2 (L L^T)`` (per coordinate); the error of
  the workload is ``sigma^2 sens^2 ||A L||_F^2`` per coordinate (total squared error), and the noise
  in the final model's sum ``(A L Z)_{T-1}`` has variance ``sigma^2 sens^2 ||(A L)_{T-1}||^2``.

Strategies: :func:`independent` (``C = I``: today's independent noise), :func:`tree` (below);
``banded`` and ``blt`` are optimised in :mod:`dpfl_lightning.privacy.mf_optimize`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dpfl_lightning.privacy.mf_sensitivity import Sensitivity, sensitivity_details

__all__ = ["Workload", "prefix_sum", "momentum", "Strategy", "independent", "tree", "tree_variances", "toeplitz",
           "toeplitz_inverse_coeffs", "convolve", "total_squared_error", "final_variance"]

F64 = torch.float64


@dataclass(frozen=True)
class Workload:
    """A lower-triangular Toeplitz workload: ``A[t, u] = coeffs[t - u]`` for ``u <= t``."""

    name: str
    coeffs: torch.Tensor  # [T] float64

    @property
    def T(self) -> int:
        return int(self.coeffs.numel())

    def matrix(self) -> torch.Tensor:
        return toeplitz(self.coeffs)


def prefix_sum(T: int) -> Workload:
    """The all-ones lower-triangular matrix: server SGD's iterates from its gradients."""
    _check_T(T)
    return Workload("prefix", torch.ones(T, dtype=F64))


def momentum(T: int, beta: float) -> Workload:
    """Server SGD with heavy-ball momentum ``beta`` in ``[0, 1)``: iterate ``t`` minus ``x_0`` is
    ``-lr * sum_{u<=t} (1 - beta^(t-u+1)) / (1 - beta) g_u``. ``beta=0`` is :func:`prefix_sum`."""
    _check_T(T)
    if not 0.0 <= float(beta) < 1.0:
        raise ValueError(f"momentum beta={beta!r}: give a value in [0, 1) (0 is plain server SGD)")
    if beta == 0.0:
        return prefix_sum(T)
    k = torch.arange(T, dtype=F64)
    return Workload(f"momentum{float(beta)!r}", (1.0 - float(beta) ** (k + 1)) / (1.0 - float(beta)))


@dataclass(frozen=True)
class Strategy:
    """A factorization's ``C`` (``[m, T]``), its left inverse ``L`` (``[T, m]``: round ``t``'s noise is
    ``(L Z)_t``), how many rows of ``Z`` each round draws (``rows_per_round``; rows are numbered in
    the order they are drawn) and the parameters that define it (``params``)."""

    kind: str
    C: torch.Tensor
    inverse: torch.Tensor
    rows_per_round: tuple
    params: dict = field(default_factory=dict)

    @property
    def T(self) -> int:
        return int(self.C.shape[1])

    def sensitivity(self, min_sep: int | None = None, max_participations: int | None = None) -> float:
        """L2 sensitivity for one client's participations pairwise ``min_sep`` apart (default ``T``:
        single participation), at most ``max_participations`` (default ``ceil(T / min_sep)``)."""
        return self.sensitivity_details(min_sep, max_participations).value

    def sensitivity_details(self, min_sep: int | None = None, max_participations: int | None = None) -> Sensitivity:
        return sensitivity_details(self.C, self.T if min_sep is None else min_sep, max_participations)

    def covariance(self) -> torch.Tensor:
        """``L L^T``: the covariance across rounds of the noise added at unit ``sigma * sens``."""
        return self.inverse @ self.inverse.T


def independent(T: int) -> Strategy:
    """``C = I``: independent noise each round (sensitivity ``sqrt(k)`` for ``k`` participations)."""
    _check_T(T)
    eye = torch.eye(T, dtype=F64)
    return Strategy("independent", eye, eye.clone(), (1,) * T, {})


def tree(T: int, height: int | None = None) -> Strategy:
    """Online binary-tree aggregation (Kairouz et al. 2021) with Honaker's estimator, restarted every
    ``2**height`` rounds (default: one tree, ``height = ceil(log2 T)``).

    Every dyadic node ``[a, a + 2^l)`` of a tree gets one row of ``Z`` when its last round arrives
    (nodes that end after ``T`` never exist). The prefix sum at round ``t`` is estimated from all
    nodes complete by then: the prefix splits into maximal complete nodes, and each one's estimate
    combines its own noisy value with its children's estimates by inverse variance, bottom-up
    (Honaker 2015, "Efficient use of differentially private binary trees"; TFF's
    ``EfficientTreeAggregator``). For a node's sum that is the least-squares estimate from its
    subtree, and the subtrees of the maximal nodes hold every node complete at ``t``, so the
    prefix-sum noise is the least possible among unbiased online estimators from these nodes.
    With node-estimate variances ``v_0 = 1``, ``v_l = 1 / (1 + 1 / (2 v_{l-1}))`` and weight ``v_l``
    on the node's own value. The noise added to round ``t``'s gradient is the difference of
    consecutive prefix-sum noises. Rows of ``C`` are node indicators (weight 1), so the sensitivity
    for a single participation is the number of levels containing the round (``height + 1``)."""
    _check_T(T)
    h = max(0, math.ceil(math.log2(T))) if height is None else height
    if not isinstance(h, int) or h < 0:
        raise ValueError(f"tree height={height!r}: give an integer >= 0 (the tree restarts every 2**height rounds)")
    nodes = _tree_nodes(T, h)
    C = torch.zeros(len(nodes), T, dtype=F64)
    for r, (end, level, start) in enumerate(nodes):
        C[r, start:end + 1] = 1.0
    rows = [0] * T
    for end, _, _ in nodes:
        rows[end] += 1
    return Strategy("tree", C, _honaker_inverse(T, h, rows), tuple(rows), {"height": h})


def _tree_nodes(T: int, h: int) -> list:
    """(last round, level, first round) of every node complete within T, in drawing order."""
    size, nodes = 2 ** h, []
    for block in range(0, T, size):
        for level in range(h + 1):
            width = 2 ** level
            for start in range(block, block + size, width):
                if start + width <= T:
                    nodes.append((start + width - 1, level, start))
    return sorted(nodes)


def tree_variances(h: int) -> list[float]:
    """Variance of Honaker's estimate of a level-l node's sum, unit noise per node, l = 0 .. h."""
    v = [1.0]
    for _ in range(h):
        v.append(1.0 / (1.0 + 1.0 / (2.0 * v[-1])))
    return v


def _honaker_inverse(T: int, h: int, rows: list) -> torch.Tensor:
    """L ([T, m]): row t is round t's gradient noise as a combination of Z's rows."""
    m, v = sum(rows), tree_variances(h)
    L = torch.zeros(T, m, dtype=F64)
    stored: dict = {}  # level -> weights of the maximal complete node at that level (this block)
    first = 0
    for t in range(T):
        if (t % 2 ** h) == 0:
            stored = {}
        eye = torch.zeros(rows[t], m, dtype=F64)
        eye[torch.arange(rows[t]), first + torch.arange(rows[t])] = 1.0
        siblings = [stored.pop(level) for level in range(rows[t] - 1)]  # merge into the new node
        estimate = eye[0]
        for level in range(1, rows[t]):
            estimate = v[level] * eye[level] + (1.0 - v[level]) * (siblings[level - 1] + estimate)
        L[t] = estimate - sum(siblings, torch.zeros(m, dtype=F64))
        stored[rows[t] - 1] = estimate
        first += rows[t]
    return L


def toeplitz(coeffs: torch.Tensor) -> torch.Tensor:
    """The lower-triangular Toeplitz matrix with first column ``coeffs`` (differentiable)."""
    T = coeffs.numel()
    i = torch.arange(T)
    diff = i[:, None] - i[None, :]
    return torch.where(diff >= 0, coeffs[diff.clamp(min=0)], torch.zeros((), dtype=coeffs.dtype))


def toeplitz_inverse_coeffs(coeffs: torch.Tensor) -> torch.Tensor:
    """First column of the inverse of ``toeplitz(coeffs)`` (itself lower-triangular Toeplitz): the
    power series ``1 / c(x)`` mod ``x^T``, by Newton's iteration ``r <- r (2 - c r)`` with FFT
    products (``O(T log T)``, differentiable)."""
    T = coeffs.numel()
    if float(coeffs[0].detach()) == 0.0:
        raise ValueError("a lower-triangular Toeplitz factor needs a non-zero diagonal (coeffs[0] != 0)")
    r = (1.0 / coeffs[:1]).reshape(1)
    m = 1
    while m < T:
        m = min(2 * m, T)
        residual = -convolve(coeffs[:m], r, m)
        residual = residual + torch.nn.functional.pad(torch.full((1,), 2.0, dtype=r.dtype), (0, m - 1))
        r = convolve(r, residual, m)
    return r


def convolve(a: torch.Tensor, b: torch.Tensor, m: int) -> torch.Tensor:
    """The first ``m`` coefficients of the product of the power series ``a`` and ``b``."""
    n = 1 << (len(a) + len(b)).bit_length()
    return torch.fft.irfft(torch.fft.rfft(a, n) * torch.fft.rfft(b, n), n)[:m]


def total_squared_error(strategy: Strategy, workload: Workload, min_sep: int | None = None,
                        max_participations: int | None = None) -> float:
    """``sens^2 ||A L||_F^2``: summed over rounds, the noise variance per coordinate in the workload's
    outputs at noise multiplier 1 (``min_sep=None``: single participation)."""
    _check_same_T(strategy, workload)
    sens = strategy.sensitivity(min_sep, max_participations)
    return sens ** 2 * float((workload.matrix() @ strategy.inverse).pow(2).sum())


def final_variance(strategy: Strategy, workload: Workload, min_sep: int | None = None,
                   max_participations: int | None = None, unit_sensitivity: bool = False) -> float:
    """Variance per coordinate of the noise in the workload's last output (the final model's sum of
    noisy gradients, times the learning rate) at noise multiplier 1; ``unit_sensitivity=True`` leaves
    out ``sens^2`` (the noise of ``L Z`` with unit-variance ``Z``)."""
    _check_same_T(strategy, workload)
    row = workload.matrix()[-1] @ strategy.inverse
    sens = 1.0 if unit_sensitivity else strategy.sensitivity(min_sep, max_participations)
    return sens ** 2 * float(row.pow(2).sum())


def _check_T(T) -> None:
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"T={T!r}: give the number of rounds, an integer >= 1")


def _check_same_T(strategy: Strategy, workload: Workload) -> None:
    if strategy.T != workload.T:
        raise ValueError(f"the strategy is for T={strategy.T} rounds but the workload for T={workload.T}: "
                         "build both for the run's number of rounds")
