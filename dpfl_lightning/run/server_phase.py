"""The server phase of a round: the all-reduce of every rank's sums, the non-finite policy,
``on_aggregate`` (central noise), the mean update, the plugins' ``on_server_update`` (step sizes,
control variates) and the one server step that moves the global model."""

from __future__ import annotations

import math
from typing import Any

import torch

from dpfl_lightning.federated.aggregation import PayloadAggregator
from dpfl_lightning.comm import Communicator
from dpfl_lightning.plugins.contexts import ServerContext
from dpfl_lightning.errors import NonFiniteUpdateError
from dpfl_lightning.federated.payload import Aggregate
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.plugins.server_optimizer import ServerOptimizer
from dpfl_lightning.run.hooks import HookTable


class ServerPhase:
    """Every rank runs it alike on the same sums."""

    def __init__(self, hooks: HookTable, aggregator: PayloadAggregator, comm: Communicator, denominator: Any,
                 private: bool, show_notes: bool) -> None:
        self.hooks, self.aggregator, self.comm = hooks, aggregator, comm
        self.denominator = denominator  # (plan, sums) -> what the update sum is divided by
        self.private = private
        self._show_notes = show_notes
        self._mean: torch.Tensor | None = None
        optimizer = next(p for p in hooks.plugins if isinstance(p, ServerOptimizer))
        at = hooks.plugins.index(optimizer)
        self.optimizer = optimizer
        updates = hooks["on_server_update"]
        self._before_step = [p for p in updates if hooks.plugins.index(p) < at]
        self._after_step = [p for p in updates if hooks.plugins.index(p) > at]

    def aggregate(self, plan: RoundPlan, server: ServerContext, failed: list[int]) -> Aggregate:
        """The cohort's sums (every rank calls this), refused when a client was not finite and the
        policy is ``raise``; then the plugins' ``on_aggregate``."""
        sums = self.aggregator.reduce(self.comm)
        if self._show_notes:
            for note in self.aggregator.notes():
                print(f"note: {note}", flush=True)
            self._show_notes = False
        if "nonfinite" in sums and sums["nonfinite"].item() > 0:
            raise NonFiniteUpdateError(
                f"round {plan.round_idx + 1}: {self._who_failed(failed, int(round(sums['nonfinite'].item())))} produced "
                "a non-finite (NaN/inf) update; nothing of this round was applied. Fix: lower the client learning rate, "
                "check the data, or set trainer.on_nonfinite='skip'")
        skipped = int(round(sums["skipped"].item())) if "skipped" in sums else 0
        server.aggregate = agg = Aggregate(plan.round_idx, sums, len(plan.cohort), self.denominator(plan, sums), skipped)
        self.hooks.call("on_aggregate", server=server)
        return agg

    def mean_update(self, server: ServerContext) -> torch.Tensor:
        """The mean update, into a buffer of its own: the aggregate keeps the (noised) sums that the
        plugins' round-end statistics read (GaussianNoise's snr), and server plugins scale the mean
        in place."""
        agg = server.aggregate
        like = agg.update_sum
        buf = self._mean
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            self._mean = buf = torch.empty_like(like)
        server.update = torch.div(like, agg.denominator, out=buf)
        if not math.isfinite(float(buf.sum())):  # one pass, no temporary: NaN/inf anywhere shows here
            raise NonFiniteUpdateError(f"round {agg.round_idx + 1}: the aggregated update is not finite; nothing "
                                       "was applied. Fix: check the noise settings and the client learning rate")
        return buf

    def step(self, params: torch.Tensor, server: ServerContext) -> None:
        """The plugins' ``on_server_update`` in plugin order around the server optimizer's step,
        which moves ``params`` (the global model) by ``server.update``."""
        for p in self._before_step:
            p.on_server_update(server=server)
        self.optimizer.step(params=params, server=server)
        for p in self._after_step:
            p.on_server_update(server=server)

    def _who_failed(self, failed: list[int], count: int) -> str:
        """The clients of an error message (every rank calls this): by id without DP; in a DP run only
        how many, since which clients took part (and failed) is what the guarantee hides."""
        if self.private:
            return f"{count} client{'' if count == 1 else 's'}"
        return f"client(s) {sorted(c for part in self.comm.allgather_object(failed) for c in part)}"
