"""The aggregation sum does not depend on how rows are split over ranks or ordered."""

import pytest
import torch

from dpfl_lightning.comm import ExactSum, FloatSum, LocalCommunicator
from dpfl_lightning.comm.base import Communicator


class SimulatedRanks(Communicator):
    """Runs the collectives of several simulated ranks: each rank's call is recorded, then the
    reduction is computed over all of them in a given order (MPI may add in any order)."""

    def __init__(self, parts_max, order):
        self.parts_max = parts_max
        self.order = order

    def allreduce_max_(self, tensor):
        tensor.copy_(torch.stack(self.parts_max).amax(0))
        return tensor


def _split_sum(rows, extras, splits, order):
    """Sum rows as if ``splits`` were the ranks' shares, adding the ranks' partial sums in ``order``."""
    n = rows.shape[0]
    maxes = []
    for idx in splits:
        r, e = rows[idx], extras[idx]
        maxes.append(torch.cat([r.abs().amax().reshape(1).double(), e.abs().amax(0).double()]))
    partial = []

    class Capture(SimulatedRanks):
        def allreduce_sum_(self, tensor):
            partial.append(tensor.clone())
            return tensor

    cap = Capture(maxes, order)
    for idx in splits:
        ExactSum()(rows[idx], extras[idx], n, cap)
    total = torch.zeros_like(partial[0])
    for k in order:
        total += partial[k]
    d = rows.shape[1]
    return total[:d], total[d:]


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e6])
def test_any_split_and_order_gives_identical_bits(scale):
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(37, 1001, generator=g) * scale * torch.logspace(-6, 0, 1001)).float()
    extras = torch.rand(37, 3, generator=g, dtype=torch.float64) * 100
    one, one_e = _split_sum(rows, extras, [torch.arange(37)], [0])
    perm = torch.randperm(37, generator=g)
    for splits, order in [([perm[:10], perm[10:]], [1, 0]),
                          ([perm[:5], perm[5:20], perm[20:]], [2, 0, 1]),
                          ([perm[i::4] for i in range(4)], [3, 1, 2, 0])]:
        s, e = _split_sum(rows, extras, splits, order)
        assert torch.equal(s, one)
        assert torch.equal(e, one_e)
    # and it is the sum, to far below float32 resolution
    ref = rows.double().sum(0)
    assert ((one - ref).abs() <= 1e-12 * rows.abs().max().double() * 37).all()
    assert torch.allclose(one_e, extras.sum(0), rtol=1e-12)


def test_float_sum_matches_but_is_not_exact():
    rows = torch.randn(8, 100)
    extras = torch.ones(8, 1, dtype=torch.float64)
    s, e = FloatSum()(rows, extras, 8, LocalCommunicator())
    assert torch.allclose(s, rows.double().sum(0))
    assert e.item() == 8.0


def test_empty_rank_and_zeros():
    s, e = ExactSum()(torch.zeros(0, 5), torch.zeros(0, 2, dtype=torch.float64), 3, LocalCommunicator())
    assert torch.count_nonzero(s) == 0 and torch.count_nonzero(e) == 0
    s, _ = ExactSum()(torch.zeros(3, 5), torch.zeros(3, 1, dtype=torch.float64), 3, LocalCommunicator())
    assert torch.count_nonzero(s) == 0


def test_non_finite_is_refused():
    rows = torch.ones(2, 3)
    rows[1, 1] = float("nan")
    with pytest.raises(FloatingPointError):
        ExactSum()(rows, torch.zeros(2, 1, dtype=torch.float64), 2, LocalCommunicator())
