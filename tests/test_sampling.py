"""Client samplers: fixed-size, Poisson and full participation, keyed by (seed, round), O(cohort)."""

import numpy as np
import pytest
from scipy import stats

from dpfl_lightning import ConfigError
from dpfl_lightning.rng import RandomSource, new_secret
from dpfl_lightning.federated.sampling import ClientSampler

SRC = RandomSource(0)


def test_uniform_fixed_size_without_replacement_and_uniform_inclusion():
    s = ClientSampler("uniform", 100, 10)
    cohorts = [s.sample(SRC, r) for r in range(2000)]
    assert all(len(c) == 10 == len(set(c)) and c == sorted(c) for c in cohorts)
    counts = np.bincount(np.concatenate(cohorts), minlength=100)
    assert stats.chisquare(counts).pvalue > 1e-4  # every client equally likely
    pairs = np.zeros((10, 10))  # pairs are equally likely too (a uniformly random subset)
    for c in cohorts:
        small = [x for x in c if x < 10]
        for i in small:
            for j in small:
                pairs[i, j] += i != j
    assert stats.chisquare(pairs[np.triu_indices(10, 1)]).pvalue > 1e-4
    assert s.sample(SRC, 3) == s.sample(SRC, 3) and s.sample(SRC, 3) != s.sample(RandomSource(1), 3)


def test_uniform_with_most_clients_sampled():
    s = ClientSampler("uniform", 50, 45)
    cohorts = [s.sample(SRC, r) for r in range(400)]
    assert all(len(c) == 45 == len(set(c)) for c in cohorts)
    assert stats.chisquare(np.bincount(np.concatenate(cohorts), minlength=50)).pvalue > 1e-4


@pytest.mark.parametrize("q", [0.05, 0.5])
def test_poisson_rate(q):
    s = ClientSampler("poisson", 1000, rate=q)
    sizes = np.array([len(s.sample(SRC, r)) for r in range(300)], dtype=float)
    se = (1000 * q * (1 - q) / 300) ** 0.5
    assert abs(sizes.mean() - 1000 * q) < 5 * se
    assert sizes.std() == pytest.approx((1000 * q * (1 - q)) ** 0.5, rel=0.15)
    counts = np.bincount(np.concatenate([s.sample(SRC, r) for r in range(300)]), minlength=1000)
    assert stats.chisquare(counts).pvalue > 1e-4  # no client favoured


def test_a_million_clients():
    for s in (ClientSampler("uniform", 10**6, 1000), ClientSampler("poisson", 10**6, rate=1e-3)):
        c = s.sample(SRC, 0)
        assert len(set(c)) == len(c) and 0 <= min(c) and max(c) < 10**6
        assert 800 <= len(c) <= 1200


def test_full_participation():
    s = ClientSampler("full", 7)
    assert s.sample(SRC, 0) == list(range(7)) and s.sampling_rate == 1.0


def test_secure_cohorts_differ_between_secrets():
    s = ClientSampler("uniform", 100, 10)
    a, b = RandomSource(0, new_secret()), RandomSource(0, new_secret())
    assert [s.sample(a, r) for r in range(5)] != [s.sample(b, r) for r in range(5)]
    assert s.sample(a, 2) == s.sample(a, 2)  # every rank (same secret) draws the same cohort


def test_participation_counts_match_the_cohorts():
    s = ClientSampler("poisson", 50, rate=0.2)
    counts = s.participation_counts(SRC, 30)
    direct = np.bincount(np.concatenate([s.sample(SRC, r) for r in range(30)]), minlength=50)
    assert np.array_equal(counts, direct)


@pytest.mark.parametrize("kw,setting", [({"kind": "uniform", "num_clients": 5, "clients_per_round": 6}, "trainer.clients_per_round"),
                                        ({"kind": "poisson", "num_clients": 5, "rate": 1.5}, "trainer.sampling_rate"),
                                        ({"kind": "random", "num_clients": 5}, "trainer.sampling")])
def test_bad_sampler(kw, setting):
    with pytest.raises(ConfigError, match=setting):
        ClientSampler(**kw)


def test_the_population_benchmark_runs_at_a_small_size(monkeypatch, capsys):
    """benchmarks/population.py drives the ledger through the trainer's own SetupContext (a stand-in
    context lacked a field the ledger reads, and the script crashed at every size)."""
    import importlib.util
    import os
    import sys
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "population.py")
    spec = importlib.util.spec_from_file_location("population_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["population.py", "--clients", "5000", "--cohort", "50", "--rounds", "3"])
    bench.main()
    out = capsys.readouterr().out
    assert "5000 clients, cohort 50" in out and "sample + ledger" in out and "planning every participation" in out
