"""Secure mode: noise and sampling nobody can reproduce from the config, the logs or the checkpoints,
and per-client accounting that does not need to know the cohorts."""

import glob
import math
import os

import dp_accounting
import pytest
import torch
from dp_accounting import rdp as dp_rdp
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy import stats

from dpfl_lightning import rng
from dpfl_lightning.plugins import DPSGD, GaussianNoise, PrivacyLedger, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data


class Cohorts(FederatedCallback):
    def __init__(self):
        self.cohorts = []

    def before_round(self, *, plan, server):
        self.cohorts.append(plan.cohort)


def _run(log_dir, secure, seed=3, **kw):
    after, cohorts = Recorder(order=300), Cohorts()
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=5, sampling="poisson", seed=seed, secure=secure,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local"), after,
                                     cohorts], **kw)
    module = trainer.fit(TinyClassifier(in_features=50, lr=0.0), tiny_data(num_clients=30, dim=50))
    return trainer, module, after, cohorts


def test_secure_runs_differ_in_noise_and_cohorts_simulations_do_not(log_dir):
    _, m1, a1, c1 = _run(log_dir, True)
    _, m2, a2, c2 = _run(log_dir, True)
    assert not torch.equal(m1.global_params, m2.global_params)
    assert c1.cohorts != c2.cohorts
    _, s1, _, d1 = _run(log_dir, False)
    _, s2, _, d2 = _run(log_dir, False)
    assert torch.equal(s1.global_params, s2.global_params) and d1.cohorts == d2.cohorts
    assert a1.updates[0].std().item() == pytest.approx(1.0, rel=0.1)  # still sigma = z C


def test_a_seed_search_over_the_logged_config_does_not_find_the_noise(log_dir):
    trainer, _, after, cohorts = _run(log_dir, True, seed=11)
    noise = after.updates[0]  # zero update: the release is the noise
    client, r = after.clients[0], 0
    logged_seed = trainer.seed
    for seed in [logged_seed, *range(300)]:
        candidates = [rng.RandomSource(seed).stream(r, client, rng.CLIENT_NOISE, tag="update").normal(noise.shape, 1.0),
                      torch.randn(noise.shape, generator=torch.Generator().manual_seed(seed))]
        for cand in candidates:
            corr = torch.corrcoef(torch.stack([cand, noise]))[0, 1].item()
            assert abs(corr) < 0.2  # a match would give 1


def test_the_seed_search_finds_the_noise_of_a_simulation(log_dir):
    # The attack above is real: without secure mode, the logged seed gives the noise back exactly.
    trainer, _, after, _ = _run(log_dir, False, seed=11)
    noise = after.updates[0]
    cand = rng.RandomSource(trainer.seed).stream(0, after.clients[0], rng.CLIENT_NOISE, tag="update").normal(noise.shape, 1.0)
    assert torch.corrcoef(torch.stack([cand, noise]))[0, 1].item() > 0.999


def test_dpsgd_noise_differs_between_secure_runs(log_dir):
    class ZeroGrad(TinyClassifier):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            return 0.0 * self(x).sum()

    def run(secure):
        t = quiet_trainer(log_dir, rounds=1, clients_per_round=2, seed=4, secure=secure,
                          plugins=[DPSGD(noise_multiplier=1.0)])
        return t.fit(ZeroGrad(lr=1.0), tiny_data(num_clients=4)).global_params.clone()

    assert not torch.equal(run(True), run(True))
    assert torch.equal(run(False), run(False))


def test_the_secret_is_in_no_file_the_run_writes(tmp_path):
    trainer, *_ = _run(str(tmp_path), True, checkpoint_every=1)
    secret = trainer.run.random._secret
    assert secret is not None and len(secret) == 32
    files = [f for f in glob.glob(str(tmp_path / "**" / "*"), recursive=True) if os.path.isfile(f)]
    assert any(f.endswith(".ckpt") for f in files) and any(f.endswith(".csv") for f in files)
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        assert secret not in data and secret.hex().encode() not in data, f


def test_secure_checkpoints_do_not_reveal_cohorts(tmp_path):
    # Two successive checkpoints' per-client participation counts would give the round's cohort,
    # which the secure guarantee (amplification by sampling) keeps secret.
    from dpfl_lightning.run import checkpoint_format as checkpoint

    def plugin_state_counts(secure):
        ledger = PrivacyLedger(delta=1e-4)
        d = tmp_path / str(secure)
        t = quiet_trainer(str(d), rounds=3, clients_per_round=5, sampling="poisson", secure=secure, checkpoint_every=1,
                          plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local"), ledger])
        t.fit(TinyClassifier(), tiny_data(num_clients=30))
        files = sorted(glob.glob(str(d / "**" / "round-*.ckpt"), recursive=True))
        assert len(files) == 3
        found = []
        for f in files:
            blob = checkpoint.load(f)
            found += [v for k, v in _walk(blob) if k.endswith("counts") and v]
            found += list(blob["client_states"])  # the ids of clients with state: who took part
        return found, ledger

    found, ledger = plugin_state_counts(False)
    assert found  # a simulation checkpoints them (the seed gives the cohorts anyway)
    found, ledger = plugin_state_counts(True)
    assert not found
    assert all(not c.any() for c in ledger.counts.values())
    assert math.isfinite(ledger.client_epsilon(0))


def _walk(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{prefix}.{k}")
            yield f"{prefix}.{k}", v


def test_secure_per_client_epsilon_uses_a_binomial_participation_bound(log_dir):
    ledger = PrivacyLedger(delta=1e-4)
    rounds, q, z = 6, 5 / 30, 1.5
    trainer = quiet_trainer(log_dir, rounds=rounds, clients_per_round=5, sampling="poisson", secure=True,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=z, placement="local"), ledger])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=30))
    tail = 1e-5  # a tenth of delta
    for t, row in enumerate(trainer.history, start=1):
        k = next(k for k in range(t + 1) if stats.binom.sf(k, t, q) <= tail)  # P(Bin(t, q) > k) <= tail
        acc = dp_rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z / 2), k))
        assert row["epsilon"] == acc.get_epsilon(1e-4 - tail)
    assert math.isfinite(trainer.history[-1]["epsilon"])


def test_secure_checkpoints_with_per_client_state_warn_that_they_reveal_cohorts(tmp_path):
    from dpfl_lightning.plugins import SCAFFOLD

    t = quiet_trainer(str(tmp_path), rounds=2, clients_per_round=2, secure=True, checkpoint_every=1,
                      plugins=[SCAFFOLD(warm_start=False)])
    with pytest.warns(UserWarning, match="reveal the cohorts"):
        t.fit(TinyClassifier(), tiny_data(num_clients=6))
