"""Noise sized to a norm bound on the update is refused at set-up, with the setting and the fix, when no
plugin before it bounds the update (the one check the noise plugins share: sensitivity.required_update_bound)."""

import pytest

from dpfl_lightning import ConfigError
from dpfl_lightning.plugins import CorrelatedNoise, DiscreteDistributedNoise, PrivUnitRandomizer, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, tiny_data

CASES = [
    (lambda: CorrelatedNoise("banded", noise_multiplier=1.0), {"sampling": "cyclic"}, "CorrelatedNoise=banded"),
    (lambda: DiscreteDistributedNoise("discrete_gaussian", noise_multiplier=1.0), {}, "DiscreteDistributedNoise="),
    (lambda: PrivUnitRandomizer(), {}, "PrivUnitRandomizer=update"),
]


@pytest.mark.parametrize("make, kw, setting", CASES, ids=["correlated", "discrete", "privunit"])
def test_noise_without_a_bound_before_it_is_refused(log_dir, make, kw, setting):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=[make()], **kw)
    with pytest.raises(ConfigError, match="no UpdateClipping or UpdateNormalization") as info:
        trainer.fit(TinyClassifier(), tiny_data())
    text = str(info.value)
    assert setting in text.replace(" ", "") or setting.split("=")[0] in text
    assert "UpdateClipping(C)" in text


@pytest.mark.parametrize("make, kw, setting", CASES, ids=["correlated", "discrete", "privunit"])
def test_the_same_noise_after_clipping_sets_up(log_dir, make, kw, setting):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=[UpdateClipping(1.0), make()], **kw)
    trainer.fit(TinyClassifier(), tiny_data())
    assert trainer.history
