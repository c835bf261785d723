"""How often a client will be accounted: what calibration and planned epsilons need before a run.

In a simulation the cohorts are keyed by the seed, so each client's participations are known in
advance and the ledger reports the exact worst client. In secure mode nobody knows the cohorts in
advance (or may learn them from the logs), so per-client guarantees use a bound that does not need
the sample: a client takes part in each round independently with probability ``q``, so its number
of participations after ``t`` rounds is ``Binomial(t, q)``. With ``k`` the smallest count with
``P(Binomial(t, q) > k) <= tail``, the mechanism composed ``k`` times being
``(eps, delta - tail)``-DP makes the run ``(eps, delta)``-DP for every client: the sample is
independent of the data, and the event of more than ``k`` participations is folded into delta.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np
from scipy import stats

from dpfl_lightning.privacy.calibrate import calibrate_guarantee
from dpfl_lightning.privacy.guarantees import (Guarantee, Profile, Sampling, default_delta_for, stop_penalty,
                                               stop_refusal)

#: the share of delta that the binomial participation bound of secure mode takes
TAIL_SHARE = 0.1


@lru_cache(maxsize=4096)
def participation_bound(rounds: int, rate: float, tail: float) -> int:
    """The smallest ``k`` with ``P(Binomial(rounds, rate) > k) <= tail``."""
    if rate >= 1.0 or rounds == 0:
        return rounds
    k = int(stats.binom.isf(tail, rounds, rate))
    while k > 0 and stats.binom.sf(k - 1, rounds, rate) <= tail:  # isf may overshoot by one
        k -= 1
    while stats.binom.sf(k, rounds, rate) > tail:
        k += 1
    return min(k, rounds)


class PrivacyPlanner:
    """How many times each guarantee will compose over a run, for calibration and planned epsilons.

    Args:
        sampling: the accounted client sampling.
        rounds: the run's rounds.
        participations: ``participations(rounds)`` gives every client's planned number of
            participations in rounds ``0 .. rounds-1`` (a simulation: keyed by the seed), or
            ``None`` in secure mode (then the binomial bound of the module docstring is used).
        steps_for: local steps of a client with ``n`` records under the default round plan.
        records: the public number of records per client (record-level DP's population), or
            ``None`` (:mod:`dpfl_lightning.federated.public_sizes`): never the clients' own counts.
    """

    def __init__(self, sampling: Sampling, rounds: int, participations: Callable[[int], np.ndarray] | None,
                 steps_for: Callable[[int], int], records: int | None) -> None:
        self.sampling = sampling
        self.rounds = rounds
        self._participations = participations
        self._counts: dict[int, np.ndarray] = {}
        self.steps_for = steps_for
        self.records = records
        self.calibrations: list[tuple[float, str]] = []  # (delta, accountant) of every calibration
        self.block_rounds, self.block_times = 0, 0  # see meet_at_most

    def meet_at_most(self, rounds: int, times: int) -> None:
        """The first ``rounds`` rounds draw their cohorts as blocks of partitions of the population
        (SCAFFOLD's warm start), not from the sampler, and meet each client at most ``times`` times:
        a client's participations are then at most ``times +`` those of the sampled rounds after."""
        self.block_rounds, self.block_times = int(rounds), int(times)
        self._counts.clear()

    @property
    def secure(self) -> bool:
        return self._participations is None

    def population(self, granularity: str) -> int | None:
        """``N`` of the neighbouring relation: clients, or the public records per client (``None``: not public)."""
        return self.sampling.num_clients if granularity == "client" else self.records

    def default_delta(self, granularity: str) -> float:
        """From public settings only (:func:`~dpfl_lightning.privacy.guarantees.default_delta_for`)."""
        return default_delta_for(granularity, self.sampling.num_clients, self.records)

    def counts(self, rounds: int) -> np.ndarray:
        """Every client's planned participations in rounds ``0 .. rounds-1`` (a simulation)."""
        if rounds not in self._counts:
            counts = self._participations(rounds)
            if self.block_rounds:  # the sampler's cohorts of those rounds are not drawn
                first = min(rounds, self.block_rounds)
                counts = counts - self._participations(first) + self.block_times * (first > 0)
            self._counts[rounds] = counts
        return self._counts[rounds]

    def tail(self, delta: float) -> float:
        """The share of ``delta`` the participation bound takes (secure mode), else 0."""
        return delta * TAIL_SHARE if self.secure else 0.0

    def busiest(self, clients: tuple[int, ...] | None, rounds: int, delta: float) -> int:
        """The planned participations of the busiest of ``clients`` (all if ``None``) in ``rounds``
        rounds; in secure mode the binomial bound at ``tail(delta)``."""
        if self.secure:
            first = min(rounds, self.block_rounds)
            return self.block_times * (first > 0) + participation_bound(rounds - first, self.sampling.rate,
                                                                         self.tail(delta))
        counts = self.counts(rounds)
        return int(counts.max() if clients is None else counts[list(clients)].max())

    def compositions(self, guarantee: Guarantee, profile: Profile, delta: float, rounds: int | None = None) -> int:
        """How often ``profile`` of ``guarantee`` composes for its worst client over ``rounds``."""
        rounds = self.rounds if rounds is None else rounds
        if not guarantee.per_client:
            return rounds
        n = self.busiest(profile.clients, rounds, delta)
        return n * (self.steps_for(profile.record.records) if profile.record is not None else 1)

    def calibrate(self, guarantee_at: Callable[[float], Guarantee], target_epsilon: float, delta: float,
                  accountant: str) -> float:
        """The smallest multiplier whose guarantee stays within the target over the whole run. A
        guarantee charged for a stop (:func:`~dpfl_lightning.privacy.guarantees.epsilon_with_stop`)
        is calibrated at ``delta - tail - (1 + e^target) s``: the ledger's least fixed point is then
        at most the target (the iteration from ``s = 0`` stays below it)."""
        self.calibrations.append((delta, accountant))
        base = guarantee_at(1.0)
        room = delta - self.tail(delta) - stop_penalty(target_epsilon, base.stop_after(self.rounds))
        if not room > 0:
            raise stop_refusal(base, delta, self.rounds)
        return calibrate_guarantee(guarantee_at, lambda p: self.compositions(base, p, delta), target_epsilon,
                                   room, accountant)
