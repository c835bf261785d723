"""Adaptive clipping (Andrew et al. 2021): the clip norm converges to the target quantile of the
update norms, and the run spends exactly the privacy of the non-adaptive run it replaces."""

import math
from types import SimpleNamespace

import pytest
import torch

from dpfl_lightning import ConfigError
from dpfl_lightning.algorithms import AdaptiveClipping, DPFedAvg
from dpfl_lightning.federated.payload import Aggregate
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.plugins import AdaptiveClip, ClientContext, PrivacyLedger
from dpfl_lightning.rng import RandomSource
from helpers import TinyClassifier, quiet_trainer, tiny_data


@pytest.mark.parametrize("gamma", [0.3, 0.5, 0.8])
def test_the_clip_norm_converges_to_the_target_quantile(gamma):
    # a fixed distribution of update norms: log-normal, median 2; 100 clients a round, count noise 1
    g = torch.Generator().manual_seed(0)
    plugin = AdaptiveClip(initial_clip=0.1, target_quantile=gamma, learning_rate=0.2, count_noise=1.0)
    plugin._n = 100
    random = RandomSource(0)
    for r in range(300):
        plan = RoundPlan(r, tuple(range(100)))
        server = SimpleNamespace(random=random, round_idx=r)
        plugin.before_round(plan=plan, server=server)
        total = torch.zeros(1, dtype=torch.float64)
        for c in range(100):
            norm = 2.0 * math.exp(0.5 * float(torch.randn(1, generator=g)))
            u = torch.zeros(10)
            u[0] = norm
            ctx = ClientContext(c, r, plan, random, {}, payload={"update": u, "clip_bit": torch.zeros(1)})
            plugin.on_client_end(client=ctx)
            total += ctx.payload["clip_bit"].double()
        agg = Aggregate(r, {"clip_bit": total}, 100, 100.0)
        server.aggregate = agg
        plugin.on_aggregate(server=server)
        plugin.on_server_update(server=server)
    quantile = 2.0 * math.exp(0.5 * math.sqrt(2) * torch.erfinv(torch.tensor(2 * gamma - 1)).item())
    final = sum(plugin.quantile_estimates[-50:]) / 50
    assert abs(final - gamma) < 0.05  # the noisy unclipped fraction hovers at the target
    assert plugin.max_norm == pytest.approx(quantile, rel=0.15)


@pytest.mark.parametrize("base", ["dp_fedavg", "dp_normfedavg"])
def test_adaptive_run_spends_the_planned_privacy(log_dir, base):
    def run(algorithm):
        t = quiet_trainer(log_dir, rounds=5, clients_per_round=6, sampling="poisson", algorithm=algorithm,
                          plugins=[PrivacyLedger(delta=1e-5)])
        t.fit(TinyClassifier(), tiny_data(num_clients=30))
        return t

    adaptive = run(AdaptiveClipping(base=base, noise_multiplier=1.2, count_noise=3.0, initial_clip=0.5))
    plain = run(DPFedAvg(clip=0.5, noise_multiplier=1.2))
    assert [h["epsilon"] for h in adaptive.history] == pytest.approx([h["epsilon"] for h in plain.history], rel=1e-9)
    norms = [h["clip_norm"] for h in adaptive.history]
    assert len(set(norms)) > 1 and "unclipped_fraction" in adaptive.history[-1]
    assert [h["noise_std"] for h in adaptive.history] == pytest.approx(
        [adaptive.algorithm.update_noise_multiplier * c for c in norms])  # sigma_t = z_Delta C_t


def test_distributed_count_noise_and_bad_settings(log_dir):
    t = quiet_trainer(log_dir, rounds=3, clients_per_round=5,
                      algorithm=AdaptiveClipping(noise_multiplier=1.0, count_noise=2.0, placement="distributed"))
    t.fit(TinyClassifier(), tiny_data())
    assert math.isfinite(t.history[-1]["epsilon"]) and "epsilon_client_distributed_models" in t.history[-1]
    with pytest.raises(ConfigError, match="count_noise"):
        AdaptiveClipping(noise_multiplier=2.0, count_noise=0.5)  # the count alone would exceed the budget


def test_count_noise_defaults_to_a_twentieth_of_the_cohort(log_dir):
    # Andrew et al. use sigma_b = m / 20; the preset splits z so the run spends exactly plain z
    def run(algorithm):
        t = quiet_trainer(log_dir, rounds=3, clients_per_round=40, algorithm=algorithm,
                          plugins=[PrivacyLedger(delta=1e-5)])
        t.fit(TinyClassifier(), tiny_data(num_clients=60, samples=4))
        return t

    adaptive = run(AdaptiveClipping(noise_multiplier=1.2))
    clip = next(p for p in adaptive.plugins if isinstance(p, AdaptiveClip))
    assert clip.sigma_b == 40 / 20
    assert adaptive.algorithm.update_noise_multiplier == pytest.approx((1.2**-2 - 4.0**-2) ** -0.5, rel=1e-12)
    plain = run(DPFedAvg(clip=1.0, noise_multiplier=1.2))
    assert adaptive.history[-1]["epsilon"] == pytest.approx(plain.history[-1]["epsilon"], rel=1e-9)
    with pytest.raises(ConfigError, match="count_noise"):  # a cohort of 10: sigma_b = 0.5 < z / 2
        quiet_trainer(log_dir, rounds=1, clients_per_round=10, algorithm=AdaptiveClipping(noise_multiplier=1.2)).fit(
            TinyClassifier(), tiny_data(num_clients=20))
