"""The aggregation of a round: each client's payload row folded into one per-rank sum as soon as its
plugins are done, then one all-reduce; the sums by segment name, exact and in any order.

Streaming (memory O(d) per rank, whatever the number of clients per rank): every segment whose
values have a bound declared before the round (:meth:`FederatedCallback.value_bound`: clipping and
normalization bound the update by ``C``, noise widens it by a Gaussian tail, a flag is 0 or 1) is
summed on a grid fixed in advance. With ``|x| <= B`` for every value and ``n`` clients in the round,
the grid ``2^L`` with ``L = e + ceil(log2 n) - 51 + H`` (``B < 2^e``, ``H = 8`` bits of headroom)
keeps every partial sum a multiple of ``2^L`` below ``2^(L + 53)`` even if values exceed the bound
256-fold; each value is rounded to the grid by the exact float64 trick ``(x + K) - K`` with
``K = 1.5 * 2^(L + 52)``, so every addition is exact and the sum does not depend on the order or on
how clients are split over ranks. The rounding error is at most ``2^(L - 1) <= B n 2^-42`` per value:
for 1000 clients ``2.3e-10 B``, far below float32's resolution of the bound (``6e-8 B``).

A segment with no declared bound (FedAvg without clipping, raw statistics) falls back to the
two-pass method of :class:`~dpfl_lightning.comm.ExactSum` (its rows are kept for the round, then a
``MAX`` all-reduce fixes the grid): memory O(clients x segment size) for that segment.
``exact=False`` sums in plain float64 (reproducible across rank counts only to rounding).
"""

from __future__ import annotations

import math

import torch

from dpfl_lightning.comm import Communicator
from dpfl_lightning.comm.exact_sum import ExactSum
from dpfl_lightning.errors import NonFiniteUpdateError
from dpfl_lightning.payload import PayloadLayout

HEADROOM_BITS = 8


def grid_magic(bound: float, n_rows: int) -> float:
    """``K = 1.5 * 2^(L + 52)`` of the grid for values up to ``bound`` summed over ``n_rows`` rows."""
    _, e = math.frexp(max(bound, 2.0**-1000))  # bound < 2**e
    return 1.5 * 2.0 ** (e + math.ceil(math.log2(max(n_rows, 1))) - 51 + HEADROOM_BITS + 52)


class PayloadAggregator:
    """This rank's running sum of its clients' payload rows, and the sum over all ranks."""

    def __init__(self, layout: PayloadLayout, device: torch.device, exact: bool = True) -> None:
        self.layout = layout
        self.device = device
        self.exact = exact
        self._row = torch.zeros(layout.size, device=device)
        self._views = layout.views(self._row)
        self._acc = torch.zeros(layout.size, dtype=torch.float64, device=device)
        self._tmp = torch.zeros(layout.size, dtype=torch.float64, device=device)
        self.checked = [s.name for s in layout.segments if s.source != "control"]  # the trainer's own flags are finite
        self.streamed: list[str] = []
        self.kept: list[str] = []

    def start(self, cohort_size: int, bounds: dict[str, float | None]) -> None:
        """A new round of ``cohort_size`` clients (all ranks), with the declared value bounds."""
        self._n = cohort_size
        self._acc.zero_()
        self._magic: list[tuple[int, int, float]] = []
        self._kept_rows: dict[str, list[torch.Tensor]] = {}
        self.streamed, self.kept = [], []
        for seg in self.layout.segments:
            a, b = self.layout.offsets[seg.name]
            bound = bounds.get(seg.name)
            if not self.exact:
                self.streamed.append(seg.name)
            elif bound is not None and math.isfinite(bound):
                self._magic.append((a, b, grid_magic(bound, cohort_size)))
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

    def client_views(self) -> dict[str, torch.Tensor]:
        """The current client's segments by name: the update the executor wrote into
        :attr:`update_out`, the other segments zeroed for the plugins to fill. The row is reused for
        the next client after :meth:`fold`: keep a clone of anything needed later."""
        d = self.layout.offsets["update"][1]  # the update is the first segment
        if self.layout.size > d:
            self._row[d:].zero_()
        return self._views

    @property
    def update_out(self) -> torch.Tensor:
        return self._views["update"]

    @property
    def row(self) -> torch.Tensor:
        return self._row

    def fold(self) -> None:
        """Add the current client's row to this rank's sum."""
        row, tmp = self._row, self._tmp
        if not self.exact:
            self._acc.add_(row)
            return
        for a, b, magic in self._magic:
            part = tmp[a:b]
            part.copy_(row[a:b]).add_(magic).sub_(magic)  # onto the grid: exact, a function of the value alone
            self._acc[a:b].add_(part)
        for name, rows in self._kept_rows.items():
            rows.append(self._views[name].clone())

    def reduce(self, comm: Communicator) -> dict[str, torch.Tensor]:
        """Sum over every rank (every rank calls this); the sums by segment name (float64)."""
        try:
            if self.kept:  # segments without a bound: the two-pass method on their kept rows
                width = sum(self._views[name].numel() for name in self.kept)
                rows = torch.stack([torch.cat(parts) for parts in zip(*(self._kept_rows[n] for n in self.kept))]) \
                    if self._kept_rows[self.kept[0]] else torch.zeros(0, width, device=self.device)
                spans, start = [], 0
                for name in self.kept:
                    size = self._views[name].numel()
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
        total = self._acc.clone()
        comm.allreduce_sum_(total)
        return self.layout.views(total)
