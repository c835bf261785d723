"""Gaussian noise: the added noise has the configured scale in every placement, is keyed by
(seed, round, client), and with local placement nothing raw crosses the communicator.

Statistical tolerance: with n >= 10,000 independent N(0, s^2) draws the sample standard deviation
has relative standard error 1/sqrt(2n) < 0.71%; the tests allow 3% (> 4 standard errors).
"""

import math

import pytest
import torch

from dpfl_lightning import ConfigError
from dpfl_lightning.comm import LocalCommunicator
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping, UpdateNormalization
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data

DIM = 200  # TinyClassifier(200) has 3386 parameters
TOL = 0.03


def _zero_update_model():
    return TinyClassifier(in_features=DIM, lr=0.0)  # SGD with lr 0: every raw update is exactly 0


def _run(log_dir, placement, m=4, rounds=3, z=0.7, C=2.0, seed=0, plugins_extra=()):
    after = Recorder(order=300)
    trainer = quiet_trainer(log_dir, rounds=rounds, clients_per_round=m, seed=seed,
                            plugins=[UpdateClipping(C), GaussianNoise(noise_multiplier=z, placement=placement), after,
                                     *plugins_extra])
    module = trainer.fit(_zero_update_model(), tiny_data(dim=DIM))
    return trainer, module, after


def test_local_noise_std_is_z_times_C(log_dir):
    _, _, after = _run(log_dir, "local", m=4, rounds=3, z=0.7, C=2.0)
    noise = torch.stack(after.updates)  # 12 clients x 3386 values, raw updates are 0
    assert noise.numel() > 40_000
    assert noise.std().item() == pytest.approx(0.7 * 2.0, rel=TOL)
    assert abs(noise.mean().item()) < 5 * 1.4 / math.sqrt(noise.numel())
    corr = torch.corrcoef(noise[:4])  # different clients draw independent noise
    assert (corr - torch.eye(4)).abs().max() < 0.1


def test_distributed_noise_shares_sum_to_central_scale(log_dir):
    m, z, C = 8, 0.5, 1.0
    _, _, after = _run(log_dir, "distributed", m=m, rounds=2, z=z, C=C)
    shares = torch.stack(after.updates)
    assert shares.std().item() == pytest.approx(z * C / math.sqrt(m), rel=TOL)
    sums = torch.stack(after.aggregates)  # the sum over the cohort carries sigma = z*C
    assert sums.numel() > 6000
    assert sums.std().item() == pytest.approx(z * C, rel=0.05)


def test_central_noise_is_added_once_to_the_sum(log_dir):
    m, z, C = 5, 1.3, 0.5
    trainer, module, after = _run(log_dir, "central", m=m, rounds=4, z=z, C=C)
    assert all(torch.count_nonzero(u) == 0 for u in after.updates)  # clients send their (zero) updates
    sums = torch.stack(after.aggregates)
    assert sums.std().item() == pytest.approx(z * C, rel=TOL)


def test_central_noise_moves_the_model_by_sum_over_cohort(log_dir):
    m, z, C = 5, 1.0, 1.0
    model = _zero_update_model()
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    after = Recorder(order=300)
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=m,
                            plugins=[UpdateClipping(C), GaussianNoise(noise_multiplier=z), after])
    module = trainer.fit(model, tiny_data(dim=DIM))
    moved = module.global_params.double() - start.double()
    assert torch.allclose(moved, after.aggregates[0] / m, atol=1e-6)


def test_std_given_directly(log_dir):
    after = Recorder(order=300)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, plugins=[GaussianNoise(std=0.3, placement="local"), after])
    trainer.fit(_zero_update_model(), tiny_data(dim=DIM))
    assert torch.stack(after.updates).std().item() == pytest.approx(0.3, rel=TOL)


def test_noise_is_keyed_by_seed_round_client_and_shared_by_clip_and_norm(log_dir):
    _, _, a = _run(log_dir, "local", seed=5)
    _, _, b = _run(log_dir, "local", seed=5)
    _, _, c = _run(log_dir, "local", seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.updates, b.updates))
    assert not torch.equal(a.updates[0], c.updates[0])
    # same seed, clipping vs normalization: for zero updates both send exactly the same noise
    after_norm = Recorder(order=300)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, seed=5,
                            plugins=[UpdateNormalization(2.0), GaussianNoise(noise_multiplier=0.7, placement="local"), after_norm])
    trainer.fit(_zero_update_model(), tiny_data(dim=DIM))
    assert all(torch.equal(x, y) for x, y in zip(a.updates, after_norm.updates))


