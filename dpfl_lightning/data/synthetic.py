"""Synthetic federated data of the papers, generated from a seed (no download).

- :class:`SyntheticLogistic`: the synthetic(alpha, beta) softmax-regression data of paper 001
  App. D.2 (after Li et al. 2020, FedProx): per-user ground-truth models and feature means, so
  ``alpha`` controls model heterogeneity and ``beta`` data heterogeneity.
- :class:`QuadraticClients` with :func:`quadratic_problem`: the quadratic problem of paper 003
  App. F, ``f_i(w) = 1/2 (w - w_i*)^T Q_i (w - w_i*)`` with ``Q_i = A_i A_i^T``.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import require
from dpfl_lightning.problems import (QuadraticProblem, linear_regression_target,  # noqa: F401 (re-exported)
                                     quadratic_problem)


def synthetic_logistic(num_clients: int, samples_per_client: int, test_samples_per_client: int, dim: int,
                       num_classes: int, alpha: float, beta: float, label_noise: float, seed: int):
    """Generate paper 001 App. D.2 data. Returns train/test ``(x, y)`` arrays and the client of each row.

    For user ``i``: ``u_i ~ N(0, alpha I)`` (``d' x C``), ``W_i ~ N(u_i, I)``; ``u'_i ~ N(0, alpha I)``,
    ``b_i ~ N(u'_i, I)``; ``B_i ~ N(0, beta I)``, ``v_i ~ N(B_i, I)``; ``x ~ N(v_i, Sigma)`` with
    ``Sigma_jj = j^-1.2``; ``y = argmax(W_i^T x + b_i)``, replaced by a uniformly drawn other label
    with probability ``label_noise``.
    """
    rng = np.random.default_rng(seed)
    sd = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt(j^-1.2)
    n = samples_per_client + test_samples_per_client
    xs, ys = [], []
    for _ in range(num_clients):
        u = rng.normal(0.0, np.sqrt(alpha), (dim, num_classes))
        w = rng.normal(u, 1.0)
        b = rng.normal(rng.normal(0.0, np.sqrt(alpha), num_classes), 1.0)
        v = rng.normal(rng.normal(0.0, np.sqrt(beta), dim), 1.0)
        x = v + rng.normal(size=(n, dim)) * sd
        y = np.argmax(x @ w + b, axis=1)
        flip = rng.random(n) < label_noise
        y[flip] = (y[flip] + rng.integers(1, num_classes, flip.sum())) % num_classes
        xs.append(x)
        ys.append(y)
    x = np.stack(xs).astype(np.float32)
    y = np.stack(ys).astype(np.int64)
    s = samples_per_client
    return (x[:, :s].reshape(-1, dim), y[:, :s].reshape(-1), x[:, s:].reshape(-1, dim), y[:, s:].reshape(-1))


class SyntheticLogistic(FederatedDataModule):
    """Paper 001's synthetic(alpha, beta) classification data, split by user (natural partition).

    Args:
        num_clients: users ``M``.
        samples_per_client: training records per user ``R`` (paper 001: 4000, the 80% train split of 5000).
        test_samples_per_client: held-out records per user; their union is the global test set.
        dim: input dimension ``d'`` (paper 001: 40; FedProx: 60).
        num_classes: 10 in both papers.
        alpha, beta: model and data heterogeneity.
        label_noise: probability of replacing a label (paper 001: 0.05).
    """

    test_set_from_clients = True  # the global test set is the users' held-out records

    def __init__(self, num_clients: int = 100, samples_per_client: int = 100, test_samples_per_client: int = 25,
                 dim: int = 40, num_classes: int = 10, alpha: float = 0.0, beta: float = 0.0, label_noise: float = 0.05,
                 seed: int = 0, client_test_fraction: float = 0.0, eval_batch_size: int = 4096) -> None:
        require(samples_per_client >= 1, "data.samples_per_client", samples_per_client, "must be >= 1", "set it >= 1")
        require(alpha >= 0 and beta >= 0, "data.alpha/beta", (alpha, beta), "must be >= 0", "use alpha, beta >= 0")
        super().__init__(num_clients=num_clients, partition="natural", seed=seed, client_test_fraction=client_test_fraction,
                         eval_batch_size=eval_batch_size)
        self.samples_per_client = samples_per_client
        self.records_by_construction = samples_per_client  # every user holds R records: public
        self.test_samples_per_client = test_samples_per_client
        self.dim, self.num_classes = dim, num_classes
        self.alpha_model, self.beta_data, self.label_noise = alpha, beta, label_noise

    def load(self):
        x, y, xt, yt = synthetic_logistic(self.num_clients, self.samples_per_client, self.test_samples_per_client,
                                          self.dim, self.num_classes, self.alpha_model, self.beta_data,
                                          self.label_noise, self.seed)
        r = self.samples_per_client
        clients = [torch.arange(c * r, (c + 1) * r) for c in range(self.num_clients)]
        test = TensorDataset(torch.from_numpy(xt), torch.from_numpy(yt)) if len(yt) else None
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), test, clients


class QuadraticClients(FederatedDataModule):
    """Paper 003 App. F's clients: client ``i`` holds one record ``(A_i, w_i*)``.

    Train with ``batch_size=None`` (full local gradient) and a
    :class:`~dpfl_lightning.models.QuadraticModel` of the same ``(num_clients, dim, rank, seed)``.
    The global test set is every client's record, so the mean loss over it is ``f(w)``.
    """

    test_set_from_clients = True  # the global test set is every client's own record

    def __init__(self, num_clients: int = 100, dim: int = 200, rank: int = 20, seed: int = 0) -> None:
        super().__init__(num_clients=num_clients, partition="natural", seed=seed, eval_batch_size=num_clients)
        self.dim, self.rank = dim, rank
        self.records_by_construction = 1  # one record per client: public

    def load(self):
        p = quadratic_problem(self.num_clients, self.dim, self.rank, self.seed)
        ds = TensorDataset(p.A, p.w_star_i)
        return ds, ds, [torch.tensor([i]) for i in range(self.num_clients)]


@lru_cache(maxsize=8)
def linear_regression_problem(num_clients: int = 1000, samples_per_client: int = 20, dim: int = 100,
                              seed: int = 0, test_per_client: int = 0):
    """Paper 002 App. G's synthetic linear regression (after Li et al. 2020 and FedEXP): a shared
    target ``w* ~ N(0, I_d)``; client ``i`` draws ``u_i ~ N(0, 0.1)``, ``m_i ~ N(u_i, 1)`` and its
    inputs ``x ~ N(m_i, I_d)``, labels ``y = x^T w*`` (no noise: every client shares the minimiser).
    Returns ``(x [M * n, d], y [M * n], w* [d])``; with ``test_per_client = k > 0`` also
    ``(x_test [M * k, d], y_test [M * k])``: ``k`` further records of every client's distribution,
    drawn after (and independently of) the training records, which do not change with ``k``."""
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(dim, generator=g)  # the first draw: linear_regression_target(dim, seed)
    u = torch.randn(num_clients, 1, generator=g) * math.sqrt(0.1)
    m = u + torch.randn(num_clients, dim, generator=g)
    x = (m.unsqueeze(1) + torch.randn(num_clients, samples_per_client, dim, generator=g)).reshape(-1, dim)
    if not test_per_client:
        return x, x @ w_star, w_star
    xt = (m.unsqueeze(1) + torch.randn(num_clients, test_per_client, dim, generator=g)).reshape(-1, dim)
    return x, x @ w_star, w_star, xt, xt @ w_star


class SyntheticLinearRegression(FederatedDataModule):
    """Paper 002's synthetic linear regression clients (see :func:`linear_regression_problem`),
    ``samples_per_client`` records each (the paper does not say how many; 20 by default). The global
    test set is fresh records of every client's distribution."""

    test_set_from_clients = False

    def __init__(self, num_clients: int = 1000, samples_per_client: int = 20, dim: int = 100, seed: int = 0) -> None:
        super().__init__(num_clients=num_clients, partition="natural", seed=seed, eval_batch_size=4096)
        self.samples_per_client, self.dim = samples_per_client, dim
        self.records_by_construction = samples_per_client  # every client holds n records: public

    @property
    def w_star(self) -> torch.Tensor:
        return linear_regression_problem(self.num_clients, self.samples_per_client, self.dim, self.seed)[2]

    def load(self):
        x, y, _, xt, yt = linear_regression_problem(self.num_clients, self.samples_per_client, self.dim, self.seed,
                                                    test_per_client=2)
        n = self.samples_per_client
        clients = [torch.arange(c * n, (c + 1) * n) for c in range(self.num_clients)]
        return TensorDataset(x, y), TensorDataset(xt, yt), clients
