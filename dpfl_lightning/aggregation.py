"""The aggregation of a round: every client's payload row, one exact all-reduce, named sums.

The trainer asks for a row per client (:meth:`PayloadAggregator.row`), lets the plugins fill it,
and :meth:`PayloadAggregator.reduce` sums the rows of every rank segment by segment -- exactly and
in any order with :class:`~dpfl_lightning.comm.ExactSum`, so the result does not depend on the
number of ranks.
"""

from __future__ import annotations

import torch

from dpfl_lightning.comm import Communicator, ExactSum, FloatSum
from dpfl_lightning.errors import NonFiniteUpdateError
from dpfl_lightning.payload import PayloadLayout


class PayloadAggregator:
    """Rows of this rank's clients for one round, and their sum over all ranks."""

    def __init__(self, layout: PayloadLayout, device: torch.device, exact: bool = True) -> None:
        self.layout = layout
        self.device = device
        self.sum = ExactSum() if exact else FloatSum()
        self._rows = torch.empty(0, layout.size, device=device)
        self._views: list[dict[str, torch.Tensor]] = []
        self._segments = [layout.offsets[name] for name in layout.names]

    def start(self, num_clients: int) -> None:
        """A new round with ``num_clients`` clients on this rank."""
        if self._rows.shape[0] < num_clients:
            self._rows = torch.empty(num_clients, self.layout.size, device=self.device)
            self._views = [self.layout.views(r) for r in self._rows]
        self._count = num_clients
        d = self.layout.offsets["update"][1]  # the update is the first segment; the others start at 0
        if self.layout.size > d:
            self._rows[:num_clients, d:].zero_()
        self.checked = [s.name for s in self.layout.segments if s.source != "control"]  # the trainer's own flags are finite

    def row(self, k: int) -> torch.Tensor:
        """The ``k``-th client's row."""
        return self._rows[k]

    def views(self, k: int) -> dict[str, torch.Tensor]:
        """The ``k``-th client's segments by name."""
        return self._views[k]

    def update_view(self, k: int) -> torch.Tensor:
        return self._views[k]["update"]

    def reduce(self, cohort_size: int, comm: Communicator) -> dict[str, torch.Tensor]:
        """Sum the round's rows over every rank; the sums by segment name (float64)."""
        try:
            total = self.sum(self._rows[: self._count], self._segments, cohort_size, comm)
        except FloatingPointError as exc:
            raise NonFiniteUpdateError("a non-finite value reached the aggregation (a plugin wrote NaN/inf after "
                                       "the finite check); nothing of this round was applied. Fix: check the "
                                       "plugins' settings") from exc
        return self.layout.views(total)
