"""L2 sensitivity of a matrix-factorization mechanism ``C g + Z`` under a participation pattern.

One client's contribution is a set ``S`` of rounds (its participations) with a vector ``u_i``,
``||u_i|| <= 1`` (the clipped update), in each. The mechanism releases ``C g + Z``, so the
sensitivity is ``max_S max_u ||sum_{i in S} C[:, i] u_i^T||_F`` and, with ``M = C^T C``,

    sens^2 = max_S max_u  sum_{i, j in S} M[i, j] <u_i, u_j>.

The participation patterns: any ``S`` whose rounds are pairwise at least ``min_sep`` apart, with at
most ``max_participations`` of them (``min_sep=T`` is single participation; cyclic participation in
``b`` groups is ``min_sep=b``, ``max_participations=ceil(T / b)``).

When ``M >= 0`` entrywise the inner maximum puts every ``u_i`` on one unit vector, so
``sens^2 = max_S 1_S^T M 1_S`` (Choquette-Choo et al., "Multi-Epoch Matrix Factorization", ICML
2023, and "(Amplified) Banded Matrix Factorization", NeurIPS 2023). That maximum over sets is hard
in general; :func:`sensitivity_details` uses an exact method for each structure this package builds:

- ``column-norms``: ``M[i, j] = 0`` whenever ``|i - j| >= min_sep`` (a ``b``-banded ``C`` under
  min-separation ``b``): cross terms vanish for any signs, so ``sens^2`` is the largest sum of
  squared column norms over allowed sets -- a dynamic programme (exact, any sign).
- ``monotone``: ``G(i, delta) = M[i, i + delta]`` non-increasing in ``i`` and in ``delta`` (a Toeplitz
  ``C`` with non-negative, non-increasing coefficients: BLTs, the identity). Moving the ``l``-th
  participation to round ``l * min_sep`` lowers every index and every gap, so no term decreases:
  the earliest cyclic set ``{0, b, 2b, ...}`` is a maximiser (exact).
- ``intervals``: every row of ``C`` is ``w * 1[a..z]`` and the intervals are nested or disjoint
  (tree aggregation, with restarts): ``||C 1_S||^2 = sum_rows w^2 |S & row|^2``, maximised by a
  dynamic programme over the interval tree (exact).
- ``enumeration``: few allowed sets (small ``T``): all of them are tried (exact).
- ``upper-bound``: otherwise, or when ``M`` has negative entries (where equal ``u_i`` need not be the
  worst case), a bound that is safe for privacy (``|M|``'s row-wise maxima); ``exact=False`` says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Sensitivity", "sensitivity", "sensitivity_details", "max_participations_for"]

_NEG = -np.inf
_ENUMERATION_LIMIT = 200_000


@dataclass(frozen=True)
class Sensitivity:
    """``value``: the L2 sensitivity (not squared); ``exact``: False for a safe upper bound;
    ``method``: which of the module's methods produced it."""

    value: float
    exact: bool
    method: str


