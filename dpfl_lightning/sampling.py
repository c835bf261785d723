"""Client sampling: which clients take part in a round. Every rank draws the same cohort.

- ``uniform``: ``m`` clients uniformly without replacement (fixed-size cohort);
- ``poisson``: every client independently with probability ``q`` (random cohort size, mean ``qM``);
- ``full``: all ``M`` clients every round (``q = 1``).

The privacy accountant assumes exactly the sampler used here (see :mod:`dpfl_lightning.privacy`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dpfl_lightning import rng
from dpfl_lightning.errors import require

SAMPLERS = ("uniform", "poisson", "full")


@dataclass(frozen=True)
class ClientSampler:
    """Draw round ``r``'s cohort from ``num_clients`` clients, keyed by (seed, r)."""

    kind: str
    num_clients: int
    clients_per_round: int | None = None
    rate: float | None = None

    def __post_init__(self) -> None:
        require(self.kind in SAMPLERS, "trainer.sampling", self.kind, "unknown client sampler", f"use one of {', '.join(SAMPLERS)}")
        if self.kind == "uniform":
            m = self.clients_per_round
            require(m is not None and 1 <= m, "trainer.clients_per_round", m, "must be >= 1", "set clients_per_round >= 1")
            require(m <= self.num_clients, "trainer.clients_per_round", m, f"exceeds data.num_clients={self.num_clients}",
                    f"set clients_per_round <= {self.num_clients} or use more clients")
        if self.kind == "poisson":
            q = self.rate
            require(q is not None and 0 < q <= 1, "trainer.sampling_rate", q, "the Poisson rate q must be in (0, 1]",
                    "set sampling_rate (or clients_per_round, giving q = clients_per_round / num_clients)")

    @property
    def expected_cohort(self) -> float:
        """``m`` for uniform, ``qM`` for Poisson, ``M`` for full participation."""
        if self.kind == "uniform":
            return float(self.clients_per_round)
        if self.kind == "poisson":
            return self.rate * self.num_clients
        return float(self.num_clients)

    @property
    def sampling_rate(self) -> float:
        """Probability that a given client takes part in a round."""
        return self.expected_cohort / self.num_clients

    def sample(self, seed: int, round_idx: int) -> list[int]:
        """The sorted client ids of round ``round_idx``."""
        if self.kind == "full":
            return list(range(self.num_clients))
        g = rng.generator(seed, round_idx, rng.SERVER_CLIENT, rng.SAMPLING)
        if self.kind == "uniform":
            chosen = torch.randperm(self.num_clients, generator=g)[: self.clients_per_round]
        else:
            chosen = torch.nonzero(torch.rand(self.num_clients, generator=g, dtype=torch.float64) < self.rate).flatten()
        return sorted(int(c) for c in chosen)

    def participation_counts(self, seed: int, rounds: int) -> np.ndarray:
        """How often each client takes part in rounds ``0 .. rounds-1``: known before training,
        since cohorts are keyed by the seed (used to calibrate and plan per-client guarantees)."""
        counts = np.zeros(self.num_clients, dtype=np.int64)
        for r in range(rounds):
            counts[self.sample(seed, r)] += 1
        return counts
