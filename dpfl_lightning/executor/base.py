"""How a rank trains its share of a round's cohort: the executor interface.

The trainer hands an executor a :class:`RoundWork`: the module, the data, the round plan, the
clients of this rank, the run's random source, where each client's update goes, and three
callbacks that open a client's context (running the plugins' ``on_client_start``) and build the
per-step hook and optimizer wrapper of the plugins. The executor trains each client as the plan
says and yields it as soon as its update is written, so the trainer can process (bound, noise,
aggregate) one client while the next one trains. Executors never see plugins or the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from dpfl_lightning import rng
from dpfl_lightning.module import ClientRun
from dpfl_lightning.plan import batch_shape

if TYPE_CHECKING:
    from dpfl_lightning.contexts import ClientContext
    from dpfl_lightning.data.module import FederatedDataModule
    from dpfl_lightning.module import FederatedLightningModule
    from dpfl_lightning.plan import RoundPlan


@dataclass
class RoundWork:
    """One round of one rank: train ``clients`` as ``plan`` says; the update of the ``k``-th client
    (local model minus global model) goes into ``out(k)``. An executor that computes several
    clients' updates at once may ask ``out_rows(n)`` for one ``[n, d]`` tensor to write them into
    instead: its ``j``-th row is then the update of the ``j``-th of the next ``n`` clients it yields
    (``None`` when the trainer has no such block free; then ``out(k)`` per client)."""

    module: FederatedLightningModule
    data: FederatedDataModule
    plan: RoundPlan
    clients: list[int]
    random: rng.RandomSource
    out: Callable[[int], torch.Tensor]
    open_client: Callable[[int], ClientContext]
    step_hook: Callable[[ClientContext], Callable[[torch.optim.Optimizer], None] | None]
    optimizer_wrapper: Callable[[ClientContext], Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None]
    out_rows: Callable[[int], torch.Tensor | None] = lambda n: None

    def batches(self, client: int) -> Iterator[tuple[int, int, Any]]:
        """The client's ``(epoch, batch_idx, batch)`` stream under the plan: shuffles from the
        client's DATA stream, DP-SGD's independent batches from its RECORD_SAMPLING stream."""
        plan = self.plan
        purpose = rng.DATA if plan.batch_sampling == "shuffle" else rng.RECORD_SAMPLING
        stream = self.random.stream(plan.round_idx, client, purpose)
        return self.data.client_batches(client, plan.batch_size, epochs=plan.local_epochs, steps=plan.local_steps,
                                        stream=stream, sampling=plan.batch_sampling)

    def local_batches(self, client: int) -> tuple[int, int]:
        """``(batches this round, batches per local epoch)`` of ``client`` under the plan: where its
        learning-rate schedule and ``global_step`` stand (see :mod:`dpfl_lightning.lightning_compat`)."""
        n = self.data.client_num_samples(client)
        return self.plan.steps_for(n), batch_shape(n, self.plan.batch_size)[1]


class Executor:
    """Train a rank's clients of one round (see the module docstring)."""

    name = "executor"

    def setup(self, module: FederatedLightningModule, data: FederatedDataModule, changes_local_steps: list[str]) -> None:
        """Refuse, with the reason, what this executor cannot run. ``changes_local_steps`` names the
        plugins that wrap optimizers or change gradients inside local steps."""

    def train(self, work: RoundWork) -> Iterator[tuple[int, ClientContext, ClientRun]]:
        """Yield ``(k, context, run)`` for every client of ``work`` once ``work.out(k)`` holds its update."""
        raise NotImplementedError
