"""What a DP run must not do: log un-noised client statistics, lose noise when skipping a client,
over-amplify towards the server, re-account resumed rounds with another mechanism; and the
vectorised executor must refuse what it cannot run."""

import math
import os

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from dp_accounting import rdp as dp_rdp
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy import optimize, stats
from torch import nn

from dpfl_lightning import ConfigError, FederatedDataModule
from dpfl_lightning.comm import LocalCommunicator
from dpfl_lightning.plugins import DPSGD, GaussianNoise, UpdateClipping
from dpfl_lightning.privacy import GaussianRelease, epsilon
from dpfl_lightning.plugins import PrivacyLedger
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data


class ObjectSpy(LocalCommunicator):
    def __init__(self):
        self.objects = []

    def allgather_object(self, obj):
        self.objects.append(obj)
        return [obj]


def test_dp_run_gathers_and_logs_no_client_training_metrics(log_dir):
    spy = ObjectSpy()
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=3,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local")])
    trainer.comm = spy
    trainer.fit(TinyClassifier(), tiny_data())
    assert spy.objects == []
    assert all("my_train_loss" not in h for h in trainer.history)
    assert "my_val_acc" in trainer.history[-1]  # the global model's evaluation is not a client release


def test_opt_in_logs_them(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, log_client_metrics=True,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    trainer.fit(TinyClassifier(), tiny_data())
    assert "my_train_loss" in trainer.history[-1]


def test_per_client_evaluation_is_refused_in_a_dp_run(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, eval_per_client=True,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    with pytest.raises(ConfigError, match="trainer.eval_per_client"):
        trainer.fit(TinyClassifier(), tiny_data())


def test_poisson_cohort_size_is_not_logged_in_a_dp_run(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, sampling="poisson",
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    trainer.fit(TinyClassifier(), tiny_data())
    assert "clients" not in trainer.history[-1]


def test_skipped_client_keeps_its_distributed_noise_share(log_dir):
    x = torch.randn(80, 200)
    x[0] = float("nan")  # one client's training diverges every round
    data = FederatedDataModule.from_tensors(x, torch.arange(80) % 10, num_clients=4, partition="iid", seed=0)
    after = Recorder(order=300)
    z, C = 1.0, 1.0
    trainer = quiet_trainer(log_dir, rounds=12, on_nonfinite="skip", log_client_metrics=True,
                            plugins=[UpdateClipping(C), GaussianNoise(noise_multiplier=z, placement="distributed"), after])
    trainer.fit(TinyClassifier(in_features=200, lr=0.0), data)
    assert [h["skipped_clients"] for h in trainer.history] == [1.0] * 12
    sums = torch.stack(after.aggregates)  # 12 x 3386 draws: the full sigma, not sqrt(3/4) of it
    assert sums.std().item() == pytest.approx(z * C, rel=0.04)


def test_distributed_noise_is_not_amplified_towards_the_server(log_dir):
    ledger = PrivacyLedger(delta=1e-4)
    trainer = quiet_trainer(log_dir, rounds=6, clients_per_round=4, sampling="poisson",
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=3.0, placement="distributed"), ledger])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=40))
    n = int(ledger.counts["client_distributed"].max())
    server = dp_rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    server.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0 / 2), n))
    models = dp_rdp.RdpAccountant()
    models.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(3.0)), 6))
    assert trainer.history[-1]["epsilon"] == server.get_epsilon(1e-4)
    assert trainer.history[-1]["epsilon_client_distributed_models"] == models.get_epsilon(1e-4)


def test_pld_replace_one_without_sampling_is_the_gaussian_closed_form():
    z, T, delta = 1.0, 10, 1e-5  # multiplier = std / distance between neighbours (2C for replace-one)
    mu = math.sqrt(T) / z
    exact = optimize.brentq(lambda e: stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta, 1e-6, 80)
    release = GaussianRelease(z, "none", 1.0, "replace_one")
    assert epsilon(release, T, delta, "pld").epsilon == pytest.approx(exact, rel=1e-3)
    assert epsilon(release, T, delta, "prv").epsilon == pytest.approx(exact, rel=0.01)


