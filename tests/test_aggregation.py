"""Streaming exact aggregation: rows folded one by one into a per-rank sum on a grid fixed in
advance from the declared bounds give the same bits for any split over ranks and any order; a
segment with no bound falls back to the two-pass method; memory does not grow with the clients."""

import pytest
import torch

from dpfl_lightning.federated.aggregation import PayloadAggregator
from dpfl_lightning.comm.communicator import Communicator
from dpfl_lightning.federated.payload import PayloadLayout, Segment
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, tiny_data

LAYOUT = PayloadLayout([Segment("update", 500), Segment("norm_sq", 1, "data"), Segment("raw", 3, "data")])


class Ranks(Communicator):
    """Collectives of simulated ranks: maxima are taken over all of them, sums are captured so the
    test adds them in any order."""

    def __init__(self, maxes):
        self.maxes, self.sums = maxes, []

    def allreduce_max_(self, tensor):
        tensor.copy_(self.maxes)
        return tensor

    def allreduce_sum_(self, tensor):
        self.sums.append(tensor.clone())
        return tensor


def _aggregate(rows, splits, order, bounds):
    raw = rows[:, LAYOUT.offsets["raw"][0]:]
    ranks = Ranks(raw.abs().amax().double().reshape(1))
    for idx in splits:
        agg = PayloadAggregator(LAYOUT, torch.device("cpu"))
        agg.start(rows.shape[0], bounds)
        for k in idx:
            views = agg.client_views()
            agg.update_out.copy_(rows[k, :500])
            views["norm_sq"].copy_(rows[k, 500:501])
            views["raw"].copy_(rows[k, 501:])
            agg.fold()
        agg.reduce(ranks)
        assert agg.streamed == ["update", "norm_sq"] and agg.kept == ["raw"]
    total = torch.zeros_like(ranks.sums[0])
    for k in order:
        total += ranks.sums[k]
    return total


@pytest.mark.parametrize("overshoot", [1.0, 100.0])
def test_streamed_sums_are_identical_for_any_split_and_order(overshoot):
    g = torch.Generator().manual_seed(0)
    n = 41
    update = torch.randn(n, 500, generator=g) * torch.logspace(-8, 0, 500)
    update *= (overshoot / update.norm(dim=1, keepdim=True))  # norms = overshoot x the declared bound 1
    rows = torch.cat([update, torch.rand(n, 1, generator=g), torch.randn(n, 3, generator=g) * 1e3], dim=1)
    bounds = {"update": 1.0, "norm_sq": 1.0, "raw": None}
    ref = _aggregate(rows, [range(n)], [0], bounds)
    perm = torch.randperm(n, generator=g).tolist()
    for splits, order in [([perm[:10], perm[10:]], [1, 0]), ([perm[i::3] for i in range(3)], [2, 0, 1]),
                          ([perm[::-1]], [0])]:
        assert torch.equal(_aggregate(rows, splits, order, bounds), ref)
    exact = rows.double().sum(0)
    # the grid of a bounded segment comes from its bound B = 1: each value moves by at most
    # 2^(L-1) <= B n 2^-42, far below float32's resolution of B; the unbounded segment gets the grid
    # of its own maximum
    assert ((ref - exact)[:501].abs() <= n * n * 2.0**-42).all()
    assert ((ref - exact)[501:].abs() <= 1e-12 * rows[:, 501:].abs().max().double() * n).all()


@pytest.mark.parametrize("declared", [1e-6, 0.0])
def test_values_far_above_their_declared_bound_are_refused_not_summed_inexactly(declared):
    # A plugin that declares too small a value_bound would make the fixed grid overflow float64's
    # exact range: the round must fail with the segment's name, not return an inexact sum.
    from dpfl_lightning.errors import NonFiniteUpdateError

    g = torch.Generator().manual_seed(1)
    rows = torch.randn(20, 504, generator=g)
    with pytest.raises(NonFiniteUpdateError, match="'update'.*value_bound"):
        _aggregate(rows, [range(20)], [0], {"update": declared, "norm_sq": 1.0, "raw": None})


def test_a_bounded_run_keeps_no_rows_and_an_unbounded_one_says_so(log_dir):
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=5,
                      plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local")])
    t.fit(TinyClassifier(), tiny_data())
    assert t.aggregator.kept == [] and "update" in t.aggregator.streamed
    free = quiet_trainer(log_dir, rounds=1, clients_per_round=5)  # FedAvg without clipping: no bound
    free.fit(TinyClassifier(), tiny_data())
    assert free.aggregator.kept == ["update"]
    assert any("no bound" in note for note in free.aggregator.notes())


