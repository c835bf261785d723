"""The aggregation sum does not depend on how rows are split over ranks or ordered."""

import pytest
import torch

from dpfl_lightning.comm import ExactSum, FloatSum, LocalCommunicator
from dpfl_lightning.comm.communicator import Communicator


class SimulatedRanks(Communicator):
    """The collectives of several simulated ranks: the maximum is the global one; each rank's sum
    is captured so that the test can add the ranks' parts in any order (MPI may)."""

    def __init__(self, global_max):
        self.global_max = global_max
        self.partial = []

    def allreduce_max_(self, tensor):
        tensor.copy_(self.global_max)
        return tensor

    def allreduce_sum_(self, tensor):
        self.partial.append(tensor.clone())
        return tensor


def _split_sum(rows, segments, splits, order):
    """Sum rows as if ``splits`` were the ranks' shares, adding the ranks' partial sums in ``order``."""
    global_max = torch.stack([rows[:, a:b].abs().amax().double() for a, b in segments])
    ranks = SimulatedRanks(global_max)
    for idx in splits:
        ExactSum()(rows[idx], segments, rows.shape[0], ranks)
    total = torch.zeros_like(ranks.partial[0])
    for k in order:
        total += ranks.partial[k]
    return total


SEGMENTS = [(0, 1001), (1001, 1002), (1002, 1005)]


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e6])
def test_any_split_and_order_gives_identical_bits(scale):
    g = torch.Generator().manual_seed(0)
    rows = torch.cat([torch.randn(37, 1001, generator=g) * scale * torch.logspace(-6, 0, 1001),
                      torch.rand(37, 1, generator=g) * 100, torch.randn(37, 3, generator=g) * 1e-4], dim=1).float()
    one = _split_sum(rows, SEGMENTS, [torch.arange(37)], [0])
    perm = torch.randperm(37, generator=g)
    for splits, order in [([perm[:10], perm[10:]], [1, 0]),
                          ([perm[:5], perm[5:20], perm[20:]], [2, 0, 1]),
                          ([perm[i::4] for i in range(4)], [3, 1, 2, 0])]:
        assert torch.equal(_split_sum(rows, SEGMENTS, splits, order), one)
    # and it is the sum, to far below float32 resolution, in every segment
    ref = rows.double().sum(0)
    for a, b in SEGMENTS:
        assert ((one[a:b] - ref[a:b]).abs() <= 1e-12 * rows[:, a:b].abs().max().double() * 37).all()


def test_values_of_wide_range_in_one_column():
    # 1, 2^-53, 2^-53: a float64 sum gives 1 or 1 + 2^-52 depending on the order
    rows = torch.tensor([[1.0], [2.0**-53], [2.0**-53]], dtype=torch.float32)
    assert (1.0 + 2.0**-53) + 2.0**-53 != 1.0 + (2.0**-53 + 2.0**-53)  # the order matters naively
    a = _split_sum(rows, [(0, 1)], [torch.tensor([0]), torch.tensor([1, 2])], [0, 1])
    b = _split_sum(rows, [(0, 1)], [torch.tensor([0, 1]), torch.tensor([2])], [1, 0])
    c = _split_sum(rows, [(0, 1)], [torch.tensor([2]), torch.tensor([1]), torch.tensor([0])], [0, 1, 2])
    assert torch.equal(a, b) and torch.equal(b, c)
    assert abs(a.item() - (1.0 + 2.0**-52)) <= 2.0**-45  # within the grid's resolution of the exact sum


def test_float_sum_matches():
    rows = torch.randn(8, 100)
    s = FloatSum()(rows, [(0, 100)], 8, LocalCommunicator())
    assert torch.allclose(s, rows.double().sum(0))


def test_empty_rank_and_zeros():
    s = ExactSum()(torch.zeros(0, 5), [(0, 4), (4, 5)], 3, LocalCommunicator())
    assert s.shape == (5,) and torch.count_nonzero(s) == 0
    s = ExactSum()(torch.zeros(3, 5), [(0, 4), (4, 5)], 3, LocalCommunicator())
    assert torch.count_nonzero(s) == 0


def test_non_finite_is_refused():
    rows = torch.ones(2, 3)
    rows[1, 1] = float("nan")
    with pytest.raises(FloatingPointError):
        ExactSum()(rows, [(0, 3)], 2, LocalCommunicator())
