"""Bounds that move: every mechanism's multiplier comes from the bound in force in the round it is
used, or the combination is refused at set-up (AdaptiveClip paired with each plugin whose noise or
range derives from the clip norm), and the ledger refuses a round whose mechanisms have drifted
from what it accounts. Expected epsilons are recomputed here with dp_accounting from what the run
logged, not taken from the ledger."""

import math

import dp_accounting
import pytest
import torch
from dp_accounting.rdp import RdpAccountant

from dpfl_lightning import ConfigError
from dpfl_lightning.federated.payload import UPDATE
from dpfl_lightning.plugins import (AdaptiveClip, FedEXP, GaussianNoise, PrivacyLedger, PrivUnitRandomizer,
                                    UpdateClipping)
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.privacy.mechanisms import Mechanism
from helpers import TinyClassifier, quiet_trainer, tiny_data


def _rdp(multipliers: list[float], delta: float, rate: float | None = None) -> float:
    acc = RdpAccountant()
    for z in multipliers:
        event = dp_accounting.GaussianDpEvent(z)
        acc.compose(event if rate is None else dp_accounting.PoissonSampledDpEvent(rate, event))
    return acc.get_epsilon(delta)


def _one(multipliers: list[float]) -> float:
    """Gaussians on the same sample compose as one of multiplier (sum z^-2)^-1/2."""
    return sum(z**-2 for z in multipliers) ** -0.5


def _fit(log_dir, plugins, rounds=8, clients=10, **kw):
    t = quiet_trainer(log_dir, rounds=rounds, plugins=plugins, **kw)
    t.fit(TinyClassifier(lr=0.5), tiny_data(num_clients=clients))
    return t


def test_a_fixed_std_under_an_adaptive_clip_is_refused(log_dir):
    # finding 1: the std stayed s while C_t grew, so the real multiplier s / C_t fell unaccounted
    with pytest.raises(ConfigError, match="GaussianNoise.std.*AdaptiveClip moves the norm bound"):
        _fit(log_dir, [AdaptiveClip(initial_clip=0.05), GaussianNoise(std=0.25)])


def test_noise_follows_the_adaptive_bound_and_the_ledger_matches_dp_accounting(log_dir):
    z, sigma_b = 1.5, 2.0
    t = _fit(log_dir, [AdaptiveClip(initial_clip=0.05, count_noise=sigma_b, learning_rate=0.5),
                       GaussianNoise(noise_multiplier=z), PrivacyLedger(delta=1e-5)], rounds=10)
    clips = [h["clip_norm"] for h in t.history]
    assert clips[-1] > 3 * clips[0]  # the bound moved a lot
    real = [h["noise_std"] / h["clip_norm"] for h in t.history]  # the multiplier actually in force
    assert real == pytest.approx([z] * len(real), rel=1e-12)
    expected = _rdp([_one([m, 2 * sigma_b]) for m in real], 1e-5)  # the count moves by 1/2: multiplier 2 sigma_b
    assert t.history[-1]["epsilon"] == pytest.approx(expected, rel=1e-9)


class _Spy(FederatedCallback):
    """Reads the squared-norm sum around FedEXP's noise: the difference is the round's xi draw."""

    def __init__(self, order, into):
        self.order, self.into = order, into

    def on_aggregate(self, *, server) -> None:
        self.into.append(server.aggregate.scalar("norm_sq"))


