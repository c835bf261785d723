"""The synthetic problems of the papers, shared by their data (:mod:`dpfl_lightning.data.synthetic`)
and their models (:mod:`dpfl_lightning.models`), which import them from here (neither imports the other).

- :func:`quadratic_problem`: paper 003 App. F's quadratic problem and its minimiser;
- :func:`linear_regression_target`: the shared minimiser ``w*`` of paper 002's synthetic linear
  regression (the first draw of :func:`~dpfl_lightning.data.linear_regression_problem`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class QuadraticProblem:
    """``f(w) = 1/n sum_i 1/2 (w - w_i*)^T A_i A_i^T (w - w_i*)`` and its minimiser."""

    A: torch.Tensor  # [n, d, k]
    w_star_i: torch.Tensor  # [n, d]
    w_star: torch.Tensor  # [d], the global minimiser
    f_star: float  # f(w_star)


@lru_cache(maxsize=8)
def quadratic_problem(num_clients: int = 100, dim: int = 200, rank: int = 20, seed: int = 0) -> QuadraticProblem:
    """Paper 003 App. F: ``w_i* ~ N(0, I_d)``, ``A_i`` is ``d x k`` with entries ``N(0, 1/k^2)``
    (``k = 20``: variance ``1/20^2``). Computed in float64; the minimiser solves
    ``(sum Q_i) w = sum Q_i w_i*``."""
    g = torch.Generator().manual_seed(seed)
    w_i = torch.randn(num_clients, dim, generator=g, dtype=torch.float64)
    A = torch.randn(num_clients, dim, rank, generator=g, dtype=torch.float64) / rank
    Q = A @ A.transpose(1, 2)
    w_star = torch.linalg.solve(Q.sum(0), (Q @ w_i.unsqueeze(-1)).sum(0)).squeeze(-1)
    r = torch.einsum("ndk,nd->nk", A, w_star.unsqueeze(0) - w_i)
    f_star = float(0.5 * (r**2).sum(-1).mean())
    return QuadraticProblem(A.float(), w_i.float(), w_star.float(), f_star)


def linear_regression_target(dim: int, seed: int = 0) -> torch.Tensor:
    """The shared minimiser ``w* ~ N(0, I_d)`` of
    :func:`~dpfl_lightning.data.linear_regression_problem` with this seed."""
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))
