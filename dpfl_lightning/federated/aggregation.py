"""The aggregation of a round: each client's payload row folded into one per-rank sum as soon as its
plugins are done, then one all-reduce; the sums by segment name, exact and in any order.

A round with frozen parameters sums the trainable entries of the update only (``restrict``): a
client's row and the all-reduce carry ``d_t`` update values, not ``d``.

Streaming (memory O(d) per rank, whatever the number of clients per rank): every segment whose
values have a bound declared before the round (:meth:`FederatedCallback.value_bound`: clipping and
normalization bound the update by ``C``, noise widens it by a Gaussian tail, a flag is 0 or 1) is
summed on a grid fixed in advance. With ``|x| <= B`` for every value and ``n`` clients in the round,
the grid ``2^L`` with ``L = e + ceil(log2 n) - 51 + H`` (``B < 2^e``, ``H = 8`` bits of headroom)
keeps every partial sum a multiple of ``2^L`` below ``2^(L + 53)`` even if values exceed the bound
256-fold. Each value is scaled by ``2^-L`` (exact: a power of two) and rounded to an integer (ties to
even: a function of the value alone); the integers are summed in float64, exactly, so the sum does
not depend on the order or on how clients are split over ranks; the total is scaled back by
``2^L``. Three passes over a row: scale and round in float32 (both exact there), add in float64.
The rounding error is at most ``2^(L - 1) <= B n 2^-42`` per value: for 1000 clients
``2.3e-10 B``, far below float32's resolution of the bound (``6e-8 B``).

A segment with no declared bound (FedAvg without clipping, raw statistics) falls back to the
two-pass method of :class:`~dpfl_lightning.comm.ExactSum` (its rows are kept for the round, then a
``MAX`` all-reduce fixes the grid): memory O(clients x segment size) for that segment.
``exact=False`` sums in plain float64 (reproducible across rank counts only to rounding).
"""

from __future__ import annotations

import math

import torch

from dpfl_lightning.comm import Communicator
from dpfl_lightning.comm.exact_sum import ExactSum, grid_exponent
from dpfl_lightning.errors import NonFiniteUpdateError, require
from dpfl_lightning.federated.payload import UPDATE, PayloadLayout

HEADROOM_BITS = 8
STAGE_BYTES = 16 << 20  # rows staged before a fold: a few clients at once, at most 16 MiB
FOLD_COLUMNS = 1 << 20  # columns rounded per pass on a GPU: float32 scratch of at most 4 MiB per staged row
# On a CPU, columns per pass: as many as give FOLD_TILE_BYTES of scratch for all staged rows, which
# stay in the core's cache between the three passes (scale, round, add); but at least
# FOLD_MIN_COLUMNS, so a small model with many staged rows is not cut into many short passes.
FOLD_TILE_BYTES, FOLD_MIN_COLUMNS = 1 << 19, 1 << 14


