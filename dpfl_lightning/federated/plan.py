"""RoundPlan: what a round will train. Plugins may edit it in ``before_round``; the executor trains
exactly what it says and the privacy ledger accounts exactly that."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dpfl_lightning.errors import require

BATCH_SAMPLINGS = ("shuffle", "poisson", "fixed")


def batch_shape(num_samples: int, batch_size: int | None) -> tuple[int, int]:
    """``(records per batch, batches per local epoch)`` of a client with ``num_samples`` records;
    ``batch_size`` ``None`` or 0 is one full batch."""
    bs = num_samples if not batch_size else min(int(batch_size), num_samples)
    return bs, math.ceil(num_samples / bs)


@dataclass
class RoundPlan:
    """One round's work.

    Attributes:
        round_idx: the round (0-based).
        cohort: the sampled clients, sorted (read-only: the accountant assumes the sampler's cohort).
        local_steps / local_epochs: a client's local work (exactly one of them is set).
        batch_size: ``None`` for full-batch steps.
        batch_sampling: ``shuffle`` (passes over the data), or DP-SGD's ``poisson`` / ``fixed``
            (every batch drawn independently, as its accountant assumes).
        lr_factor: the clients' learning rates are multiplied by this (client lr decay).
        trainable: a bool mask over the flat parameters of those trainable when the round starts
            (``None``: all); frozen ones are not part of the round's update (:mod:`dpfl_lightning.federated.frozen`).
        records_per_client: the public number of records per client ``N`` (``trainer.records_per_client``),
            or ``None``. When set, a local epoch is ``ceil(N / batch_size)`` batches for every client
            and DP-SGD samples each record with probability ``batch_size / N``, whatever the client
            holds (:mod:`dpfl_lightning.federated.public_sizes`).
    """

    round_idx: int
    cohort: tuple[int, ...]
    local_steps: int | None = None
    local_epochs: int | None = 1
    batch_size: int | None = 32
    batch_sampling: str = "shuffle"
    lr_factor: float = 1.0
    notes: dict[str, float] = field(default_factory=dict)
    trainable: Any = None
    records_per_client: int | None = None

    def validate(self) -> None:
        require((self.local_steps is None) != (self.local_epochs is None), "RoundPlan.local_steps",
                (self.local_steps, self.local_epochs), "exactly one of local_steps and local_epochs must be set",
                "set one of them in before_round")
        require((self.local_steps or self.local_epochs) >= 1, "RoundPlan.local_steps",
                self.local_steps or self.local_epochs, "must be >= 1", "plan at least one local step")
        require(self.records_per_client is None or self.records_per_client >= 1, "RoundPlan.records_per_client",
                self.records_per_client, "must be >= 1 or None", "plan a public number of records per client")
        require(self.batch_sampling in BATCH_SAMPLINGS, "RoundPlan.batch_sampling", self.batch_sampling,
                "unknown batch sampling", f"use one of {BATCH_SAMPLINGS}")

    def epoch_batches(self, num_samples: int) -> int:
        """Batches per local epoch of a client with ``num_samples`` records: those of
        ``records_per_client`` records when it is set (the same for every client)."""
        return batch_shape(self.records_per_client or num_samples, self.batch_size)[1]

    def steps_for(self, num_samples: int) -> int:
        """Local steps a client with ``num_samples`` records takes under this plan (with
        ``records_per_client`` set, the same for every client)."""
        if self.local_steps is not None:
            return self.local_steps
        return self.local_epochs * self.epoch_batches(num_samples)
