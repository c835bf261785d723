"""No silent downgrade: local noise that buys no local guarantee is said at set-up, and each epsilon
names the accountant that gave it (RDP's bound where the one asked for cannot account the release)."""

from __future__ import annotations

import warnings

import pytest

from dpfl_lightning.tracking.loggers import epsilon_notes
from dpfl_lightning.plugins import AdaptiveClip, GaussianNoise, PrivacyLedger, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, tiny_data


def _fit(log_dir, plugins, **kw):
    trainer = quiet_trainer(log_dir, rounds=2, local_steps=1, plugins=plugins, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyClassifier(), tiny_data(num_clients=20))
    return trainer, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_local_noise_next_to_a_central_count_is_said_to_give_no_local_guarantee(log_dir):
    trainer, said = _fit(log_dir, [AdaptiveClip(1.0), GaussianNoise(noise_multiplier=1.0, placement="local")],
                         clients_per_round=10)
    downgrade = [s for s in said if "gives no local DP" in s]
    assert len(downgrade) == 1, said
    assert downgrade[0].startswith("GaussianNoise: placement='local' gives no local DP in this run: AdaptiveClip's "
                                   "clip_bit is noised centrally")
    assert [g.name for g in trainer.ledger.guarantees] == ["client_central"]  # what the warning says is reported


@pytest.mark.parametrize("plugins", [
    lambda: [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local")],
    lambda: [AdaptiveClip(1.0), GaussianNoise(noise_multiplier=1.0, placement="central")],
    lambda: [AdaptiveClip(1.0, placement="distributed"), GaussianNoise(noise_multiplier=1.0, placement="local")],
], ids=["local", "central", "local-with-distributed-count"])
def test_consistent_placements_say_nothing(log_dir, plugins):
    _, said = _fit(log_dir, plugins(), clients_per_round=10)
    assert not [s for s in said if "gives no local DP" in s], said


@pytest.mark.parametrize("accountant", ["pld", "prv"])
def test_uniform_sampling_names_the_rdp_bound_it_reports(log_dir, accountant):
    trainer, _ = _fit(log_dir, [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0),
                                PrivacyLedger(accountant=accountant)], clients_per_round=5)
    line = trainer.ledger.describe()[0]
    assert f"rdp accountant ({accountant} was asked for; {accountant} does not support sampling without " \
           "replacement: RDP upper bound), delta=" in line, line
    assert epsilon_notes(trainer.ledger)["epsilon"].endswith(f"rdp accountant, not {accountant})")
    rdp, _ = _fit(log_dir, [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0), PrivacyLedger(accountant="rdp")],
                  clients_per_round=5)
    assert trainer.epsilon() == rdp.epsilon()  # it is RDP's value that is reported


def test_poisson_sampling_names_the_accountant_asked_for(log_dir):
    trainer, _ = _fit(log_dir, [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0),
                                PrivacyLedger(accountant="pld")], sampling="poisson", sampling_rate=0.25)
    assert trainer.ledger.describe()[0].endswith(f"; pld accountant, delta={trainer.ledger.delta:g}")
    assert "accountant" not in epsilon_notes(trainer.ledger)["epsilon"]