def max_participations_for(T: int, min_sep: int) -> int:
    """The most rounds out of ``T`` that are pairwise ``min_sep`` apart: ``ceil(T / min_sep)``."""
    return -(-T // min_sep)


def sensitivity(C, min_sep: int, max_participations: int | None = None) -> float:
    """The L2 sensitivity of ``C`` (``[m, T]``) for one client taking part in at most
    ``max_participations`` rounds (default ``ceil(T / min_sep)``), pairwise ``min_sep`` apart.
    Exact for the structures named in the module docstring, otherwise a safe upper bound: use
    :func:`sensitivity_details` to know which."""
    return sensitivity_details(C, min_sep, max_participations).value


def sensitivity_details(C, min_sep: int, max_participations: int | None = None) -> Sensitivity:
    """:func:`sensitivity` with how it was computed (see the module docstring)."""
    C = _as_matrix(C)
    T = C.shape[1]
    b, k = _check_pattern(T, min_sep, max_participations)
    M = C.T @ C
    scale = max(float(np.abs(M).max()), 1e-300)
    tol = 1e-12 * scale
    if _band_limited(M, b, tol):
        return Sensitivity(math.sqrt(max(_best_separable(np.diag(M).copy(), b, k), 0.0)), True, "column-norms")
    if M.min() < -tol:
        return Sensitivity(math.sqrt(_upper_bound(np.abs(M), b, k)), False, "upper-bound")
    if k == 1:
        return Sensitivity(math.sqrt(float(np.diag(M).max())), True, "single")
    if _monotone(M, tol):
        s = np.arange(0, T, b)[:k]
        return Sensitivity(math.sqrt(float(M[np.ix_(s, s)].sum())), True, "monotone")
    intervals = _intervals(C)
    if intervals is not None:
        return Sensitivity(math.sqrt(_interval_dp(intervals, T, b, k)), True, "intervals")
    if T <= 64 and _count_sets(T, b, k) <= _ENUMERATION_LIMIT:
        return Sensitivity(math.sqrt(_enumerate(M, b, k)), True, "enumeration")
    return Sensitivity(math.sqrt(_upper_bound(M, b, k)), False, "upper-bound")


def _as_matrix(C) -> np.ndarray:
    if isinstance(C, torch.Tensor):
        C = C.detach().to(torch.float64).cpu().numpy()
    C = np.asarray(C, dtype=np.float64)
    if C.ndim != 2 or C.shape[1] == 0 or not np.isfinite(C).all():
        raise ValueError(f"sensitivity: C must be a finite [rows, T] matrix, got shape {C.shape}; pass the "
                         "strategy's C (rows: noise rows, columns: rounds)")
    return C


def _check_pattern(T: int, min_sep, max_participations) -> tuple[int, int]:
    if not isinstance(min_sep, int) or min_sep < 1:
        raise ValueError(f"min_sep={min_sep!r}: give an integer >= 1 (1 = every round, T = single participation)")
    cap = max_participations_for(T, min_sep)
    if max_participations is None:
        return min_sep, cap
    if not isinstance(max_participations, int) or max_participations < 1:
        raise ValueError(f"max_participations={max_participations!r}: give an integer >= 1, or None for "
                         f"ceil(T / min_sep) = {cap}")
    return min_sep, min(max_participations, cap)


def _band_limited(M: np.ndarray, b: int, tol: float) -> bool:
    far = np.abs(np.subtract.outer(np.arange(M.shape[0]), np.arange(M.shape[0]))) >= b
    return bool((np.abs(M[far]) <= tol).all())


def _monotone(M: np.ndarray, tol: float) -> bool:
    """G(i, d) = M[i, i + d] non-increasing in i (along diagonals) and in d (along rows)."""
    T = M.shape[0]
    upper = np.triu(np.ones((T, T), dtype=bool))
    down_diag = (M[1:, 1:] - M[:-1, :-1])[upper[1:, 1:]]
    along_row = (M[:, 1:] - M[:, :-1])[upper[:, :-1]]
    return bool((down_diag <= tol).all() and (along_row <= tol).all())


def _best_separable(w: np.ndarray, b: int, k: int) -> float:
    """max sum_{i in S} w_i over sets with separation >= b and |S| <= k."""
    return float(_separable_at(w[None, :], b, k, np.zeros(1, dtype=int))[0, k])


def _separable_at(W: np.ndarray, b: int, k: int, at: np.ndarray) -> np.ndarray:
    """out[r, j]: max of sum W[r, S] over S within [at[r], T), separation >= b, |S| <= j (rows
    vectorised; a ring of the last b + 1 positions keeps the memory at O(rows * b * k))."""
    R, T = W.shape
    out = np.zeros((R, k + 1))
    ring = np.zeros((b + 1, R, k + 1))  # ring[t % (b + 1)]: the table for sets within [t, T)
    for t in range(T - 1, -1, -1):
        nxt, far = ring[(t + 1) % (b + 1)], ring[(t + b) % (b + 1)]
        cur = nxt.copy()
        cur[:, 1:] = np.maximum(nxt[:, 1:], W[:, t, None] + far[:, :-1])
        ring[t % (b + 1)] = cur
        rows = np.flatnonzero(at == t)
        out[rows] = cur[rows]
    return out


def _upper_bound(M: np.ndarray, b: int, k: int) -> float:
    """sum_{i in S} sum_{j in S} M_ij <= sum_{i in S} R_i with R_i the best row sum over allowed sets
    containing i (M >= 0 here, |M| for signed M); then the best allowed set for the weights R."""
    T = M.shape[0]
    i = np.arange(T)
    after = _separable_at(M, b, k, np.minimum(i + b, T))[:, :k]  # rounds >= i + b, at most k - 1
    before = _separable_at(M[:, ::-1].copy(), b, k, np.minimum(T - 1 - i + b, T))[:, :k]  # rounds <= i - b
    R = np.diag(M) + (before + after[:, ::-1]).max(axis=1)
    return _best_separable(R, b, k)


def _count_sets(T: int, b: int, k: int) -> int:
    count = [[1] * (k + 1) for _ in range(T + b + 1)]  # count[t][j]: sets within [t, T) of size <= j
    for t in range(T - 1, -1, -1):
        count[t] = [1] + [count[t + 1][j] + count[t + b][j - 1] for j in range(1, k + 1)]
    return count[0][k]


def _enumerate(M: np.ndarray, b: int, k: int) -> float:
    T = M.shape[0]
    best = 0.0

    def walk(start: int, chosen: list[int], value: float) -> None:
        nonlocal best
        best = max(best, value)
        if len(chosen) == k:
            return
        for t in range(start, T):
            walk(t + b, chosen + [t], value + M[t, t] + 2.0 * float(M[t, chosen].sum()))

    walk(0, [], 0.0)
    return best


def _intervals(C: np.ndarray):
    """Rows as (start, stop, w^2) when each is w * an indicator of a contiguous interval and the
    intervals form a laminar family; else None."""
    rows = {}
    for row in C:
        nz = np.flatnonzero(row)
        if len(nz) == 0:
            continue
        a, z = int(nz[0]), int(nz[-1]) + 1
        if len(nz) != z - a or not np.allclose(row[a:z], row[a], rtol=1e-12, atol=0):
            return None
        rows[(a, z)] = rows.get((a, z), 0.0) + float(row[a]) ** 2
    spans = sorted(rows, key=lambda s: (s[0], -s[1]))
    stack: list[tuple[int, int]] = []
    for a, z in spans:
        while stack and stack[-1][1] <= a:
            stack.pop()
        if stack and z > stack[-1][1]:
            return None  # crosses an enclosing interval
        stack.append((a, z))
    return rows


def _interval_dp(rows: dict, T: int, b: int, k: int) -> float:
    """Exact max over allowed S of sum_rows w^2 |S & row|^2 by a DP over the interval tree. A
    summary of a segment: V[c - 1, f, g] = best value with c >= 1 chosen rounds, the first f rounds
    after its start and the last g rounds before its end (both capped at b - 1); empty is value 0."""
    cap = b - 1
    spans = sorted(rows, key=lambda s: (s[0], -s[1]))
    children: dict = {(0, T): []}
    parent_stack = [(0, T)]
    for span in spans:
        if span == (0, T):
            continue
        while not (parent_stack[-1][0] <= span[0] and span[1] <= parent_stack[-1][1]):
            parent_stack.pop()
        children[parent_stack[-1]].append(span)
        children.setdefault(span, [])
        parent_stack.append(span)

    def solve(span):
        a, z = span
        parts, pos = [], a
        for child in children[span]:
            parts += [_leaf(cap) for _ in range(pos, child[0])] + [solve(child)]
            pos = child[1]
        parts += [_leaf(cap) for _ in range(pos, z)]
        n, V = parts[0]
        for part in parts[1:]:
            n, V = _combine((n, V), part, b, k)
        c = np.arange(1, V.shape[0] + 1, dtype=np.float64)
        return n, V + rows.get(span, 0.0) * (c ** 2)[:, None, None]

    _, V = solve((0, T))
    return float(max(0.0, V.max()))


def _leaf(cap: int):
    V = np.full((1, cap + 1, cap + 1), _NEG)
    V[0, 0, 0] = 0.0
    return 1, V


def _combine(left, right, b: int, k: int):
    (nL, VL), (nR, VR) = left, right
    cap = b - 1
    kL, kR = VL.shape[0], VR.shape[0]
    kmax = min(k, kL + kR, -(-(nL + nR) // b))
    V = np.full((kmax, cap + 1, cap + 1), _NEG)
    g_shift = np.minimum(np.arange(cap + 1) + nR, cap)  # left's g seen from the new end
    f_shift = np.minimum(np.arange(cap + 1) + nL, cap)  # right's f seen from the new start
    a, c = min(kL, kmax), min(kR, kmax)
    for g1 in range(cap + 1):  # only the left side chooses
        V[:a, :, g_shift[g1]] = np.maximum(V[:a, :, g_shift[g1]], VL[:a, :, g1])
    for f2 in range(cap + 1):  # only the right side chooses
        V[:c, f_shift[f2], :] = np.maximum(V[:c, f_shift[f2], :], VR[:c, f2, :])
    # both sides non-empty: the last of the left and the first of the right are g1 + f2 + 1 apart
    suffix = np.maximum.accumulate(VR[:, ::-1, :], axis=1)[:, ::-1, :]  # max over f2 >= x
    need = np.maximum(cap - np.arange(cap + 1), 0)  # smallest f2 allowed for each g1
    right_ok = suffix[:, need, :]  # [kR, g1, g2]
    for c1 in range(min(kL, kmax - 1)):
        both = VL[c1][:, :, None, None] + right_ok.transpose(1, 0, 2)[None, :, :, :]  # [f1, g1, c2, g2]
        best = both.max(axis=1)  # [f1, c2, g2]
        top = min(kR, kmax - c1 - 1)
        V[c1 + 1: c1 + 1 + top] = np.maximum(V[c1 + 1: c1 + 1 + top], best[:, :top, :].transpose(1, 0, 2))
    return nL + nR, V
