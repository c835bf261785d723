"""Sum the rows of every rank so that the result does not depend on the number of ranks.

A float all-reduce rounds differently for every summation order, so ``mpiexec -n 1`` and ``-n 2``
would drift apart. :class:`ExactSum` first rounds every contribution onto one grid ``2**L`` shared
by all ranks, chosen so that no sum of contributions can need more than float64's 53 significant
bits. Then every float64 addition is exact, so any summation order -- within a rank, across ranks,
inside MPI or NCCL -- gives the same bits:

1. each rank takes the largest magnitude of its rows, per payload segment (the update is one
   segment, each extra vector or scalar its own); one ``MAX`` all-reduce of these few numbers makes
   them global;
2. with ``max < 2**e`` and ``n`` rows in total, ``L = e + ceil(log2 n) - 51``, so that
   ``n * max < 2**(L + 51)``: every partial sum is a multiple of ``2**L`` below ``2**(L + 53)``;
3. each value is rounded to the grid with the exact float64 trick ``(x + K) - K``,
   ``K = 1.5 * 2**(L + 52)`` (round to nearest, ties to even: a function of the value alone);
4. the rows are summed in float64 and one ``SUM`` all-reduce adds the ranks.

The rounding error is at most ``2**(L-1) < max * n * 2**-51`` per value: for 1000 clients, 2^-41
of the largest contribution, far below float32 resolution. Cost: one float64 copy of the rows
and two in-place additions, ~3x a plain float sum.
"""

from __future__ import annotations

import math

import torch

from dpfl_lightning.comm.communicator import Communicator


def grid_exponent(max_abs: float, n_rows: int, headroom_bits: int = 0) -> int:
    """``L`` of the module docstring, for values up to ``max_abs`` summed over ``n_rows`` rows, with
    ``headroom_bits`` more (values may then exceed ``max_abs`` ``2^headroom_bits``-fold). A zero
    bound gets a tiny grid whose scale ``2^-L`` still fits a float64."""
    _, e = math.frexp(max(max_abs, 2.0**-900))  # max_abs < 2**e
    return e + math.ceil(math.log2(max(n_rows, 1))) - 51 + headroom_bits


class ExactSum:
    """Order-independent sum of per-client rows across ranks (see module docstring)."""

    exact = True

    def __call__(self, rows: torch.Tensor, segments: list[tuple[int, int]], n_rows_total: int,
                 comm: Communicator) -> torch.Tensor:
        """Sum ``rows`` (``[k, D]``) over all ranks, each segment ``(start, end)`` of the columns on
        its own grid. Returns float64 ``[D]``, identical on every rank for any split of the
        ``n_rows_total`` rows over ranks and any order."""
        total = self.grid_sum(rows, segments, n_rows_total, comm)
        comm.allreduce_sum_(total)
        return total

    def grid_sum(self, rows: torch.Tensor, segments: list[tuple[int, int]], n_rows_total: int,
                 comm: Communicator) -> torch.Tensor:
        """This rank's sum of ``rows`` on the grid every rank agrees on (steps 1-3 of the module
        docstring; one ``MAX`` all-reduce): adding the ranks' results in any order is exact."""
        k, width = rows.shape
        device = rows.device
        maxes = torch.zeros(len(segments), dtype=torch.float64, device=device)
        if k > 0:
            for i, (a, b) in enumerate(segments):
                maxes[i] = rows[:, a:b].abs().amax().double()
        comm.allreduce_max_(maxes)
        maxes_host = maxes.tolist()
        if not all(math.isfinite(m) for m in maxes_host):
            raise FloatingPointError("a non-finite value reached the aggregation")
        total = torch.zeros(width, dtype=torch.float64, device=device)
        if k > 0:
            x = rows.to(torch.float64, copy=True)
            for (a, b), m in zip(segments, maxes_host):
                magic = 1.5 * 2.0 ** (grid_exponent(m, n_rows_total) + 52)
                x[:, a:b].add_(magic).sub_(magic)
            torch.sum(x, dim=0, out=total)
        return total


class FloatSum:
    """Plain float64 sum: one all-reduce, reproducible across rank counts only to rounding."""

    exact = False

    def __call__(self, rows: torch.Tensor, segments: list[tuple[int, int]], n_rows_total: int,
                 comm: Communicator) -> torch.Tensor:
        total = rows.double().sum(dim=0) if rows.shape[0] else torch.zeros(rows.shape[1], dtype=torch.float64,
                                                                            device=rows.device)
        comm.allreduce_sum_(total)
        return total
