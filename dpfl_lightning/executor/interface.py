"""How a rank trains its share of a round's cohort: the executor interface.

The trainer hands an executor a :class:`RoundWork`: the module, the data, the round plan, the
clients of this rank, the run's random source, the client hooks (which open a client's context,
running the plugins' ``on_client_start``, and build the plugins' per-step hook and optimizer
wrapper) and where update rows may be taken from. The executor trains each client as the plan says
and yields a :class:`TrainedClient` as soon as its update is written, so the client can be
processed (bound, noise, aggregate) while the next one trains. Executors never see plugins or the
trainer, and call nothing of either: a client's update flows one way, out of the executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch

from dpfl_lightning import rng
from dpfl_lightning.module import ClientRun

if TYPE_CHECKING:
    from dpfl_lightning.plugins.contexts import ClientContext
    from dpfl_lightning.data.module import FederatedDataModule
    from dpfl_lightning.module import FederatedLightningModule
    from dpfl_lightning.federated.plan import RoundPlan


class ClientHooks(Protocol):
    """What an executor calls around a client's local training (the run's client phase gives it)."""

    def open(self, client: int) -> ClientContext: ...

    def step_hook(self, ctx: ClientContext) -> Callable[[torch.optim.Optimizer], None] | None: ...

    def optimizer_wrapper(self, ctx: ClientContext) -> Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None: ...


@dataclass
class TrainedClient:
    """One trained client: its ``position`` in :attr:`RoundWork.clients`, its context, what its local
    training did, and ``update`` (local minus global model, ``[d]``)."""

    position: int
    context: ClientContext
    run: ClientRun
    update: torch.Tensor

    @property
    def client(self) -> int:
        return self.context.client


@dataclass
class RoundWork:
    """One round of one rank: train ``clients`` as ``plan`` says. ``rows(n)`` offers one ``[n, d]``
    block of the aggregator's next rows to train into (``None`` when it has no such block free): an
    executor that takes it yields the clients of rows ``0 .. n-1`` in that order with ``update`` the
    row, and the aggregator takes each row without a copy; any other ``update`` tensor is copied."""

    module: FederatedLightningModule
    data: FederatedDataModule
    plan: RoundPlan
    clients: list[int]
    random: rng.RandomSource
    hooks: ClientHooks
    rows: Callable[[int], torch.Tensor | None] = lambda n: None

    def batches(self, client: int) -> Iterator[tuple[int, int, Any]]:
        """The client's ``(epoch, batch_idx, batch)`` stream under the plan: shuffles from the
        client's DATA stream, DP-SGD's independent batches from its RECORD_SAMPLING stream."""
        plan = self.plan
        purpose = rng.DATA if plan.batch_sampling == "shuffle" else rng.RECORD_SAMPLING
        stream = self.random.stream(plan.round_idx, client, purpose)
        return self.data.client_batches(client, plan.batch_size, epochs=plan.local_epochs, steps=plan.local_steps,
                                        stream=stream, sampling=plan.batch_sampling, records=plan.records_per_client)

    def local_batches(self, client: int) -> tuple[int, int]:
        """``(batches this round, batches per local epoch)`` of ``client`` under the plan: where its
        learning-rate schedule and ``global_step`` stand (see :mod:`dpfl_lightning.lightning.semantics`)."""
        n = self.data.client_num_samples(client)
        return self.plan.steps_for(n), self.plan.epoch_batches(n)


class Executor:
    """Train a rank's clients of one round (see the module docstring)."""

    name = "executor"

    def setup(self, module: FederatedLightningModule, data: FederatedDataModule, changes_local_steps: list[str]) -> None:
        """Refuse, with the reason, what this executor cannot run. ``changes_local_steps`` names the
        plugins that wrap optimizers or change gradients inside local steps."""

    def train(self, work: RoundWork) -> Iterator[TrainedClient]:
        """Yield a :class:`TrainedClient` for every client of ``work`` once its update is written."""
        raise NotImplementedError