def test_a_sum_beyond_the_exact_range_across_ranks_is_refused_on_every_rank():
    # Each rank's own sum fits the grid's exact range, their total does not: the check must look at
    # the all-reduced total (the same on every rank), so every rank refuses alike instead of one
    # raising while the others wait in the all-reduce.
    from dpfl_lightning.federated.aggregation import HEADROOM_BITS
    from dpfl_lightning.comm.exact_sum import grid_exponent
    from dpfl_lightning.errors import NonFiniteUpdateError

    class FourIdenticalRanks(Communicator):
        def allreduce_max_(self, tensor):
            return tensor

        def allreduce_sum_(self, tensor):
            return tensor.mul_(4)

    layout = PayloadLayout([Segment("update", 8)])
    n, bound = 20, 1.0
    L = grid_exponent(bound, 4 * n, HEADROOM_BITS)
    agg = PayloadAggregator(layout, torch.device("cpu"))
    agg.start(4 * n, {"update": bound})
    for _ in range(n):
        agg.client_views()
        agg.update_out.zero_()[0] = 2.0 ** (L + 52) / n  # this rank's sum: 2^52 grid units, exact
        agg.fold()
    with pytest.raises(NonFiniteUpdateError, match="'update'.*value_bound"):
        agg.reduce(FourIdenticalRanks())


@pytest.mark.parametrize("tile_columns", [None, 24])  # the whole row at once; tiles of 24, 24 and 16 columns
@pytest.mark.parametrize("bound", [1.0, 1e-33])  # a float32 grid scale, and one float32 cannot hold
def test_streamed_sum_is_the_exact_sum_of_values_rounded_to_the_grid(bound, tile_columns, monkeypatch):
    # What the grid promises, computed with Python's exact rationals: every value rounded to the
    # nearest multiple of 2^L (ties to even), then summed. Values sit on ties, far below the grid
    # and far above (where float32 spacing exceeds the grid), for staged and single-row folds.
    from fractions import Fraction

    from dpfl_lightning.federated import aggregation
    from dpfl_lightning.federated.aggregation import HEADROOM_BITS
    from dpfl_lightning.comm.exact_sum import grid_exponent

    class OneRank(Communicator):
        def allreduce_sum_(self, tensor):
            return tensor

    layout = PayloadLayout([Segment("update", 64)])
    n = 9
    L = grid_exponent(bound, n, HEADROOM_BITS)
    g = torch.Generator().manual_seed(3)
    ties = (torch.randint(-2**20, 2**20, (n, 16), generator=g) + 0.5) * 2.0**L  # k + 1/2 grid units
    tiny = torch.randn(n, 16, generator=g) * 2.0 ** (L - 30)
    usual = torch.randn(n, 16, generator=g) * bound / 8
    huge = torch.randn(n, 16, generator=g) * bound * 200  # 200x the bound: within the headroom
    rows = torch.cat([ties, tiny, usual, huge], dim=1).float()
    if tile_columns:
        monkeypatch.setattr(aggregation, "FOLD_TILE_BYTES", 0)
        monkeypatch.setattr(aggregation, "FOLD_MIN_COLUMNS", tile_columns)
    agg = PayloadAggregator(layout, torch.device("cpu"))
    assert agg._tmp.shape[1] == (tile_columns or 64)
    agg.start(n, {"update": bound})
    for k in range(n):
        agg.client_views()
        agg.update_out.copy_(rows[k])
        agg.fold()
        if k == 0:
            agg._flush()  # one row folded alone, the rest staged together
    total = agg.reduce(OneRank())["update"]
    unit = Fraction(2) ** L
    expect = [sum(round(Fraction(float(rows[k, j])) / unit) for k in range(n)) * unit for j in range(64)]
    assert [Fraction(float(v)) for v in total] == expect


def test_an_update_row_is_taken_in_place_copied_or_refused_when_it_holds_another_client():
    from dpfl_lightning.comm import LocalCommunicator

    agg = PayloadAggregator(PayloadLayout([Segment("update", 3, "model")]), torch.device("cpu"))
    agg.start(4, {"update": 1.0})
    block = agg.update_rows(2)  # an executor trains two clients into the next two rows
    block.copy_(torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]))
    with pytest.raises(RuntimeError, match="sits in another client's row"):
        agg.take(block[1])  # the second client's row yielded first
    agg.take(block[0])  # in place: no copy
    agg.fold()
    agg.take(block[1])
    agg.fold()
    agg.take(torch.tensor([1.0, 1.0, 1.0]))  # a tensor of the executor's own: copied into the row
    agg.fold()
    sums = agg.reduce(LocalCommunicator())
    assert torch.allclose(sums["update"], torch.tensor([1.5, 1.7, 1.9], dtype=torch.float64), atol=1e-9)
