"""The aggregation of a round: every client's payload row, one exact all-reduce, named sums.

The trainer asks for a row per client (:meth:`PayloadAggregator.row`), lets the plugins fill it,
and :meth:`PayloadAggregator.reduce` sums the rows of every rank segment by segment -- exactly and
in any order with :class:`~dpfl_lightning.comm.ExactSum`, so the result does not depend on the
number of ranks.
"""

from __future__ import annotations

import torch

from dpfl_lightning.comm import Communicator, ExactSum, FloatSum
from dpfl_lightning.payload import PayloadLayout


class PayloadAggregator:
    """Rows of this rank's clients for one round, and their sum over all ranks."""

    def __init__(self, layout: PayloadLayout, device: torch.device, exact: bool = True) -> None:
        self.layout = layout
        self.device = device
        self.sum = ExactSum() if exact else FloatSum()
        self._rows = torch.empty(0, layout.size, device=device)
        self._segments = [layout.offsets[name] for name in layout.names]

    def start(self, num_clients: int) -> None:
        """A new round with ``num_clients`` clients on this rank."""
        if self._rows.shape[0] < num_clients:
            self._rows = torch.empty(num_clients, self.layout.size, device=self.device)
        self._count = num_clients

    def row(self, k: int) -> torch.Tensor:
        """The ``k``-th client's row (its segments beyond the update are zeroed)."""
        row = self._rows[k]
        d = self.layout.offsets["update"][1]  # the update is the first segment
        if self.layout.size > d:
            row[d:].zero_()
        return row

    def update_view(self, k: int) -> torch.Tensor:
        a, b = self.layout.offsets["update"]
        return self._rows[k, a:b]

    def reduce(self, cohort_size: int, comm: Communicator) -> dict[str, torch.Tensor]:
        """Sum the round's rows over every rank; the sums by segment name (float64)."""
        total = self.sum(self._rows[: self._count], self._segments, cohort_size, comm)
        return self.layout.views(total)
