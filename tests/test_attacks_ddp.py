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
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from dpfl_lightning import FederatedDataModule, FederatedTrainer
from dpfl_lightning.cli.privacy_command import plan_run
from dpfl_lightning.plugins import DiscreteDistributedNoise, PrivacyLedger, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.privacy import discrete_noise as dn
from helpers import TinyClassifier, neighbouring_data, quiet_trainer, tiny_data
from neighbours import differences, written

MODELS = "client_distributed_models"


# ----------------------------------------------------------------------------- independent laws
def short_given_cohort(m: int, size: int, rate: float, dropout: float, neighbours: int | None = None) -> float:
    """P(a round is short) when ``size`` clients are each sampled with probability ``rate`` and each
    survives with ``1 - dropout``: fewer survivors than max(m, k // 2 + 1, 2) (SecAgg's strict
    majority of a cohort of k; at least 2 to mask), k the cohort drawn. SecAgg+ (``neighbours``, a
    cohort larger than neighbours + 1): fewer survivors than max(m, t, 2), t = (neighbours + 1) // 2 + 1,
    plus the union bound over the k clients on a secret with fewer than t surviving holders (its owner
    surviving, its share counts)."""
    keep, total = 1.0 - dropout, 0.0
    for k in range(size + 1):
        plus = neighbours is not None and neighbours < k - 1
        t = (neighbours + 1) // 2 + 1 if plus else k // 2 + 1
        short = stats.binom.cdf(max(m, t, 2) - 1, k, keep)
        if plus:
            secret = keep * stats.binom.cdf(t - 2, neighbours, keep) + dropout * stats.binom.cdf(t - 1, neighbours, keep)
            short += k * secret
        total += stats.binom.pmf(k, size, rate) * min(1.0, short)
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


@pytest.mark.parametrize("clients, rate, dropout, m, neighbours", [
    (40, 0.5, 0.1, 6, None), (30, 0.6, 0.05, 3, None), (60, 0.3, 0.02, 4, None), (100, 0.3, 0.02, 3, 8)])
def test_poisson_stop_charge_bounds_the_population_and_both_neighbours(tmp_path, clients, rate, dropout, m,
                                                                       neighbours):
    """Attack on the bad-event argument's add/remove neighbours: the plugin bounded the stop for the
    population and a neighbour one client smaller; a neighbour one client *larger* must be covered
    too (the guarantee is for every neighbour of the dataset the run holds). Under SecAgg+ the
    per-secret failures grow with the cohort: a population one larger has a ~1/n larger chance (was
    declared 1.131e-5 against 1.142e-5 at 100 clients)."""
    noise = DiscreteDistributedNoise(noise_multiplier=4.0, bits=24, dropout=dropout, min_survivors=m,
                                     neighbours=neighbours)
    _plan(tmp_path, noise, clients, 1e-3, sampling="poisson", sampling_rate=rate)
    real = max(short_given_cohort(m, n, rate, dropout, neighbours) for n in (clients - 1, clients, clients + 1))
    assert noise.stop_per_round >= real * (1 - 1e-9), (noise.stop_per_round, real)


# ----------------------------------------------------------------------------- (b) the charge on other paths
def _charged(tmp_path, rounds, delta=1e-3, **kw):
    """tests/test_stop_probability.py's charged setting (40 clients at Poisson 0.5, 10% dropouts, 6 shares)."""
    from test_stop_probability import CLIENTS, CLIP, DROPOUT, RATE

    noise = DiscreteDistributedNoise(noise_multiplier=4.0, bits=24, dropout=DROPOUT, min_survivors=6)
    trainer = quiet_trainer(str(tmp_path), rounds=rounds, seed=3, sampling="poisson", sampling_rate=RATE,
                            plugins=[UpdateClipping(CLIP), noise, PrivacyLedger(delta=delta)], **kw)
    return noise, trainer, tiny_data(num_clients=CLIENTS)


def _expected(noise, rounds: int, delta: float) -> float:
    """The least fixed point of test_stop_probability's independent computation at ``delta``."""
    from test_stop_probability import eps_ideal, least_fixed_point, models_curve, stop_bound

    curve = models_curve(noise, sum(p.numel() for p in TinyClassifier().parameters()))
    s = stop_bound(noise.min_survivors, rounds)
    return least_fixed_point(lambda d: eps_ideal(curve, rounds, d), delta, lambda e: (1 + math.exp(e)) * s)


def test_a_resumed_run_reports_the_charged_epsilon_of_all_its_rounds(tmp_path):
    """Attack: resume a charged run from its round-1 checkpoint to 3 rounds; the models epsilon it logs
    must carry the stop's charge over all 3 rounds (not be recomputed without it, nor over 1)."""
    import glob

    noise, trainer, data = _charged(tmp_path / "run", 1, checkpoint_every=1, run_name="r")
    trainer.fit(TinyClassifier(), data)
    (path,) = glob.glob(str(tmp_path / "run" / "r" / "version_0" / "checkpoints" / "*.ckpt"))[:1]
    noise2, resumed, data = _charged(tmp_path / "run", 3, run_name="r")
    resumed.fit(TinyClassifier(), data, ckpt_path=path)
    logged = resumed.history[-1][f"epsilon_{MODELS}"]
    assert resumed.history[-1]["round"] == 3
    assert logged == pytest.approx(_expected(noise2, 3, 1e-3), rel=1e-5)
    assert logged > _expected(noise2, 1, 1e-3) * 1.05  # 3 rounds, not 1