def test_cdp_fedexp_xi_follows_the_adaptive_bound(log_dir):
    # finding 2: xi's std was fixed from C_0 while the squared norms it protects are bounded by C_t^2
    z, sigma_b, M, rounds = 2.0, 5.0, 10, 40
    before, after = [], []
    t = _fit(log_dir, [AdaptiveClip(initial_clip=0.02, count_noise=sigma_b, learning_rate=0.5),
                       GaussianNoise(noise_multiplier=z), FedEXP(variant="cdp"), _Spy(799, before), _Spy(801, after),
                       PrivacyLedger(delta=1e-5)], rounds=rounds, clients=M)
    d = t.module.num_parameters
    clips = [h["clip_norm"] for h in t.history]
    assert clips[-1] > 5 * clips[0]
    xi_multiplier = d * z**2 / M  # paper 002 eq. (7): sigma_xi = d sigma^2 / M on the mean, sigma = z C / sqrt(M)
    # the draws in units of the round's sensitivity C_t^2 have one spread, whatever C_t was
    normalized = torch.tensor([(a - b) / c**2 for a, b, c in zip(after, before, clips)], dtype=torch.float64)
    spread = float(normalized.std()) / xi_multiplier
    assert 0.6 < spread < 1.4, spread  # chi-square with 39 degrees of freedom: far inside
    late = normalized[rounds // 2:].abs().mean() / normalized[: rounds // 2].abs().mean()
    assert 0.4 < float(late) < 2.5  # a std fixed at C_0 would shrink these by (C_0 / C_t)^2
    expected = _rdp([_one([z, 2 * sigma_b, xi_multiplier])] * rounds, 1e-5)
    assert t.history[-1]["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_a_fixed_sigma_xi_under_an_adaptive_clip_is_refused(log_dir):
    with pytest.raises(ConfigError, match="FedEXP.sigma_xi.*AdaptiveClip"):
        _fit(log_dir, [AdaptiveClip(), GaussianNoise(noise_multiplier=1.0), FedEXP(variant="cdp", sigma_xi=0.1)])


def test_privunit_after_an_adaptive_clip_is_refused_at_set_up(log_dir):
    t = quiet_trainer(log_dir, rounds=3, plugins=[AdaptiveClip(), PrivUnitRandomizer()])
    with pytest.raises(ConfigError, match="PrivUnitRandomizer.*moves every round"):
        t.fit(TinyClassifier(), tiny_data(num_clients=10))
    assert t.history == []  # refused before any round ran


def test_fixed_bounds_still_accept_a_fixed_std(log_dir):
    t = _fit(log_dir, [UpdateClipping(0.5), GaussianNoise(std=1.0), PrivacyLedger(delta=1e-5)], rounds=3)
    assert t.history[-1]["epsilon"] == pytest.approx(_rdp([2.0] * 3, 1e-5), rel=1e-9)


class _LeakyNoise(FederatedCallback):
    """A user's plugin that scales its declaration to the clip norm but keeps a fixed std: the bug of
    finding 1 in a plugin the set-up checks know nothing about."""

    order = 200

    def setup(self, *, ctx) -> None:
        self._bound = ctx.norm_bound((UPDATE,), before=self)

    def privacy_mechanisms(self, *, ctx):
        return [Mechanism.gaussian("LeakyNoise", 0.1, self._bound(), "central", (UPDATE,))]

    def on_aggregate(self, *, server) -> None:
        stream = server.random.stream(server.round_idx, -1, 9999)
        stream.add_normal_(server.aggregate[UPDATE], 0.1)


def test_the_ledger_refuses_a_round_whose_mechanism_drifted(log_dir):
    t = quiet_trainer(log_dir, rounds=10, plugins=[AdaptiveClip(initial_clip=0.02, learning_rate=1.0, count_noise=5.0),
                                                   _LeakyNoise(), PrivacyLedger(delta=1e-5)])
    with pytest.raises(ConfigError, match="LeakyNoise's noise fell"):
        t.fit(TinyClassifier(lr=0.5), tiny_data(num_clients=10))
    assert 1 <= len(t.history) < 10  # it ran until the bound moved, and not one round more


def test_target_epsilon_calibrates_the_composition_with_the_count(log_dir):
    # item 7: the target held for GaussianNoise alone; with the count added the run ended far above it
    q, sigma_b = 5 / 20, 1.0
    noise = GaussianNoise(target_epsilon=3.0, delta=1e-5)
    t = quiet_trainer(log_dir, rounds=10, clients_per_round=5, sampling="poisson",
                      plugins=[AdaptiveClip(initial_clip=0.5, count_noise=sigma_b), noise])
    t.fit(TinyClassifier(), tiny_data(num_clients=20))
    independent = _rdp([_one([noise.noise_multiplier, 2 * sigma_b])] * 10, 1e-5, rate=q)
    assert t.history[-1]["epsilon"] == pytest.approx(independent, rel=1e-9)
    assert 3.0 * 0.98 <= independent <= 3.0


def test_cdp_fedexp_planning_needs_the_model_size():
    from dpfl_lightning import FederatedTrainer
    from dpfl_lightning.algorithms import CDPFedEXP
    from dpfl_lightning.cli.privacy_command import plan_run

    def plan(model):
        t = FederatedTrainer(rounds=5, algorithm=CDPFedEXP(clip=1.0, noise_multiplier=0.5), enable_summary=False)
        return plan_run(t, tiny_data(num_clients=10), delta=1e-3, model=model)

    with pytest.raises(ConfigError, match="parameter count d"):
        plan(None)
    model = TinyClassifier()
    d = sum(p.numel() for p in model.parameters())
    xi = d * 0.5**2 / 10
    assert plan(model).planned_epsilons(5)["client_central"] == pytest.approx(_rdp([_one([0.5, xi])] * 5, 1e-3),
                                                                             rel=1e-9)


@pytest.mark.parametrize("make, setting", [
    (lambda: GaussianNoise(noise_multiplier=1e300), "GaussianNoise.noise_multiplier"),
    (lambda: GaussianNoise(noise_multiplier=True), "GaussianNoise.noise_multiplier"),
    (lambda: AdaptiveClip(learning_rate=1e6), "AdaptiveClip.learning_rate"),
])
def test_absurd_settings_get_one_line_naming_the_setting(make, setting):
    with pytest.raises(ConfigError) as err:
        make()
    assert str(err.value).startswith(setting) and "Fix:" in str(err.value) and "\n" not in str(err.value)


def test_a_tiny_std_is_refused_at_set_up(log_dir):
    with pytest.raises(ConfigError, match=r"GaussianNoise.std / C=1e-300"):
        _fit(log_dir, [UpdateClipping(1.0), GaussianNoise(std=1e-300)], rounds=1)


def test_calibration_inputs_are_checked():
    from dpfl_lightning.privacy.accountants import GaussianRelease, epsilon
    from dpfl_lightning.privacy.calibrate import calibrate_noise

    with pytest.raises(ConfigError, match="sampling_rate"):
        calibrate_noise(3.0, 1e-5, 10, sampling_rate=math.nan)
    with pytest.raises(ConfigError, match="steps"):
        epsilon(GaussianRelease(1.0, "poisson", 0.1), 2.5, 1e-5)


def test_epsilon_of_a_finished_trainer_at_any_delta(log_dir):
    t = _fit(log_dir, [UpdateClipping(0.5), GaussianNoise(noise_multiplier=2.0), PrivacyLedger(delta=1e-5)], rounds=3)
    assert t.epsilon() == t.history[-1]["epsilon"]
    assert t.epsilon(1e-7) == pytest.approx(_rdp([2.0] * 3, 1e-7), rel=1e-9)
    assert t.epsilon() == t.history[-1]["epsilon"]  # asking at another delta leaves the ledger as it was
    plain = quiet_trainer(log_dir, rounds=1)
    plain.fit(TinyClassifier(), tiny_data(num_clients=10))
    assert plain.epsilon() == math.inf


def test_a_useless_noise_level_is_warned_about(log_dir):
    with pytest.warns(RuntimeWarning, match="noise std is 500x the clip norm"):
        _fit(log_dir, [UpdateClipping(0.5), GaussianNoise(noise_multiplier=500.0)], rounds=1)
