"""FederatedCallback: the base of every plugin, a set of typed no-op hooks.

The trainer calls the hooks of its plugins in ``order`` (lowest first; equal orders keep list
order). A round runs:

``before_round`` (may stop training) -> ``on_round_start`` -> for each client of this rank: ``on_client_start``, local training (with
``on_before_optimizer_step`` before every local optimizer step), ``on_client_end`` -> one
all-reduce of the rank's sums -> ``on_aggregate`` -> ``on_server_update`` -> evaluation ->
``on_round_end``.

Hooks take keyword arguments only, so a plugin can accept the ones it needs and ``**kwargs``.
Anything a plugin keeps across rounds goes in :meth:`state_dict` so checkpoints can restore it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dpfl_lightning.module import FederatedLightningModule
    from dpfl_lightning.privacy.events import Mechanism
    from dpfl_lightning.trainer import FederatedTrainer

# Where a plugin runs relative to the others. Sensitivity must be bounded before noise is added,
# and noise must be added before anything leaves the client or reaches the server optimizer.
ORDER_LOCAL_TRAINING = 40  # plugins that change how clients train (DP-SGD)
ORDER_BOUND_SENSITIVITY = 100
ORDER_ADD_NOISE = 200
ORDER_SERVER_OPTIMIZER = 900


@dataclass
class ClientUpdate:
    """One client's contribution to a round, as the plugins see it in ``on_client_end``.

    ``update`` is the flat update vector (local model minus global model, divided by the client's
    learning rate when the trainer is configured so). Plugins modify it **in place**: it is a row of
    the buffer the trainer aggregates. ``scalars`` holds per-client numbers that are summed over
    the cohort exactly like the update (a plugin lists their names in ``aggregated_scalars``).
    """

    client: int
    round_idx: int
    update: torch.Tensor
    num_samples: int
    steps: int
    lr: float
    scalars: dict[str, float] = field(default_factory=dict)


@dataclass
class Aggregate:
    """The cohort's sums after the all-reduce, identical on every rank.

    ``update_sum`` is float64 ``[d]``; ``denominator`` is what the trainer divides by to get the mean
    update (the cohort size, its expectation under Poisson sampling, or the total weight).
    """

    round_idx: int
    update_sum: torch.Tensor
    scalars: dict[str, float]
    num_clients: int
    denominator: float


class FederatedCallback:
    """Base class of plugins. Every hook is a no-op; override the ones you need."""

    order: int = 500
    #: names of per-client scalars this plugin writes into ``ClientUpdate.scalars``
    aggregated_scalars: tuple[str, ...] = ()

    def configure_model(self, *, trainer: FederatedTrainer, model: Any) -> Any:
        """Before the module is laid out over its flat buffer: return the model to train (the
        given one, or a replacement such as a DP-compatible copy)."""
        return model

    def setup(self, *, trainer: FederatedTrainer, module: FederatedLightningModule) -> None:
        """Once, after the module is on its device and before the first round; validate here."""

    def on_fit_start(self, *, trainer: FederatedTrainer) -> None:
        """Before the first round of this ``fit`` call (also after a resume)."""

    def on_fit_end(self, *, trainer: FederatedTrainer) -> None:
        """After the last round."""

    def before_round(self, *, trainer: FederatedTrainer, round_idx: int, cohort: list[int]) -> None:
        """Before anything of the round happens; call ``trainer.stop(reason)`` to end training here
        (e.g. the privacy budget would be exceeded). Every rank sees the same cohort."""

    def on_round_start(self, *, trainer: FederatedTrainer, round_idx: int, cohort: list[int]) -> None:
        """A round begins; ``cohort`` is every sampled client (all ranks see the same list)."""

    def on_client_start(self, *, trainer: FederatedTrainer, client: int, round_idx: int) -> None:
        """This rank starts training ``client``; the module holds the global model."""

    def on_before_optimizer_step(
        self, *, trainer: FederatedTrainer, client: int, optimizer: torch.optim.Optimizer
    ) -> None:
        """Gradients of one local step are ready; a plugin may change them (control variates)."""

    def wrap_optimizer(self, *, trainer: FederatedTrainer, client: int, round_idx: int,
                       optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Each client's fresh local optimizer passes through here (DP-SGD wraps it)."""
        return optimizer

    def on_client_end(self, *, trainer: FederatedTrainer, result: ClientUpdate) -> None:
        """The client finished; modify ``result.update`` in place (clip, normalize, local noise)."""

    def on_aggregate(self, *, trainer: FederatedTrainer, aggregate: Aggregate) -> None:
        """The cohort's sums are known; modify ``aggregate.update_sum`` in place (central noise)."""

    def on_server_update(self, *, trainer: FederatedTrainer, update: torch.Tensor, aggregate: Aggregate) -> None:
        """``update`` is the mean update (float64); scale it in place (global step sizes) or apply it
        (server optimizer)."""

    def on_round_end(self, *, trainer: FederatedTrainer, round_idx: int, metrics: dict[str, float]) -> None:
        """The round is over; add to ``metrics`` what should be logged."""

    def privacy_mechanism(self, *, trainer: FederatedTrainer) -> Mechanism | None:
        """The DP mechanism this plugin runs every round, for the privacy ledger (after ``setup``).
        Every plugin that releases a noisy statistic declares it here."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state but the checkpoint has {sorted(state)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"
