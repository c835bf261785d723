"""Sum the rows of every rank so that the result does not depend on the number of ranks.

A float all-reduce rounds differently for every summation order, so ``mpiexec -n 1`` and ``-n 2``
would drift apart. :class:`ExactSum` first rounds every contribution onto one grid ``2**L`` shared
by all ranks, chosen so that no sum of contributions can need more than float64's 53 significant
bits. Then every float64 addition is exact, so any summation order -- within a rank, across ranks,
inside MPI or NCCL -- gives the same bits:

1. each rank takes the largest magnitude of its rows, per segment (the update vector is one
   segment, each extra scalar column its own); one ``MAX`` all-reduce of these few numbers makes
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

from dpfl_lightning.comm.base import Communicator


def grid_exponent(max_abs: float, n_rows: int) -> int:
    """``L`` of the module docstring, for values up to ``max_abs`` summed over ``n_rows`` rows."""
    if max_abs == 0.0:
        return 0
    _, e = math.frexp(max_abs)  # max_abs < 2**e
    return e + math.ceil(math.log2(max(n_rows, 1))) - 51


class ExactSum:
    """Order-independent sum of per-client rows across ranks (see module docstring)."""

    exact = True

    def __call__(
        self,
        rows: torch.Tensor,
        extras: torch.Tensor,
        n_rows_total: int,
        comm: Communicator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum ``rows`` (``[k, d]``) and ``extras`` (``[k, e]``) over all ranks.

        Returns float64 tensors of shape ``[d]`` and ``[e]``, identical on every rank for any
        split of the ``n_rows_total`` rows over ranks and any order.
        """
        d, e = rows.shape[1], extras.shape[1]
        device = rows.device
        maxes = torch.zeros(1 + e, dtype=torch.float64, device=device)
        if rows.shape[0] > 0:
            maxes[0] = rows.abs().amax().double()
            maxes[1:] = extras.abs().amax(dim=0).double()
        comm.allreduce_max_(maxes)
        maxes_host = maxes.tolist()
        if not all(math.isfinite(m) for m in maxes_host):
            raise FloatingPointError("a non-finite value reached the aggregation")
        magic = torch.tensor([1.5 * 2.0 ** (grid_exponent(m, n_rows_total) + 52) for m in maxes_host],
                             dtype=torch.float64, device=device)
        total = torch.zeros(d + e, dtype=torch.float64, device=device)
        if rows.shape[0] > 0:
            x = rows.to(torch.float64, copy=True)
            total[:d] = x.add_(magic[0]).sub_(magic[0]).sum(dim=0)
            if e:
                y = extras.to(torch.float64, copy=True)
                total[d:] = y.add_(magic[1:]).sub_(magic[1:]).sum(dim=0)
        comm.allreduce_sum_(total)
        return total[:d], total[d:]


class FloatSum:
    """Plain float64 sum: one all-reduce, reproducible across rank counts only to rounding.

    Use it where exactness is not needed and ``[k, d]`` int64 temporaries would not fit.
    """

    exact = False

    def __call__(
        self,
        rows: torch.Tensor,
        extras: torch.Tensor,
        n_rows_total: int,
        comm: Communicator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = rows.shape[1]
        acc = torch.zeros(d + extras.shape[1], dtype=torch.float64, device=rows.device)
        if rows.shape[0] > 0:
            acc[:d] = rows.double().sum(dim=0)
            acc[d:] = extras.double().sum(dim=0)
        comm.allreduce_sum_(acc)
        return acc[:d], acc[d:]