class SpyCommunicator(LocalCommunicator):
    """Records every tensor handed to a collective."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def allreduce_sum_(self, tensor):
        self.sent.append(tensor.detach().clone())
        return tensor

    def allreduce_max_(self, tensor):
        self.sent.append(tensor.detach().clone())
        return tensor

    def allgather_object(self, obj):
        self.sent.append(obj)
        return [obj]


def test_local_placement_never_sends_the_raw_update(log_dir):
    C, z = 1.0, 0.5
    raw, clipped = Recorder(order=10), Recorder(order=150)
    spy = SpyCommunicator()
    trainer = quiet_trainer(log_dir, rounds=6, clients_per_round=1,
                            plugins=[raw, UpdateClipping(C), clipped, GaussianNoise(noise_multiplier=z, placement="local")])
    trainer.comm = spy
    module = trainer.fit(TinyClassifier(in_features=DIM, lr=0.5), tiny_data(dim=DIM))
    d = module.num_parameters
    sums = [t[:d] for t in spy.sent if isinstance(t, torch.Tensor) and t.numel() >= d]
    assert len(sums) == 6  # one aggregate per round, each from a single client
    for sent, r, c in zip(sums, raw.updates, clipped.updates):
        assert torch.count_nonzero(r) > 0
        assert not torch.allclose(sent, r.double(), atol=1e-3)
        assert not torch.allclose(sent, c.double(), atol=1e-3)
        assert (sent - c.double()).std().item() == pytest.approx(z * C, rel=0.05)
    # the only other tensors are the per-segment maxima of already-noised rows
    small = [t for t in spy.sent if isinstance(t, torch.Tensor) and t.numel() < d]
    assert all(t.numel() <= 3 for t in small)


def test_noise_multiplier_needs_a_norm_bound(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[GaussianNoise(noise_multiplier=1.0)])
    with pytest.raises(ConfigError, match="UpdateClipping"):
        trainer.fit(TinyClassifier(), tiny_data())


def test_noise_refuses_sample_weighting(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, weighting="samples",
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    with pytest.raises(ConfigError, match="trainer.weighting"):
        trainer.fit(TinyClassifier(), tiny_data())


@pytest.mark.parametrize("kwargs", [{}, {"std": 1.0, "noise_multiplier": 1.0}, {"std": -1.0},
                                    {"noise_multiplier": 1.0, "placement": "nowhere"}])
def test_bad_noise_settings(kwargs):
    with pytest.raises(ConfigError):
        GaussianNoise(**kwargs)


def test_signal_to_noise_is_estimated_from_the_noised_sum():
    from dpfl_lightning.federated.payload import Aggregate

    g = torch.Generator().manual_seed(0)
    d, sigma = 200_000, 0.5
    signal = torch.randn(d, generator=g, dtype=torch.float64)
    signal *= 300.0 / signal.norm()  # ||s|| = 300, so the true SNR is 300 / (0.5 sqrt(2e5)) = 1.342
    noised = signal + sigma * torch.randn(d, generator=g, dtype=torch.float64)
    snr = GaussianNoise(noise_multiplier=1.0).signal_to_noise(Aggregate(0, {"update": noised}, 10, 10.0), sigma)
    # ||noised||^2 - d sigma^2 has sd ~ sigma^2 sqrt(2d) + 2 sigma ||s|| = 474: 1% of 300^2 = 900 is > 1.8 sd
    assert snr == pytest.approx(300.0 / (sigma * math.sqrt(d)), rel=0.01)
    zero = GaussianNoise(noise_multiplier=1.0).signal_to_noise(
        Aggregate(0, {"update": sigma * torch.randn(d, generator=g, dtype=torch.float64)}, 10, 10.0), sigma)
    assert zero < 0.15  # pure noise: sqrt(|chi^2 - d| sigma^2) / (sigma sqrt d) ~ (2/d)^(1/4) = 0.056


def test_an_unreachable_target_warns_with_the_target_and_the_std_it_calibrated(log_dir):
    """target_epsilon=1e-6 calibrates a noise std thousands of times the clip norm: the run is legal
    and private but learns nothing, and says so before training (as an explicit std that large does),
    naming the target, the calibrated std (the one the run then logs) and what to change."""
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=4, sampling="poisson",  # (fast to calibrate)
                            plugins=[UpdateClipping(0.5), GaussianNoise(target_epsilon=1e-6, delta=1e-3)])
    with pytest.warns(RuntimeWarning, match=r"target_epsilon=1e-06 \(delta=0\.001\) calibrates the noise std") as got:
        trainer.fit(TinyClassifier(), tiny_data(num_clients=10))
    (message,) = [str(w.message) for w in got if "calibrates" in str(w.message)]
    std = trainer.history[-1]["noise_std"]
    assert std >= 100 * 0.5  # the threshold: 100x the clip norm
    assert f"calibrates the noise std to {std:.4g} at clip norm 0.5" in message
    assert f"the noise std is {std / 0.5:.4g}x the clip norm" in message
    assert "raise target_epsilon (or delta), sample more clients per round, or train fewer rounds" in message


def test_a_reachable_target_does_not_warn(log_dir, recwarn):
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=4, sampling="poisson",
                            plugins=[UpdateClipping(0.5), GaussianNoise(target_epsilon=8.0, delta=1e-3)])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=10))
    assert trainer.history[-1]["noise_std"] < 100 * 0.5
    assert not [w for w in recwarn if "clip norm" in str(w.message)]


def test_an_explicit_std_that_drowns_every_update_warns_without_a_target(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2,
                            plugins=[UpdateClipping(0.5), GaussianNoise(std=100.0)])
    with pytest.warns(RuntimeWarning, match=r"^GaussianNoise: the noise std is 200x the clip norm.*lower std"):
        trainer.fit(TinyClassifier(), tiny_data(num_clients=10))
