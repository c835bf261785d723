"""Client samplers: fixed-size, Poisson and full participation, keyed by (seed, round)."""

import pytest
import torch

from dpfl_lightning import ConfigError
from dpfl_lightning.sampling import ClientSampler


def test_uniform_fixed_size_without_replacement():
    s = ClientSampler("uniform", 100, 10)
    cohorts = [s.sample(0, r) for r in range(200)]
    assert all(len(c) == 10 == len(set(c)) for c in cohorts)
    counts = torch.bincount(torch.tensor(sum(cohorts, [])), minlength=100).double()
    assert counts.mean() == 20 and counts.std() < 8  # roughly uniform inclusion, ~Binomial(200, 0.1)
    assert s.sample(0, 3) == s.sample(0, 3) and s.sample(0, 3) != s.sample(1, 3)


def test_poisson_rate():
    s = ClientSampler("poisson", 1000, rate=0.05)
    sizes = torch.tensor([len(s.sample(0, r)) for r in range(300)], dtype=torch.float64)
    assert sizes.mean().item() == pytest.approx(50, rel=0.05)  # sd of the mean: sqrt(47.5/300) = 0.4
    assert sizes.std().item() == pytest.approx((1000 * 0.05 * 0.95) ** 0.5, rel=0.15)
    assert s.expected_cohort == 50 and s.sampling_rate == 0.05


def test_full_participation():
    s = ClientSampler("full", 7)
    assert s.sample(0, 0) == list(range(7)) and s.sampling_rate == 1.0


@pytest.mark.parametrize("kw,setting", [({"kind": "uniform", "num_clients": 5, "clients_per_round": 6}, "trainer.clients_per_round"),
                                        ({"kind": "poisson", "num_clients": 5, "rate": 1.5}, "trainer.sampling_rate"),
                                        ({"kind": "random", "num_clients": 5}, "trainer.sampling")])
def test_bad_sampler(kw, setting):
    with pytest.raises(ConfigError, match=setting):
        ClientSampler(**kw)
