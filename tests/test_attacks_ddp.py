"""Attacks on the distributed-DP guarantees of ``DiscreteDistributedNoise`` by someone who holds what a
run writes (files, console, warnings) or its settings.

Each test is one attack; it passes when the guarantee held against it. An attack that succeeds (a
real defect) is marked ``xfail(strict=True)`` with the defect in its reason.

(a) The stop charge under hidden-size sampling: the per-round stop probability the plugin declares
    (and the ledger charges to the models guarantee) must bound the real chance that a round is short
    for every cohort law the sampler draws from and for its add/remove neighbours -- computed here
    from the Binomial laws and the sampler's public group sizes, not by the plugin's helpers.
(b) The charge on the other paths: a run resumed from a checkpoint, and secure mode (the
    participation tail), against the least fixed point computed in tests/test_stop_probability.py.
(c) Neighbouring datasets under Poisson sampling with dropouts and SecAgg: everything written is the
    same apart from the released model and noised metrics.
(d) The exact Poisson/Skellam sampler: a client's draws are a function of its stream alone (the
    tables' cache is keyed by ``lam``; warming or evicting it changes no draw).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from scipy import stats

from dpfl_lightning import FederatedDataModule, FederatedTrainer
from dpfl_lightning.cli.privacy_command import plan_run
from dpfl_lightning.plugins import DiscreteDistributedNoise, PrivacyLedger, UpdateClipping
from dpfl_lightning.privacy import discrete_noise as dn
from helpers import TinyClassifier, quiet_trainer, tiny_data
from neighbours import differences, written

MODELS = "client_distributed_models"


# ----------------------------------------------------------------------------- independent laws
def short_given_cohort(m: int, size: int, rate: float, dropout: float) -> float:
    """P(a round is short) when ``size`` clients are each sampled with probability ``rate`` and each
    survives with ``1 - dropout``: fewer survivors than max(m, k // 2 + 1, 2) (SecAgg's strict
    majority of a cohort of k; at least 2 to mask), k the cohort drawn."""
    total = 0.0
    for k in range(size + 1):
        need = max(m, k // 2 + 1, 2)
        total += stats.binom.pmf(k, size, rate) * stats.binom.cdf(need - 1, k, 1.0 - dropout)
    return float(total)


def group_sizes(num_clients: int, clients_per_round: int) -> set[int]:
    """The sizes of the cyclic groups: ``b = ceil(M / m)`` groups of sizes differing by at most one."""
    b = -(-num_clients // clients_per_round)
    return {num_clients // b, -(-num_clients // b)}


def _plan(tmp_path, noise, num_clients, delta, **sampling):
    trainer = quiet_trainer(str(tmp_path), rounds=3, seed=3,
                            plugins=[UpdateClipping(0.5), noise, PrivacyLedger(delta=delta)], **sampling)
    return plan_run(trainer, tiny_data(num_clients=num_clients), model=TinyClassifier())


# ----------------------------------------------------------------------------- (a) the stop's probability
def test_amplified_cyclic_stop_charge_covers_the_groups_the_sampler_draws(tmp_path):
    """Attack: 40 clients in amplified-cyclic groups (clients_per_round=30 gives two groups of 20);
    the real per-round chance of a short round is that of a group of 20 -- or of 19, the add/remove
    neighbour -- sampled at 0.9; the plugin's declared stop probability (what the ledger charges)
    must be at least that. (It was not: the group size was taken to be clients_per_round, a
    declared 1.3e-10 against a real 1.8e-7.)"""
    m, rate, dropout, clients, per_round = 3, 0.9, 0.05, 40, 30
    noise = DiscreteDistributedNoise(noise_multiplier=3.0, bits=24, dropout=dropout, min_survivors=m)
    ledger = _plan(tmp_path, noise, clients, 1e-3, sampling="amplified_cyclic", clients_per_round=per_round,
                   sampling_rate=rate)
    real = max(short_given_cohort(m, s, rate, dropout) for g in group_sizes(clients, per_round) for s in (g, g - 1))
    charged = next(g for g in ledger.guarantees if g.name == MODELS).stop_probability
    assert real > 1e-8  # a charge that matters against delta = 1e-3 over a few hundred rounds
    assert charged >= real * (1 - 1e-9), (charged, real)


def test_amplified_cyclic_with_full_groups_is_charged_the_groups_law(tmp_path):
    """The same attack where every group has clients_per_round members (40 clients, groups of 20): the
    charge is the real chance, not a looser bound."""
    m, rate, dropout, clients, per_round = 3, 0.9, 0.05, 40, 20
    noise = DiscreteDistributedNoise(noise_multiplier=3.0, bits=24, dropout=dropout, min_survivors=m)
    ledger = _plan(tmp_path, noise, clients, 1e-3, sampling="amplified_cyclic", clients_per_round=per_round,
                   sampling_rate=rate)
    real = max(short_given_cohort(m, s, rate, dropout) for s in (per_round, per_round - 1))
    charged = next(g for g in ledger.guarantees if g.name == MODELS).stop_probability
    assert charged == pytest.approx(real, rel=1e-6)


@pytest.mark.parametrize("clients, rate, dropout, m", [(40, 0.5, 0.1, 6), (30, 0.6, 0.05, 3), (60, 0.3, 0.02, 4)])
def test_poisson_stop_charge_bounds_the_population_and_both_neighbours(tmp_path, clients, rate, dropout, m):
    """Attack on the bad-event argument's add/remove neighbours: the plugin bounds the stop for the
    population and a neighbour one client smaller; a neighbour one client *larger* must be covered
    too (the guarantee is for every neighbour of the dataset the run holds)."""
    noise = DiscreteDistributedNoise(noise_multiplier=3.0, bits=24, dropout=dropout, min_survivors=m)
    _plan(tmp_path, noise, clients, 1e-3, sampling="poisson", sampling_rate=rate)
    real = max(short_given_cohort(m, n, rate, dropout) for n in (clients - 1, clients, clients + 1))
    assert noise.stop_per_round >= real * (1 - 1e-9), (noise.stop_per_round, real)
