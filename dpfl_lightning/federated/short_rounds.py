"""Short rounds of a secure sum with dropouts, from the settings alone: the law of a round's cohort
size under a sampler, the fewest survivors a round runs with (``min_survivors`` and, under SecAgg,
the Shamir threshold), and a bound on the chance that a round is short (fewer survivors than that),
for :class:`~dpfl_lightning.plugins.DiscreteDistributedNoise` (which skips or stops such a round and,
under a hidden-size sampler, declares the chance as its mechanism's stop probability: see its module
docstring and :mod:`dpfl_lightning.privacy.guarantees`)."""

from __future__ import annotations

import numpy as np
from scipy import stats

SIZE_TAIL = 1e-18  # cohort sizes beyond these quantiles are counted as stopping (stop_chance)


def cohort_law(sampler) -> tuple[int, float]:
    """``(trials, p)``: the round's cohort size is Binomial(trials, p) (``p = 1``: fixed); under
    ``amplified_cyclic``, ``trials`` is the largest group (see :func:`group_sizes`)."""
    kind = sampler.kind
    if kind == "poisson":
        return sampler.num_clients, sampler.sampling_rate
    if kind == "amplified_cyclic":
        return max(group_sizes(sampler)), sampler.rate
    if kind in ("uniform", "cyclic"):
        return sampler.clients_per_round, 1.0
    return sampler.num_clients, 1.0


def group_sizes(sampler) -> tuple[int, ...]:
    """The ``trials`` of every cohort law the sampler draws from: under ``amplified_cyclic`` the
    sizes of its ``ceil(M / clients_per_round)`` groups (``floor`` or ``ceil`` of ``M / groups``, which
    can be well below ``clients_per_round``); otherwise :func:`cohort_law`'s one."""
    if sampler.kind == "amplified_cyclic":
        b = sampler.groups
        return tuple(sorted({sampler.num_clients // b, -(-sampler.num_clients // b)}))
    return (cohort_law(sampler)[0],)


def survivors_needed(k: np.ndarray, min_survivors: int, secagg: bool, threshold: int | None,
                     neighbours: int | None) -> np.ndarray:
    """The fewest survivors a round with a cohort of ``k`` clients runs with: ``min_survivors``, and
    under SecAgg 2 and the threshold (:func:`dpfl_lightning.comm.secagg.default_threshold`, a strict
    majority of a secret's holders: the cohort, or a SecAgg+ client and its ``neighbours``)."""
    need = np.full(k.shape, min_survivors, dtype=np.int64)
    if not secagg:
        return need
    complete = np.ones(k.shape, dtype=bool) if neighbours is None else neighbours >= k - 1
    holders = np.where(complete, k, (neighbours or 0) + 1)
    t = np.full(k.shape, threshold) if threshold is not None else holders // 2 + 1
    return np.maximum(need, np.maximum(t, 2))


def stop_chance(min_survivors: int, trials: int, p: float, dropout: float, secagg: bool = True,
                threshold: int | None = None, neighbours: int | None = None) -> float:
    """A bound on the chance that a round is short (skipped or stopped) when its cohort is
    Binomial(``trials``, ``p``) clients, each surviving with probability ``1 - dropout``: fewer survivors
    than :func:`survivors_needed`, summed over the cohort sizes; under SecAgg+ (a cohort larger than
    ``neighbours + 1``) plus a union bound over the cohort on a secret with fewer than ``t`` surviving
    holders (a survivor's own share counts, a dropped client's does not). Settings alone."""
    keep = 1.0 - dropout
    if p >= 1:
        k, pk, outside = np.array([trials]), np.array([1.0]), 0.0
    else:
        lo = int(stats.binom.ppf(SIZE_TAIL, trials, p))
        hi = int(stats.binom.isf(SIZE_TAIL, trials, p))
        k = np.arange(lo, hi + 1)
        pk = stats.binom.pmf(k, trials, p)
        outside = float(stats.binom.cdf(lo - 1, trials, p) + stats.binom.sf(hi, trials, p))
    need = survivors_needed(k, min_survivors, secagg, threshold, neighbours)
    short = stats.binom.cdf(need - 1, k, keep)
    if secagg and neighbours is not None and dropout > 0:
        t = threshold if threshold is not None else (neighbours + 1) // 2 + 1
        per_client = keep * stats.binom.cdf(t - 2, neighbours, keep) + dropout * stats.binom.cdf(t - 1, neighbours, keep)
        short = np.where(neighbours < k - 1, np.minimum(1.0, short + k * per_client), short)
    return float(min(1.0, np.sum(pk * short) + outside))
