"""Optimised strategies: banded matrix factorization and Buffered Linear Toeplitz (BLT).

Both minimise the workload's total squared error ``sens^2 ||A C^{-1}||_F^2`` (scale-invariant in
``C``; see :mod:`dpfl_lightning.privacy.matrix_factorization`) for a Toeplitz workload, in float64
with torch's L-BFGS (strong Wolfe line search) on ``log`` of the error. ``C^{-1}`` of a
lower-triangular Toeplitz ``C`` is Toeplitz; its first column comes from one triangular solve
(``O(T^2)``), and ``A C^{-1}`` is Toeplitz with the convolution of the two first columns, whose
Frobenius norm is ``sum_t (T - t) b_t^2``.

- :func:`banded`: ``C`` lower-triangular Toeplitz with ``b`` bands, columns of norm ``<= 1`` (the
  first ``T - b + 1`` exactly 1). Under min-separation ``b`` its columns ``b`` apart do not overlap,
  so ``sens^2 = max_S sum_{i in S} ||C_i||^2 = k`` for ``k`` participations whatever the
  coefficients (Choquette-Choo et al., NeurIPS 2023, Thm 2): the optimum depends on ``(A, T, b)``
  only, and the amplified variant (Poisson sampling inside the round's group) uses the same ``C``.
  Optimised over the Toeplitz band (``b`` numbers), a restriction of the paper's general banded
  ``C`` that McKenna (2024, "Scaling up the banded matrix factorization mechanism") reports loses
  little; initialised at the coefficients of ``(1 - x)^{-1/2}`` (the optimal infinite Toeplitz
  factor of the prefix sum).
- :func:`blt`: ``C = BLT(theta, omega)``: ``c_0 = 1``, ``c_t = sum_i omega_i theta_i^(t-1)`` (Dvijotham
  et al. 2024; McMahan, Xu, Zhang 2024), with ``theta_i in (0, 1)``, ``omega_i > 0``, ``sum omega <
  1``, so the coefficients are positive and decreasing and the sensitivity under min-separation
  ``b`` is the earliest cyclic pattern's, ``||sum_{l<k} C[:, l b]||`` (exact, see
  :mod:`dpfl_lightning.privacy.mf_sensitivity`, checked again on the result). Optimised for the
  participation pattern. Its noise is generated from ``buffers`` running sums.

- :func:`tree_height`: the restart period of online tree aggregation (:func:`~dpfl_lightning.privacy.
  matrix_factorization.tree`, a tree every ``2**height`` rounds) with the least error for the
  workload under the participation pattern, over every height from 0 (a leaf per round: independent
  noise) to one tree: under multiple participations one tree's sensitivity grows with the
  participations inside it (Choquette-Choo et al., ICML 2023, "Multi-Epoch Matrix Factorization"),
  and restarts trade that against the noise of the restarted prefixes.

Results are cached on disk (``cache_dir``) as JSON keyed by the workload, ``T`` and the parameters,
written atomically (temporary file + ``os.replace``); in a multi-rank run rank 0 computes and the
others read after a barrier (the caller's wiring).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time

import torch

from dpfl_lightning.privacy.matrix_factorization import (F64, Strategy, Workload, convolve, toeplitz,
                                                         toeplitz_inverse_coeffs, total_squared_error, tree)

__all__ = ["banded", "blt", "blt_coeffs", "toeplitz_error", "tree_height", "tree_errors"]

_CACHE_VERSION = 1


def toeplitz_error(c: torch.Tensor, workload: Workload) -> torch.Tensor:
    """``||A C^{-1}||_F^2`` for ``C = toeplitz(c)`` (``c``: ``[T]``), differentiable in ``c``."""
    T = workload.T
    b = convolve(workload.coeffs, toeplitz_inverse_coeffs(c), T)
    return ((T - torch.arange(T, dtype=F64)) * b * b).sum()


def banded(workload: Workload, b: int, *, cache_dir: str | None = None, max_iter: int = 200) -> Strategy:
    """The ``b``-banded Toeplitz ``C`` minimising ``||A C^{-1}||_F^2`` with unit column norms."""
    T = workload.T
    if not isinstance(b, int) or not 1 <= b <= T:
        raise ValueError(f"banded b={b!r}: give the number of bands, an integer in [1, T={T}] (b=1 is "
                         "independent noise; b=T a full lower-triangular Toeplitz C)")
    key = f"banded-v{_CACHE_VERSION}-{workload.name}-T{T}-b{b}"
    found, seconds = _cached(cache_dir, key, lambda: _optimise_banded(workload, b, max_iter))
    c = torch.tensor(found["c"], dtype=F64)
    full = torch.zeros(T, dtype=F64)
    full[:b] = c
    return _toeplitz_strategy("banded", full, {"b": b, "coeffs": c, "workload": workload.name,
                                               "optimise_seconds": seconds})


def _optimise_banded(workload: Workload, b: int, max_iter: int) -> dict:
    init = torch.ones(b, dtype=F64)
    for s in range(1, b):
        init[s] = init[s - 1] * (2 * s - 1) / (2 * s)
    x = (init / init.norm()).clone().requires_grad_(True)

    def loss():
        full = torch.zeros(workload.T, dtype=F64)
        full[:b] = x / x.norm()
        return torch.log(toeplitz_error(full, workload))

    _lbfgs(x, loss, max_iter)
    c = (x / x.norm()).detach()
    return {"c": [float(v) for v in c]}


def blt_coeffs(theta: torch.Tensor, omega: torch.Tensor, T: int) -> torch.Tensor:
    """First column of ``BLT(theta, omega)``: ``[1, sum omega, sum omega theta, ...]`` (length T)."""
    t = torch.arange(max(T - 1, 0), dtype=F64)
    tail = (omega[None, :] * theta[None, :] ** t[:, None]).sum(1)
    return torch.cat([torch.ones(1, dtype=F64), tail])


def blt(workload: Workload, buffers: int = 4, *, min_sep: int | None = None, max_participations: int | None = None,
        cache_dir: str | None = None, max_iter: int = 300) -> Strategy:
    """The BLT with ``buffers`` buffers minimising ``sens^2 ||A C^{-1}||_F^2`` for participations
    ``min_sep`` apart (default ``T``: single), at most ``max_participations`` (default
    ``ceil(T / min_sep)``)."""
    T = workload.T
    if not isinstance(buffers, int) or not 1 <= buffers <= 16:
        raise ValueError(f"blt buffers={buffers!r}: give an integer in [1, 16] (the papers use 2-6)")
    sep = T if min_sep is None else min_sep
    if not isinstance(sep, int) or sep < 1:
        raise ValueError(f"blt min_sep={min_sep!r}: give an integer >= 1, or None for single participation")
    k = -(-T // sep) if max_participations is None else min(int(max_participations), -(-T // sep))
    key = f"blt-v{_CACHE_VERSION}-{workload.name}-T{T}-n{buffers}-sep{sep}-k{k}"
    found, seconds = _cached(cache_dir, key, lambda: _optimise_blt(workload, buffers, sep, k, max_iter))
    theta, omega = torch.tensor(found["theta"], dtype=F64), torch.tensor(found["omega"], dtype=F64)
    return _toeplitz_strategy("blt", blt_coeffs(theta, omega, T),
                              {"theta": theta, "omega": omega, "buffers": buffers, "min_sep": sep,
                               "max_participations": k, "workload": workload.name, "optimise_seconds": seconds})


def _optimise_blt(workload: Workload, n: int, sep: int, k: int, max_iter: int) -> dict:
    T = workload.T
    one_minus = torch.tensor([T ** (-(i + 1) / n) for i in range(n)], dtype=F64).clamp(max=0.5)
    x = torch.cat([torch.logit(1.0 - one_minus), torch.zeros(n, dtype=F64), torch.zeros(1, dtype=F64)])
    x = x.clone().requires_grad_(True)
    comb = torch.zeros(T, dtype=F64)
    comb[torch.arange(0, T, sep)[:k]] = 1.0

    def params(z):
        return torch.sigmoid(z[:n]), torch.sigmoid(z[-1]) * torch.softmax(z[n:2 * n], 0)

    def loss():
        c = blt_coeffs(*params(x), T)
        worst = convolve(c, comb, T)  # the columns 0, sep, 2 sep, ... summed
        return torch.log(toeplitz_error(c, workload)) + torch.log((worst * worst).sum())

    _lbfgs(x, loss, max_iter)
    theta, omega = (p.detach() for p in params(x))
    return {"theta": [float(v) for v in theta], "omega": [float(v) for v in omega]}


def _lbfgs(x: torch.Tensor, loss, max_iter: int) -> None:
    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-13,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = loss()
        value.backward()
        return value

    opt.step(closure)
    if not torch.isfinite(x).all():
        raise FloatingPointError("the factorization's optimisation diverged; report T and the parameters")


def tree_errors(workload: Workload, min_sep: int, max_participations: int, *,
                cache_dir: str | None = None) -> list[float]:
    """``sens^2 ||A L||_F^2`` (:func:`~dpfl_lightning.privacy.matrix_factorization.total_squared_error`)
    of the tree restarted every ``2**h`` rounds, for ``h = 0 .. ceil(log2 T)`` (the last: one tree),
    under participations ``min_sep`` apart, at most ``max_participations``; computed from each
    strategy's ``C`` (its exact sensitivity) and ``L``, and cached."""
    T = workload.T
    top = max(0, math.ceil(math.log2(T)))
    sep = min(int(min_sep), T)
    k = min(int(max_participations), -(-T // sep))
    key = f"tree-v{_CACHE_VERSION}-{workload.name}-T{T}-sep{sep}-k{k}"
    found, _ = _cached(cache_dir, key, lambda: {"errors": [total_squared_error(tree(T, h), workload, sep, k)
                                                           for h in range(top + 1)]})
    return [float(e) for e in found["errors"]]


def tree_height(workload: Workload, min_sep: int, max_participations: int, *, cache_dir: str | None = None) -> int:
    """The restart height with the least :func:`tree_errors` (the lowest on a tie): never worse than
    independent noise (``h = 0``) nor than one tree (the largest ``h``). T = 64 rounds, 16
    participations 4 apart, prefix sums: height 3, root-mean-square prefix-sum error 15.63 per unit
    ``z``, against 31.72 for one tree and 22.80 for independent noise."""
    errors = tree_errors(workload, min_sep, max_participations, cache_dir=cache_dir)
    return min(range(len(errors)), key=lambda h: (errors[h], h))


def _toeplitz_strategy(kind: str, c: torch.Tensor, params: dict) -> Strategy:
    T = c.numel()
    return Strategy(kind, toeplitz(c), toeplitz(toeplitz_inverse_coeffs(c)), (1,) * T, params)


def _cached(cache_dir: str | None, key: str, compute) -> tuple[dict, float]:
    """(the result, seconds spent computing it: 0.0 when read from the cache)."""
    path = None if cache_dir is None else os.path.join(cache_dir, key + ".json")
    if path is not None and os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        if stored.get("key") == key:
            return stored["value"], 0.0
    start = time.perf_counter()
    value = compute()
    seconds = time.perf_counter() - start
    if not all(math.isfinite(v) for vs in value.values() for v in vs):
        raise FloatingPointError(f"{key}: the optimised factor is not finite")
    if path is not None:
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-" + key)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": value}, f)
        os.replace(tmp, path)
    return value, seconds