class PayloadAggregator:
    """This rank's running sum of its clients' payload rows, and the sum over all ranks.

    Rows are staged a few at a time (as many as fit in :data:`STAGE_BYTES`, at least one) and folded
    together: the same exact sum, with fewer tensor operations per client for small models."""

    def __init__(self, layout: PayloadLayout, device: torch.device, exact: bool = True) -> None:
        self.full_layout = layout  # the update at the length of the flat parameters
        self.layout = layout  # a client's row: the update's trainable entries only (see restrict)
        self.device = device
        self.exact = exact
        self._trainable: torch.Tensor | None = None  # the round's trainable mask (None: all)
        self._index: torch.Tensor | None = None  # its entries' positions in the flat parameters
        self._full: torch.Tensor | None = None  # the update sum at full length, zero at frozen entries
        self._started: tuple[int, dict[str, float | None]] | None = None
        self._taken = False
        self.streamed: list[str] = []
        self.kept: list[str] = []
        self._allocate()

    def _allocate(self) -> None:
        """The staging rows, the rank's sum and the fold's scratch, for :attr:`layout`."""
        layout, device = self.layout, self.device
        capacity = max(1, min(64, STAGE_BYTES // (4 * layout.size)))
        self._stage = torch.zeros(capacity, layout.size, device=device)
        self._stage_views = [layout.views(r) for r in self._stage]
        self._staged = 0
        self._acc = torch.zeros(layout.size, dtype=torch.float64, device=device)
        width = FOLD_COLUMNS if self._stage.device.type != "cpu" else \
            max(FOLD_TILE_BYTES // (4 * capacity), FOLD_MIN_COLUMNS)
        self._tmp = torch.zeros(capacity, min(layout.size, width), dtype=self._stage.dtype, device=device)
        self.checked = [s.name for s in layout.segments if s.source != "control"]  # the trainer's own flags are finite

    def restrict(self, trainable: torch.Tensor | None) -> None:
        """The round's trainable parameters (``RoundPlan.trainable``: a bool mask over the flat
        parameters, ``None`` when all train), before its first client is taken. A client's row then
        holds the trainable entries of its update only (what is bounded, noised and all-reduced);
        :meth:`reduce` gives the update sum at full length, zero at the frozen entries. A trainable
        set that changes between rounds (a layer unfrozen) re-lays the rows out for the round."""
        if trainable is None and self._trainable is None:
            return
        if trainable is not None and self._trainable is not None and torch.equal(trainable, self._trainable):
            return
        if self._taken:
            raise RuntimeError("PayloadAggregator.restrict: a client of this round was already taken")
        d = self.full_layout.offsets[UPDATE][1] - self.full_layout.offsets[UPDATE][0]
        if trainable is not None:
            require(trainable.shape == (d,) and trainable.dtype == torch.bool, "RoundPlan.trainable",
                    tuple(trainable.shape), f"must be a bool mask over the {d} flat parameters (or None)",
                    "leave the plan's mask as the trainer set it")
            count = int(trainable.sum())
            require(count > 0, "model", "every parameter frozen", "a round needs a trainable parameter to update",
                    "unfreeze a layer (requires_grad=True) before the round, or stop training")
        self._trainable = None if trainable is None else trainable.clone()
        self._index = None if trainable is None else trainable.nonzero().squeeze(1)
        self.layout = self.full_layout if trainable is None else self.full_layout.resized(UPDATE, count)
        self._full = None if trainable is None else torch.zeros(d, dtype=torch.float64, device=self.device)
        self._allocate()
        if self._started is not None:
            self.start(*self._started)

    def _tmp64(self) -> torch.Tensor:
        """float64 scratch, for a grid whose power of two float32 cannot hold (bounds below ~1e-30)."""
        if self._tmp.dtype != torch.float64:
            self._tmp = self._tmp.double()
        return self._tmp

    def start(self, cohort_size: int, bounds: dict[str, float | None]) -> None:
        """A new round of ``cohort_size`` clients (all ranks), with the declared value bounds."""
        self._n = cohort_size
        self._started, self._taken = (cohort_size, bounds), False
        self._acc.zero_()
        self._staged = 0
        self._zero_tails(self._stage.shape[0])
        self._scales: list[tuple[int, int, int]] = []  # (start, end, L) of every streamed segment
        self._kept_rows: dict[str, list[torch.Tensor]] = {}
        self.streamed, self.kept = [], []
        for seg in self.layout.segments:
            a, b = self.layout.offsets[seg.name]
            bound = bounds.get(seg.name)
            if not self.exact:
                self.streamed.append(seg.name)
            elif bound is not None and math.isfinite(bound):
                self._scales.append((a, b, grid_exponent(bound, cohort_size, HEADROOM_BITS)))
                self.streamed.append(seg.name)
            else:
                self._kept_rows[seg.name] = []
                self.kept.append(seg.name)

    def notes(self) -> list[str]:
        """What the user should know about this round's aggregation."""
        if "update" in self.kept:
            return ["exact aggregation: no bound is declared for the update (no clipping or normalization), so "
                    "each round keeps this rank's client updates (memory: clients x parameters) to fix a common grid; "
                    "bound the update or set trainer.exact_aggregation=false to stream"]
        return []

    def _zero_tails(self, rows: int) -> None:
        """Zero the segments after the update (the first segment) of the first ``rows`` staged rows,
        all at once: each row is handed out once between two folds of the stage."""
        d = self.layout.offsets["update"][1]
        if self.layout.size > d:
            self._stage[:rows, d:].zero_()

    def client_views(self) -> dict[str, torch.Tensor]:
        """The current client's segments by name: the update the executor wrote into
        :attr:`update_out`, the other segments zeroed for the plugins to fill. The row is reused
        after :meth:`fold`: keep a clone of anything needed later."""
        return self._stage_views[self._staged]

    def update_rows(self, n: int) -> torch.Tensor | None:
        """The update segments of the next ``n`` staged rows as one ``[n, d]`` view (the clients
        finished next, in order, own them), or ``None`` if fewer than ``n`` rows are free before
        the stage is folded, or when the rows hold the trainable entries only (:meth:`restrict`: the
        executor's full update is then gathered by :meth:`take`)."""
        if self._index is not None or self._staged + n > self._stage.shape[0]:
            return None
        return self._stage[self._staged : self._staged + n, : self.layout.offsets["update"][1]]

    @property
    def update_out(self) -> torch.Tensor:
        return self._stage_views[self._staged]["update"]

    def take(self, update: torch.Tensor) -> None:
        """The current client's update into the current row: no copy when ``update`` is that row (an
        executor trained into it, see :meth:`update_rows`); another staged row is refused, since it
        holds a client not yet folded. With frozen parameters (:meth:`restrict`) ``update`` is at full
        length and its trainable entries are gathered into the row (one ``index_select``)."""
        self._taken = True
        out = self.update_out
        if update.data_ptr() == out.data_ptr() and update.shape == out.shape:
            return
        start, size = self._stage.data_ptr(), self._stage.numel() * self._stage.element_size()
        if start <= update.data_ptr() < start + size:
            raise RuntimeError("an executor yielded a client whose update sits in another client's row: it must yield "
                               "the clients of a block of update_rows(n) in row order")
        if self._index is not None:
            torch.index_select(update, 0, self._index, out=out)
        else:
            out.copy_(update)

    @property
    def row(self) -> torch.Tensor:
        return self._stage[self._staged]

    def fold(self) -> None:
        """Add the current client's row to this rank's sum."""
        self._staged += 1
        if self._staged == self._stage.shape[0]:
            self._flush()

    def _flush(self) -> None:
        k = self._staged
        if k == 0:
            return
        rows = self._stage[:k]
        if not self.exact:
            self._acc.add_(rows.double().sum(0))
        else:
            # in units of each segment's grid, rounded to integers: exact, a function of the value
            # alone; sums of these integers in any order are exact (columns in blocks, to bound the
            # scratch). A power-of-two scale within float32's range is exact in float32 already.
            width = self._tmp.shape[1]
            for a, b, L in self._scales:
                scale = 2.0**-L
                # A float32 value times a power of two within float32's normal range is exact in
                # float32, and so is its rounding (below 2^23 the integer fits; above, the value
                # is one already): the same integers as in float64, with half the memory traffic.
                # The integers are summed in float64, where they stay exact.
                tmp = self._tmp if -126 < -L < 127 else self._tmp64()
                for lo in range(a, b, width):
                    hi = min(lo + width, b)
                    part = tmp[:k, : hi - lo]
                    if part.dtype == rows.dtype:
                        torch.mul(rows[:, lo:hi], scale, out=part)
                    else:
                        part.copy_(rows[:, lo:hi]).mul_(scale)
                    part.round_()
                    _add_rows(self._acc[lo:hi], part)
            for name, parts in self._kept_rows.items():
                a, b = self.layout.offsets[name]
                parts.append(rows[:, a:b].clone())
        self._zero_tails(k)
        self._staged = 0

    def reduce(self, comm: Communicator) -> dict[str, torch.Tensor]:
        """Sum over every rank (every rank calls this); the sums by segment name (float64)."""
        self._flush()
        try:
            if self.kept:  # segments without a bound: the two-pass method on their kept rows
                sizes = [self.layout.segment(name).size for name in self.kept]
                rows = torch.cat([torch.cat(self._kept_rows[n], dim=0) if self._kept_rows[n]
                                  else torch.zeros(0, size, device=self.device) for n, size in zip(self.kept, sizes)], dim=1)
                spans, start = [], 0
                for size in sizes:
                    spans.append((start, start + size))
                    start += size
                kept_sum = ExactSum().grid_sum(rows, spans, self._n, comm)  # every rank raises alike
                for name, (a, b) in zip(self.kept, spans):
                    lo, hi = self.layout.offsets[name]
                    self._acc[lo:hi] = kept_sum[a:b]
        except FloatingPointError as exc:
            raise NonFiniteUpdateError("a non-finite value reached the aggregation (a plugin wrote NaN/inf after "
                                       "the finite check); nothing of this round was applied. Fix: check the "
                                       "plugins' settings") from exc
        if self.exact:
            for a, b, L in self._scales:  # from grid units back to values: exact (a power of two), and
                # A sum beyond 2^53 grid units means values far above their declared bound (the
                # headroom is 2^8): it would no longer be exact. Below 2^53 / ranks on every rank, any
                # order of adding the ranks stays exact; else this rank's sum is poisoned with a NaN,
                # which the all-reduce carries to every rank, so all of them refuse the round alike.
                if b > a and not _max_abs(self._acc[a:b]) < 2.0**53 / max(comm.size, 1):
                    self._acc[a] = math.nan
                self._acc[a:b].mul_(2.0**L)  # multiples of 2^L below 2^(L+53) add exactly across ranks
        comm.allreduce_sum_(self._acc)  # in place: the sums are the round's until the next start()
        self._taken = False
        if self.exact:
            for a, b, L in self._scales:  # the total, identical on every rank, within the exact range?
                if b > a and not _max_abs(self._acc[a:b]) < 2.0 ** (L + 53):
                    name = next(s.name for s in self.layout.segments if self.layout.offsets[s.name] == (a, b))
                    raise NonFiniteUpdateError(
                        f"payload segment {name!r}: its sum is not finite or beyond the exact range, so a plugin "
                        f"wrote NaN/inf after the finite check or values far above the bound it declared "
                        f"(value_bound); nothing of this round was applied. Fix: make the plugins' value_bound "
                        f"cover what they write, or set trainer.exact_aggregation=false")
        sums = self.layout.views(self._acc)
        if self._index is not None:  # the update sum at full length: zero at the frozen entries
            sums[UPDATE] = self._full.zero_().index_copy_(0, self._index, sums[UPDATE])
        return sums


_SUM_COLUMNS = 1 << 16  # columns per converting column sum in _add_rows


def _add_rows(acc: torch.Tensor, rows: torch.Tensor) -> None:
    """``acc += rows.sum(0)`` in ``acc``'s float64, for rows of integers whose partial sums are exact
    there (so any order gives the same bits). Many rows: converting column sums of at most 64k
    columns (~1.7x faster than row by row on 50 x 14k); few rows: row by row (a converting sum
    over one long block is 2-3x slower)."""
    if rows.shape[0] < 8:
        for row in rows:
            acc.add_(row)
        return
    for lo in range(0, rows.shape[1], _SUM_COLUMNS):
        acc[lo : lo + _SUM_COLUMNS].add_(rows[:, lo : lo + _SUM_COLUMNS].sum(0, dtype=acc.dtype))


def _max_abs(x: torch.Tensor) -> float:
    """``max |x|`` without a temporary the size of ``x``; NaN if ``x`` holds one."""
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi)) if not (math.isnan(float(lo)) or math.isnan(float(hi))) else math.nan