def test_resume_with_another_mechanism_is_refused(tmp_path):
    def trainer(log_dir, z, **kw):
        return quiet_trainer(log_dir, rounds=4, clients_per_round=3, plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=z)], **kw)

    a = trainer(str(tmp_path / "a"), 2.0, checkpoint_every=2)
    a.fit(TinyClassifier(), tiny_data())
    b = trainer(str(tmp_path / "b"), 20.0)
    with pytest.raises(ConfigError, match="resume"):
        b.fit(TinyClassifier(), tiny_data(), ckpt_path=os.path.join(a.checkpoint_dir, "round-000002.ckpt"))


def test_resumed_calibrated_run_keeps_its_noise(tmp_path):
    def trainer(log_dir, rounds, **kw):
        noise = GaussianNoise(target_epsilon=3.0, delta=1e-4)
        return quiet_trainer(log_dir, rounds=rounds, clients_per_round=3, sampling="poisson",
                             plugins=[UpdateClipping(1.0), noise], **kw), noise

    a, na = trainer(str(tmp_path / "a"), 6, checkpoint_every=3)
    a.fit(TinyClassifier(), tiny_data())
    b, nb = trainer(str(tmp_path / "b"), 12)  # more rounds would calibrate a larger z
    b.fit(TinyClassifier(), tiny_data(), ckpt_path=os.path.join(a.checkpoint_dir, "round-000003.ckpt"))
    assert nb.noise_multiplier == na.noise_multiplier
    assert b.history[-1]["epsilon"] > 3.0  # the ledger tells the truth about the longer run


def test_weighting_by_samples_uses_dataset_sizes(log_dir):
    x = torch.randn(60, 10)
    data = FederatedDataModule.from_tensors(x, torch.arange(60) % 10, num_clients=3, partition="dirichlet", alpha=1.0, seed=3)
    data.setup()
    sizes = torch.tensor([data.client_num_samples(c) for c in range(3)], dtype=torch.float64)
    model = TinyClassifier()
    x0 = torch.cat([p.detach().flatten().clone() for p in model.parameters()]).double()
    rec = Recorder(order=10)
    fm = quiet_trainer(log_dir, rounds=1, weighting="samples", local_steps=2, plugins=[rec]).fit(model, data)
    expected = x0 + (torch.stack(rec.updates).double() * sizes[:, None]).sum(0) / sizes.sum()
    assert torch.allclose(fm.global_params.double(), expected, atol=1e-6)


def test_dp_needs_uniform_weighting_also_with_dpsgd(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, weighting="samples", plugins=[DPSGD(noise_multiplier=1.0)])
    with pytest.raises(ConfigError, match="trainer.weighting"):
        trainer.fit(TinyClassifier(), tiny_data())


class Temperature(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.log_temp = nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x) * self.log_temp.exp(), y)


def test_dpsgd_refuses_parameters_without_per_record_gradients(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0)])
    with pytest.raises(ConfigError, match="log_temp"):
        trainer.fit(Temperature(), tiny_data())


class WithRunningStats(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))


def test_batchnorm_running_statistics_are_refused(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2)
    with pytest.raises(ConfigError, match="track_running_stats"):
        trainer.fit(WithRunningStats(), tiny_data())


def test_a_round_without_clients_carries_the_distributed_noise_in_full(log_dir):
    """Poisson rounds with an empty cohort: the sum is noised with the full sigma (the server stands in
    for the absent shares), as in a round whose one client sends its share: an exact zero would tell
    a neighbour without that client apart."""
    after = Recorder(order=300)
    z, C = 1.0, 1.0
    trainer = quiet_trainer(log_dir, rounds=6, sampling="poisson", sampling_rate=1e-9,
                            plugins=[UpdateClipping(C), GaussianNoise(noise_multiplier=z, placement="distributed"), after])
    trainer.fit(TinyClassifier(in_features=200, lr=0.0), tiny_data(num_clients=4, dim=200))
    sums = torch.stack(after.aggregates)  # 6 empty rounds x the update's entries
    assert sums.abs().sum() > 0 and sums.std().item() == pytest.approx(z * C, rel=0.05)
