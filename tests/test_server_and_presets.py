"""Server step, aggregation weights and denominators, presets, per-client evaluation."""

import pytest
import torch

from dpfl_lightning import ConfigError
from dpfl_lightning.algorithms import DPFedAvg, DPFedAvgLocal, DPNormFedAvg, FedAvg
from dpfl_lightning.plugins import GaussianNoise, ServerOptimizer, UpdateClipping, UpdateNormalization
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data


def _flat(model):
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()]).double()


def test_fedavg_adds_the_mean_update(log_dir):
    model = TinyClassifier()
    x0 = _flat(model)
    rec = Recorder(order=10)
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=6, plugins=[rec])
    fm = trainer.fit(model, tiny_data())
    mean = torch.stack(rec.updates).double().mean(0)
    assert torch.allclose(fm.global_params.double(), x0 + mean, atol=1e-6)


def test_server_momentum_follows_the_heavy_ball_rule(log_dir):
    model = TinyClassifier()
    x = _flat(model)
    rec = Recorder(order=10)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, plugins=[rec, ServerOptimizer("sgd", lr=0.5, momentum=0.9)])
    fm = trainer.fit(model, tiny_data())
    v = torch.zeros_like(x)
    for r in range(3):
        g = -torch.stack(rec.updates[4 * r : 4 * r + 4]).double().mean(0)
        v = 0.9 * v + g if r else g
        x = x - 0.5 * v
    assert torch.allclose(fm.global_params.double(), x, atol=1e-5)


def test_server_lr_decay_and_adam(log_dir):
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, plugins=[ServerOptimizer("adam", lr=0.01, lr_decay=0.5)])
    fm = trainer.fit(TinyClassifier(), tiny_data())
    opt = trainer.plugins[-1]
    state = opt.state_dict()["optimizer"]
    assert state["param_groups"][0]["lr"] == pytest.approx(0.01 * 0.5**2)
    assert "exp_avg" in state["state"][0] and torch.isfinite(fm.global_params).all()


def test_exactly_one_server_optimizer(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, plugins=[ServerOptimizer(), ServerOptimizer()])
    with pytest.raises(ConfigError, match="ServerOptimizer"):
        trainer.fit(TinyClassifier(), tiny_data())


def test_poisson_sampling_divides_by_the_expected_cohort(log_dir):
    model = TinyClassifier()
    x0 = _flat(model)
    rec = Recorder(order=300)
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=5, sampling="poisson", seed=2,
                            plugins=[UpdateClipping(1.0), rec])
    fm = trainer.fit(model, tiny_data(num_clients=20))
    n = len(rec.updates)
    assert trainer.history[0]["clients"] == n
    assert torch.allclose(fm.global_params.double(), x0 + rec.aggregates[0] / 5.0, atol=1e-6)  # q*M = 5


def test_sample_weighting(log_dir):
    from dpfl_lightning import FederatedDataModule

    x = torch.randn(30, 10)
    data = FederatedDataModule.from_tensors(x, torch.arange(30) % 10, num_clients=3, partition="dirichlet", alpha=1.0, seed=3)
    data.setup()
    sizes = [data.client_num_samples(c) for c in range(3)]
    assert len(set(sizes)) > 1
    model = TinyClassifier()
    x0 = _flat(model)
    rec = Recorder(order=10)
    trainer = quiet_trainer(log_dir, rounds=1, weighting="samples", plugins=[rec])
    fm = trainer.fit(model, data)
    w = torch.tensor(sizes, dtype=torch.float64)
    expected = x0 + (torch.stack(rec.updates).double() * w[:, None]).sum(0) / w.sum()
    assert torch.allclose(fm.global_params.double(), expected, atol=1e-6)


def test_update_in_lr_units_with_matching_server_lr_is_fedavg(log_dir):
    a = quiet_trainer(log_dir, rounds=2, clients_per_round=4, normalize_update_by_lr=True,
                      plugins=[ServerOptimizer("sgd", lr=0.05)]).fit(TinyClassifier(lr=0.05), tiny_data())
    b = quiet_trainer(log_dir, rounds=2, clients_per_round=4).fit(TinyClassifier(lr=0.05), tiny_data())
    assert torch.allclose(a.global_params, b.global_params, atol=1e-6)


def test_presets():
    kinds = lambda alg: [type(p).__name__ for p in alg.plugins()]  # noqa: E731
    assert kinds(FedAvg()) == ["ServerOptimizer"]
    assert kinds(DPFedAvg()) == ["UpdateClipping", "GaussianNoise", "ServerOptimizer"]
    assert DPFedAvgLocal().plugins()[1].placement == "local"
    norm = DPNormFedAvg(scale=40.0, noise_multiplier=2.0, server_lr=0.001)
    p = norm.plugins()
    assert isinstance(p[0], UpdateNormalization) and p[0].max_norm == 40.0
    assert isinstance(p[1], GaussianNoise) and p[1].placement == "distributed"
    assert DPNormFedAvg.normalize_update_by_lr and not DPFedAvg.normalize_update_by_lr


def test_preset_through_the_trainer(log_dir):
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=4, algorithm=DPNormFedAvg(scale=1.0, noise_multiplier=0.5))
    trainer.fit(TinyClassifier(), tiny_data())
    assert trainer.normalize_update_by_lr
    assert [type(p).__name__ for p in trainer.plugins] == ["UpdateNormalization", "GaussianNoise", "ServerOptimizer",
                                                         "PrivacyLedger"]


def test_per_client_evaluation(log_dir):
    from dpfl_lightning.data import Digits

    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=5, eval_per_client=True)
    trainer.fit(TinyClassifier(in_features=64), Digits(num_clients=10, client_test_fraction=0.3))
    last = trainer.history[-1]
    assert 0 <= last["client_my_val_acc_p10"] <= last["client_my_val_acc_mean"] <= 1


def test_presets_with_dp_sgd_clients_pass_every_dp_sgd_setting_on():
    from dpfl_lightning.algorithms import DPSCAFFOLD, PFL
    from dpfl_lightning.plugins import DPSGD

    for preset in (PFL(noise_multiplier=0.7, max_grad_norm=2.0, sampling="fixed", fix_model=True, accountant="pld"),
                   DPSCAFFOLD(noise_multiplier=0.7, max_grad_norm=2.0, sampling="fixed", fix_model=True, accountant="pld")):
        (dpsgd,) = [p for p in preset.plugins() if isinstance(p, DPSGD)]
        assert (dpsgd.noise_multiplier, dpsgd.max_grad_norm, dpsgd.sampling, dpsgd.fix_model, dpsgd.accountant) == \
            (0.7, 2.0, "fixed", True, "pld")