def test_secure_mode_charges_the_stop_inside_the_delta_left_by_the_participation_tail(tmp_path):
    """Attack: in secure mode the models guarantee's delta is shared by the participation bound's tail
    (10%) and the stop; the logged epsilon must be the least fixed point at 0.9 delta, not at delta."""
    noise, trainer, data = _charged(tmp_path, 3, secure=True)
    trainer.fit(TinyClassifier(), data)
    logged = trainer.history[-1][f"epsilon_{MODELS}"]
    assert logged == pytest.approx(_expected(noise, 3, 0.9e-3), rel=1e-5)
    assert logged > _expected(noise, 3, 1e-3) * (1 + 1e-4)


# ----------------------------------------------------------------------------- (c) neighbouring datasets
N_CLIENTS, RECORDS = 40, 6


def _neighbour_data(change: str | None) -> FederatedDataModule:
    """40 clients of six records; ``change`` alters client 3's (a huge record, or a marker record)."""
    return neighbouring_data(change, N_CLIENTS, RECORDS)


class PlantedLeak(FederatedCallback):
    """A planted leak (the harness must see it): warns a client's update norm before the noise."""

    order = 5

    def on_client_end(self, *, client) -> None:
        if client.client == 3:
            warnings.warn(f"client 3's update norm {float(client.payload['update'].norm()):.6g}")


def _poisson_neighbours(tmp_path, mechanism, change, extra=()):
    def fit(change):
        def run(log_dir: str) -> None:
            noise = DiscreteDistributedNoise(mechanism, noise_multiplier=4.0, bits=24, dropout=0.1, min_survivors=6)
            FederatedTrainer(log_dir=log_dir, run_name="nb", rounds=3, batch_size=4, num_threads=1, seed=0,
                             enable_progress_bar=False, enable_summary=True, checkpoint_every=1,
                             final_checkpoint=True, sampling="poisson", sampling_rate=0.5,
                             plugins=[UpdateClipping(0.5), noise, PrivacyLedger(delta=1e-3), *extra]
                             ).fit(TinyClassifier(), _neighbour_data(change))
        return run

    a = written(str(tmp_path / "a"), fit(None))
    b = written(str(tmp_path / "b"), fit(change))
    assert a.error is None and b.error is None, (a.error, b.error)
    assert any(k.endswith(".ckpt") for k in a.files) and any(k.endswith("metrics.csv") for k in a.files)
    return differences(a, b)


@pytest.mark.parametrize("mechanism", ["discrete_gaussian", "skellam"])
@pytest.mark.parametrize("change", ["huge", "marker"])
def test_poisson_discrete_noise_writes_the_same_on_neighbouring_datasets(tmp_path, mechanism, change):
    """Attack: under Poisson sampling (the cohort's size hidden, a stop charged), SecAgg and 10%
    dropouts, diff everything written -- metrics (noise_std, wraparound_bound, epsilons), hparams,
    checkpoints (the plugin's state, the ledger's), the privacy lines, warnings -- when client 3's
    data changes."""
    assert _poisson_neighbours(tmp_path, mechanism, change) == []


def test_the_neighbour_harness_sees_a_planted_leak(tmp_path):
    """The attack above can fail: a warning with client 3's update norm differs between the runs."""
    assert any("update norm" in d for d in _poisson_neighbours(tmp_path, "skellam", "huge", [PlantedLeak()]))


# ----------------------------------------------------------------------------- (d) the sampler
class Words:
    """A seeded stream of 53-bit words (what a client's noise stream gives the sampler)."""

    def __init__(self, seed: int) -> None:
        self.gen = np.random.default_rng(seed)

    def words(self, n: int) -> np.ndarray:
        return self.gen.integers(0, 1 << 53, n, dtype=np.uint64)


@pytest.mark.parametrize("kind, parameter", [("skellam", 37.25), ("skellam", 2.5e5), ("discrete_gaussian", 900.0)])
def test_a_clients_noise_is_a_function_of_its_stream_alone(kind, parameter):
    """Attack on the cached tables: a client's draws must not depend on what was drawn before (other
    clients' draws from the cached table, other parameters evicting it), nor differ from a table
    built afresh -- else one client's noise would carry another's, or a rank's history."""
    dn.poisson_table.cache_clear()
    first = dn.integer_noise(Words(1), kind, parameter, (4000,))
    dn.integer_noise(Words(2), kind, parameter, (200_000,))  # another client, same table
    for i in range(10):  # other parameters: the cache (8 tables) evicts this one
        dn.integer_noise(Words(10 + i), kind, parameter * (1.5 + i), (1000,))
    dn.integer_noise(Words(3), kind, parameter, (50_000,))
    again = dn.integer_noise(Words(1), kind, parameter, (4000,))
    assert torch.equal(first, again)
    if kind == "skellam":  # a table built without the cache gives the same draws
        fresh = dn.sample_poisson(dn.poisson_table.__wrapped__(dn.as_fraction(parameter, "lam")), Words(1), 8000)
        assert torch.equal(first, torch.from_numpy(fresh[:4000] - fresh[4000:]))
    assert float(first.double().var()) == pytest.approx(2 * parameter if kind == "skellam" else parameter, rel=0.1)
