"""Client sampling: which clients take part in a round. Every rank draws the same cohort.

- ``uniform``: ``m`` clients uniformly without replacement (fixed-size cohort);
- ``poisson``: every client independently with probability ``q`` (random cohort size, mean ``qM``);
- ``full``: all ``M`` clients every round (``q = 1``);
- ``cyclic``: the population split by a keyed permutation into ``b = ceil(M / m)`` groups of at most
  ``m = clients_per_round`` clients; group ``t mod b`` takes part in round ``t``. A client's
  participations are ``b`` rounds apart, at most ``ceil(T / b)`` of ``T`` rounds, and no
  amplification is claimed (the correlated-noise mechanisms account this pattern:
  :class:`~dpfl_lightning.plugins.correlated_noise.CorrelatedNoise`);
- ``amplified_cyclic``: the same groups, and every member of the round's group independently with
  probability ``q = sampling_rate`` (Choquette-Choo et al., "(Amplified) Banded Matrix
  Factorization", NeurIPS 2023: b-min-separation sampling).

The cyclic groups are keyed by the seed alone (also in secure mode): the guarantee holds for any fixed
partition, and a resumed run keeps the groups. The amplified variant's coins are secret in secure mode.

Cohorts are drawn from the stream keyed by (seed, round, server, SAMPLING) -- the CSPRNG in secure
mode -- in O(cohort) time and memory, so populations of millions cost nothing per round:
``uniform`` draws client ids with replacement and keeps the first ``m`` distinct ones (a uniformly
random ``m``-subset; the complement is drawn when ``m > M/2``), ``poisson`` jumps from member to
member with geometric gaps. The privacy accountant assumes exactly the sampler used here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from dpfl_lightning.errors import require
from dpfl_lightning.privacy.guarantees import Sampling

if TYPE_CHECKING:  # rng imports torch: drawn cohorts need it, `dpfl privacy calibrate`'s sampler does not
    from dpfl_lightning import rng

SAMPLERS = ("uniform", "poisson", "full", "cyclic", "amplified_cyclic")
CYCLIC = ("cyclic", "amplified_cyclic")
_GROUPS_PURPOSE = "ClientSampler.cyclic_groups"


@lru_cache(maxsize=8)
def cyclic_groups(seed: int, num_clients: int, groups: int) -> tuple[np.ndarray, ...]:
    """The ``groups`` groups (each sorted) of a keyed permutation of ``range(num_clients)``, of sizes
    differing by at most one: a function of the seed only, the same on every rank."""
    from dpfl_lightning import rng

    purpose = rng.register_purpose(_GROUPS_PURPOSE, private=False)
    perm = rng.TorchStream(rng.derive_key(seed, 0, rng.SERVER_CLIENT, purpose)).randperm(num_clients).numpy()
    return tuple(np.sort(g) for g in np.array_split(perm, groups))


def _distinct_uniform(stream: rng.Stream, population: int, k: int) -> np.ndarray:
    """``k`` distinct ids of ``range(population)``, a uniformly random subset (sorted)."""
    chosen: list[np.ndarray] = []
    have = 0
    seen = np.empty(0, dtype=np.int64)
    while have < k:
        need = k - have
        # enough draws that, with the expected repeats, one batch usually suffices
        draws = int(need * population / max(population - have - need / 2, 1)) + 16
        ids = np.floor(stream.uniform(draws).numpy() * population).astype(np.int64)
        _, first = np.unique(ids, return_index=True)
        fresh = ids[np.sort(first)]  # in order of first appearance
        fresh = fresh[~np.isin(fresh, seen)][:need]
        chosen.append(fresh)
        seen = np.concatenate([seen, fresh])
        have += len(fresh)
    return np.sort(seen)


@dataclass(frozen=True)
class ClientSampler:
    """Draw round ``r``'s cohort from ``num_clients`` clients."""

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
        if self.kind in CYCLIC:
            m = self.clients_per_round
            require(m is not None and 1 <= m <= self.num_clients, "trainer.clients_per_round", m,
                    f"{self.kind} participation splits the {self.num_clients} clients into groups of at most "
                    "clients_per_round", f"set clients_per_round in [1, {self.num_clients}]")
        if self.kind == "amplified_cyclic":
            q = self.rate
            require(q is not None and 0 < q <= 1, "trainer.sampling_rate", q,
                    "amplified_cyclic samples each member of the round's group with probability sampling_rate",
                    "set sampling_rate in (0, 1]")
        if self.kind == "cyclic":
            require(self.rate is None, "trainer.sampling_rate", self.rate, "cyclic participation takes the whole group",
                    "leave sampling_rate unset, or use sampling='amplified_cyclic'")

    @property
    def groups(self) -> int | None:
        """``b``: the number of cyclic groups (the min-separation of participations); ``None`` otherwise."""
        return -(-self.num_clients // self.clients_per_round) if self.kind in CYCLIC else None

    def group(self, random: rng.RandomSource, round_idx: int) -> np.ndarray:
        """The sorted ids of the cyclic group that takes part in round ``round_idx``."""
        return cyclic_groups(random.seed, self.num_clients, self.groups)[round_idx % self.groups]

    @property
    def expected_cohort(self) -> float:
        """``m`` for uniform, ``qM`` for Poisson, ``M`` for full participation."""
        if self.kind == "uniform":
            return float(self.clients_per_round)
        if self.kind == "poisson":
            return self.rate * self.num_clients
        if self.kind in CYCLIC:  # the mean group size (a public constant)
            return (1.0 if self.kind == "cyclic" else self.rate) * self.num_clients / self.groups
        return float(self.num_clients)

    @property
    def sampling_rate(self) -> float:
        """Probability that a given client takes part in a round."""
        return self.expected_cohort / self.num_clients

    @property
    def cohort_size_is_public(self) -> bool:
        """Fixed-size cohorts reveal nothing by their size; a Poisson cohort's size is random."""
        return self.kind not in ("poisson", "amplified_cyclic")

    def accounted(self) -> Sampling:
        """What the privacy accountant is told about this sampler (cyclic: no amplification across
        groups; the correlated-noise mechanisms account the groups and the rate inside them)."""
        if self.kind in CYCLIC:
            return Sampling(self.kind, self.num_clients, 1.0 if self.kind == "cyclic" else self.rate,
                            self.clients_per_round, self.groups)
        return Sampling(self.kind, self.num_clients, self.sampling_rate, self.clients_per_round)

    def sample(self, random: rng.RandomSource, round_idx: int) -> list[int]:
        """The sorted client ids of round ``round_idx``."""
        M = self.num_clients
        if self.kind == "full":
            return list(range(M))
        from dpfl_lightning import rng

        if self.kind == "cyclic":
            return self.group(random, round_idx).tolist()
        stream = random.stream(round_idx, rng.SERVER_CLIENT, rng.SAMPLING)
        if self.kind == "amplified_cyclic":
            members = self.group(random, round_idx)
            return members[stream.uniform(len(members)).numpy() < self.rate].tolist()
        if self.kind == "uniform":
            m = self.clients_per_round
            if m == M:
                return list(range(M))
            if m <= M // 2:
                return _distinct_uniform(stream, M, m).tolist()
            out = np.ones(M, dtype=bool)
            out[_distinct_uniform(stream, M, M - m)] = False
            return np.flatnonzero(out).tolist()
        return self._poisson(stream).tolist()

    def _poisson(self, stream: rng.Stream) -> np.ndarray:
        q, M = self.rate, self.num_clients
        if q >= 1.0:
            return np.arange(M)
        if q > 0.25:  # dense: one uniform per client is cheaper than the gaps
            return np.flatnonzero(stream.uniform(M).numpy() < q)
        # gaps between members are Geometric(q): floor(log(U) / log(1 - q)) non-members
        log1q = math.log1p(-q)
        members: list[np.ndarray] = []
        pos = -1
        batch = int(q * M + 4 * math.sqrt(q * M) + 16)
        while True:
            u = stream.uniform(batch).numpy()
            gaps = np.floor(np.log1p(-u) / log1q).astype(np.int64)  # 1 - U in (0, 1]
            steps = np.cumsum(gaps + 1) + pos
            inside = steps[steps < M]
            members.append(inside)
            if len(inside) < len(steps):
                return np.concatenate(members)
            pos = int(steps[-1])

    def participation_counts(self, random: rng.RandomSource, rounds: int, start: int = 0) -> np.ndarray:
        """How often each client takes part in rounds ``start .. rounds-1`` (O(rounds x cohort)):
        known before training in a simulation, since cohorts are keyed by the seed."""
        counts = np.zeros(self.num_clients, dtype=np.int64)
        if self.kind == "full":
            counts += rounds - start
            return counts
        for r in range(start, rounds):
            np.add.at(counts, self.sample(random, r), 1)
        return counts

