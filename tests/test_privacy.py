"""Accounting: equal to dp_accounting's RDP, PLD/PRV within 1%, calibration never above target,
monotone, and the ledger (budget, resume, participation counting)."""

import math
import os

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld as dp_pld
from dp_accounting import rdp as dp_rdp
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy import optimize, stats

from dpfl_lightning import ConfigError
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping, UpdateNormalization
from dpfl_lightning.privacy import GaussianRelease, Release, calibrate_noise, epsilon, max_steps
from dpfl_lightning.privacy.accountants import DEFAULT_RDP_ORDERS, fast_rdp_poisson_gaussian, rdp_curve
from dpfl_lightning.plugins import PrivacyLedger
from helpers import TinyClassifier, quiet_trainer, tiny_data


def _reference_rdp(q, z, steps, delta, relation=NeighboringRelation.ADD_OR_REMOVE_ONE):
    acc = dp_rdp.RdpAccountant(neighboring_relation=relation)
    event = dp_accounting.GaussianDpEvent(z) if q == 1 else dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("q", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("z", [0.7, 1.5, 4.0])
@pytest.mark.parametrize("steps", [1, 100, 3000])
def test_rdp_equals_dp_accounting_exactly(q, z, steps):
    for delta in (1e-5, 1e-8):
        ours = epsilon(GaussianRelease(z, "poisson", q), steps, delta, "rdp")
        assert ours.method == "rdp"
        assert ours.epsilon == _reference_rdp(q, z, steps, delta)


@pytest.mark.parametrize("q,z,steps,delta", [(0.01, 0.8, 1000, 1e-5), (0.1, 1.0, 500, 1e-3), (0.05, 2.0, 3000, 1e-6),
                                             (1.0, 5.0, 200, 1e-5), (0.2, 1.2, 50, 1e-5)])
def test_pld_and_prv_agree_within_one_percent(q, z, steps, delta):
    ref = dp_pld.PLDAccountant()  # dp_accounting's defaults (finer discretisation than ours)
    ref.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)) if q < 1 else dp_accounting.GaussianDpEvent(z), steps))
    ref_eps = ref.get_epsilon(delta)
    ours = epsilon(GaussianRelease(z, "poisson", q), steps, delta, "pld").epsilon
    assert ours == pytest.approx(ref_eps, rel=0.01)
    assert ours >= ref_eps * (1 - 1e-3)  # a coarser pessimistic discretisation is not optimistic
    prv = epsilon(GaussianRelease(z, "poisson", q), steps, delta, "prv")
    assert prv.method == "prv" and prv.epsilon == pytest.approx(ref_eps, rel=0.01)
    assert ours <= _reference_rdp(q, z, steps, delta) + 1e-9  # PLD is at least as tight as RDP


def test_known_values_from_the_libraries():
    # DESIGN.md: N=1000, cohort 100, T=500, z=1, delta=1e-3 -> RDP 14.04 (Opacus and dp_accounting), PRV/PLD ~12.46
    r = GaussianRelease(1.0, "poisson", 0.1)
    assert epsilon(r, 500, 1e-3, "rdp").epsilon == pytest.approx(14.04, abs=0.01)
    assert epsilon(r, 500, 1e-3, "pld").epsilon == pytest.approx(12.46, abs=0.02)


def test_full_participation_pld_matches_the_gaussian_dp_closed_form():
    # T Gaussian mechanisms with multiplier z are exactly mu-GDP with mu = sqrt(T)/z (Dong, Roth, Su):
    # delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2).
    T, z, delta = 400, 20.0, 1e-6
    mu = math.sqrt(T) / z
    exact = optimize.brentq(lambda e: stats.norm.cdf(-e / mu + mu / 2) - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta, 1e-6, 50)
    ours = epsilon(GaussianRelease(z), T, delta, "pld").epsilon
    assert ours == pytest.approx(exact, rel=0.01) and ours >= exact * (1 - 1e-6)


@pytest.mark.parametrize("z", [0.4, 1.338, 3.0, 20.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-4, 1e-8])
def test_the_exact_gaussian_epsilon_equals_balle_and_wangs_formula(z, delta):
    from dpfl_lightning.privacy.accountants import gaussian_epsilon

    ours = gaussian_epsilon(z, delta)

    def excess(e):  # Balle & Wang 2018, Thm 8, with scipy's normal cdf (not the package's log-space one)
        return stats.norm.cdf(0.5 / z - e * z) - math.exp(e) * stats.norm.cdf(-0.5 / z - e * z) - delta

    assert ours == pytest.approx(optimize.brentq(excess, 0.0, 100.0, xtol=1e-14), rel=1e-9, abs=1e-12)
    assert excess(ours) <= 1e-15 and excess(ours * (1 - 1e-6)) > 0  # never below, and the least
    # every accountant bounds it from above
    assert ours <= epsilon(GaussianRelease(z), 1, delta, "rdp").epsilon
    assert ours <= epsilon(GaussianRelease(z), 1, delta, "pld").epsilon * (1 + 1e-9)


def test_the_issues_ftrl_value_rdp_against_exact():
    from dpfl_lightning.privacy.accountants import gaussian_epsilon

    # ftrl_*.yaml before: z = 1.338 (printed to 4 digits) for one Gaussian over the stream, delta 1e-4,
    # calibrated under rdp: rdp 2.977, exactly 2.701
    assert epsilon(GaussianRelease(1.338), 1, 1e-4, "rdp").epsilon == pytest.approx(2.977, abs=2e-3)
    assert gaussian_epsilon(1.338, 1e-4) == pytest.approx(2.701, abs=1e-3)


def test_composed_unamplified_gaussians_are_one_exact_gaussian():
    from dpfl_lightning.privacy.accountants import EXACT, one_gaussian
    from dpfl_lightning.privacy.mechanisms import Stream

    add = NeighboringRelation.ADD_OR_REMOVE_ONE
    g = dp_accounting.GaussianDpEvent
    assert one_gaussian([(g(2.0), add), (dp_accounting.SelfComposedDpEvent(g(4.0), 3), add)]) == \
        pytest.approx((2.0 ** -2 + 3 * 4.0 ** -2) ** -0.5, rel=1e-15)
    assert one_gaussian([(dp_accounting.PoissonSampledDpEvent(0.5, g(1.0)), add)]) is None
    assert one_gaussian([(g(1.0), NeighboringRelation.REPLACE_SPECIAL)]) is None
    # a stream with another Gaussian composed per participation: one Gaussian, exactly
    stream = Stream("gaussian", 1.5, rounds=12, min_sep=3)
    release = Release((g(6.0),), stream=stream)
    res = epsilon(release, 12, 1e-5, "rdp")
    expected_z = (1.5 ** -2 + (6.0 / 2.0) ** -2) ** -0.5  # 4 participations: the other is 6 / sqrt(4)
    exact = optimize.brentq(lambda e: stats.norm.cdf(0.5 / expected_z - e * expected_z) - math.exp(e)
                            * stats.norm.cdf(-0.5 / expected_z - e * expected_z) - 1e-5, 0, 100, xtol=1e-14)
    assert res.method == EXACT and res.epsilon == pytest.approx(exact, rel=1e-9)
    # amplified per participation: not one Gaussian, the asked accountant's
    amplified = Release((), stream=Stream("participations", 1.5, rounds=12, min_sep=3, rate=0.5))
    assert epsilon(amplified, 12, 1e-5, "rdp").method == "rdp"


def _exact_rr_epsilon(eps0: float, k: int, delta: float) -> float:
    """k-fold binary randomized response with epsilon0 each, exactly: the privacy loss is
    eps0 * (2 B - k) with B ~ Binomial(k, e^eps0 / (1 + e^eps0)), and
    delta(eps) = E[(1 - e^(eps - L))_+] under the first neighbour."""
    p = math.exp(eps0) / (1 + math.exp(eps0))
    j = np.arange(k + 1)
    loss = eps0 * (2 * j - k)
    pmf = stats.binom.pmf(j, k, p)

    def excess(e):
        return float(np.sum(pmf * np.clip(1 - np.exp(e - loss), 0, None))) - delta
    return optimize.brentq(excess, 0.0, k * eps0) if excess(0.0) > 0 else 0.0


@pytest.mark.parametrize("k", [1, 4, 30])
def test_pld_composes_randomized_response_over_steps(k):
    # A pure-eps0 local randomizer (PrivUnit, RR) used k times: the PLD must grow with k and match
    # the exact composition (dp_accounting's PLDAccountant alone drops the count).
    eps0, delta = 1.0, 1e-5
    rr = dp_accounting.RandomizedResponseDpEvent(2 / (1 + math.exp(eps0)), 2)
    ours = epsilon(Release((rr,), relation="replace_one"), k, delta, "pld").epsilon
    exact = _exact_rr_epsilon(eps0, k, delta)
    assert ours >= exact - 1e-6
    assert ours == pytest.approx(exact, abs=0.02 * k ** 0.5 + 1e-3)


def test_pld_of_gaussian_and_randomized_response_on_one_sample():
    # A Gaussian (multiplier in units of the neighbours' distance) and an RR release composed:
    # the PLD must not double the Gaussian's distance under replace-one and must grow with steps.
    rr = dp_accounting.RandomizedResponseDpEvent(2 / (1 + math.exp(0.5)), 2)
    both = Release((dp_accounting.GaussianDpEvent(4.0), rr), relation="replace_one")
    e10 = epsilon(both, 10, 1e-5, "pld").epsilon
    e40 = epsilon(both, 40, 1e-5, "pld").epsilon
    gauss_only = epsilon(GaussianRelease(4.0), 10, 1e-5, "pld").epsilon
    assert e40 > e10 > gauss_only
    assert e10 <= epsilon(both, 10, 1e-5, "rdp").epsilon + 1e-6  # never looser than RDP


def test_vectorised_rdp_curve_matches_dp_accounting():
    for q, z in [(0.05, 0.8), (0.3, 0.6), (0.001, 5.0)]:
        exact = rdp_curve(GaussianRelease(z, "poisson", q))
        fast = fast_rdp_poisson_gaussian(q, z)
        assert np.array_equal(np.isfinite(exact), np.isfinite(fast))
        ok = np.isfinite(exact)
        assert np.allclose(fast[ok], exact[ok], rtol=1e-10, atol=0)
        assert len(exact) == len(DEFAULT_RDP_ORDERS)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("target,rounds,q", [(2.0, 1000, 0.05), (1.0, 50, 1.0), (8.0, 200, 0.01)])
def test_calibration_round_trip(accountant, target, rounds, q):
    z = calibrate_noise(target, 1e-6, rounds, q, accountant=accountant)
    eps = epsilon(GaussianRelease(z, "poisson" if q < 1 else "none", q), rounds, 1e-6, accountant).epsilon
    assert target * 0.99 <= eps <= target


def test_calibration_without_replacement():
    z = calibrate_noise(3.0, 1e-5, 100, sampling="without_replacement", relation="replace_one", population=1000,
                        sample_size=50)
    eps = epsilon(GaussianRelease(z, "without_replacement", relation="replace_one", population=1000, sample_size=50),
                  100, 1e-5).epsilon
    assert 3.0 * 0.99 <= eps <= 3.0


def test_max_steps_is_the_inverse():
    z, target, q = 1.1, 4.0, 0.02
    t = max_steps(z, target, 1e-6, q)
    r = GaussianRelease(z, "poisson", q)
    assert epsilon(r, t, 1e-6).epsilon <= target < epsilon(r, t + 1, 1e-6).epsilon
    assert max_steps(0.3, 0.01, 1e-6, 1.0) == 0


def test_monotone_in_rounds_and_noise():
    r = lambda z: GaussianRelease(z, "poisson", 0.05)  # noqa: E731
    by_rounds = [epsilon(r(1.0), t, 1e-5).epsilon for t in (1, 10, 100, 1000)]
    assert by_rounds == sorted(by_rounds) and len(set(by_rounds)) == 4
    by_noise = [epsilon(r(z), 500, 1e-5).epsilon for z in (0.6, 1.0, 2.0, 8.0)]
    assert by_noise == sorted(by_noise, reverse=True)


@pytest.mark.parametrize("kwargs,setting", [({"target_epsilon": 0.0}, "target_epsilon"), ({"target_epsilon": -1.0}, "target_epsilon"),
                                            ({"delta": 0.0}, "delta"), ({"delta": 1.0}, "delta"), ({"accountant": "moments"}, "accountant")])
def test_bad_calibration_input(kwargs, setting):
    args = {"target_epsilon": 1.0, "delta": 1e-5, "steps": 10, "sampling_rate": 0.1, **kwargs}
    with pytest.raises(ConfigError, match=setting):
        calibrate_noise(**args)


def test_unreachable_target():
    with pytest.raises(ConfigError, match="unreachable"):
        calibrate_noise(1e-6, 1e-12, 10**6, 1.0)


# ------------------------------------------------------------------------------------ the ledger
def _dp_trainer(log_dir, placement="central", rounds=6, ledger=None, **kw):
    plugins = [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.5, placement=placement)]
    if ledger is not None:
        plugins.append(ledger)
    return quiet_trainer(log_dir, rounds=rounds, clients_per_round=4, plugins=plugins, **kw)


def test_ledger_logs_epsilon_every_round_and_matches_the_accountant(log_dir):
    trainer = _dp_trainer(log_dir, sampling="poisson", ledger=PrivacyLedger(delta=1e-4))
    trainer.fit(TinyClassifier(), tiny_data(num_clients=40))
    q = 4 / 40
    for t, h in enumerate(trainer.history, start=1):
        assert h["epsilon"] == _reference_rdp(q, 1.5, t, 1e-4)


def test_ledger_is_added_by_default_with_delta_below_one_over_n(log_dir):
    trainer = _dp_trainer(log_dir)
    trainer.fit(TinyClassifier(), tiny_data(num_clients=40))
    ledger = [p for p in trainer.plugins if isinstance(p, PrivacyLedger)][0]
    assert ledger.delta <= 0.1 / 40
    assert "epsilon" in trainer.history[-1]


def test_ledger_refuses_delta_at_or_above_one_over_n(log_dir):
    trainer = _dp_trainer(log_dir, ledger=PrivacyLedger(delta=1 / 40))
    with pytest.raises(ConfigError, match="PrivacyLedger.delta"):
        trainer.fit(TinyClassifier(), tiny_data(num_clients=40))


def test_budget_stops_before_exceeding(log_dir):
    full = [_reference_rdp(0.1, 1.5, t, 1e-4) for t in range(1, 40)]
    budget = (full[5] + full[6]) / 2  # exactly 6 rounds fit
    trainer = _dp_trainer(log_dir, sampling="poisson", rounds=30, ledger=PrivacyLedger(delta=1e-4, budget=budget))
    trainer.fit(TinyClassifier(), tiny_data(num_clients=40))
    assert len(trainer.history) == 6
    assert trainer.history[-1]["epsilon"] <= budget < full[6]
    assert "privacy budget" in trainer.stop_reason
    assert "my_val_acc" in trainer.history[-1]


def test_a_budget_stop_checkpoints_its_last_round(tmp_path):
    from dpfl_lightning.run import checkpoint_format as ckpt

    full = [_reference_rdp(0.1, 1.5, t, 1e-4) for t in range(1, 40)]
    budget = (full[5] + full[6]) / 2  # exactly 6 rounds fit
    trainer = _dp_trainer(str(tmp_path), sampling="poisson", rounds=30, checkpoint_every=4,
                          ledger=PrivacyLedger(delta=1e-4, budget=budget))
    out = trainer.fit(TinyClassifier(), tiny_data(num_clients=40))
    last = ckpt.load(os.path.join(trainer.checkpoint_dir, "last.ckpt"))
    assert last["round"] == 6 and torch.equal(last["global_params"], out.global_params)


def test_resumed_ledger_continues_exactly(tmp_path):
    a = _dp_trainer(str(tmp_path / "a"), placement="local", rounds=6, checkpoint_every=3, ledger=PrivacyLedger(delta=1e-4))
    a.fit(TinyClassifier(), tiny_data(num_clients=40))
    b = _dp_trainer(str(tmp_path / "b"), placement="local", rounds=6, ledger=PrivacyLedger(delta=1e-4))
    b.fit(TinyClassifier(), tiny_data(num_clients=40), ckpt_path=os.path.join(a.checkpoint_dir, "round-000003.ckpt"))
    assert [h["epsilon"] for h in b.history] == [h["epsilon"] for h in a.history]
    la = [p for p in a.plugins if isinstance(p, PrivacyLedger)][0]
    lb = [p for p in b.plugins if isinstance(p, PrivacyLedger)][0]
    assert lb.rounds == la.rounds == 6 and np.array_equal(lb.counts["client_local"], la.counts["client_local"])


def test_local_noise_counts_only_participations(log_dir):
    ledger = PrivacyLedger(delta=1e-4)
    trainer = _dp_trainer(log_dir, placement="local", rounds=8, ledger=ledger)
    trainer.fit(TinyClassifier(), tiny_data(num_clients=20))
    counts = np.zeros(20, dtype=int)
    for r in range(8):
        counts[trainer.sampler.sample(trainer.run.random, r)] += 1
    assert np.array_equal(ledger.counts["client_local"], counts) and counts.max() < 8
    # each participation is one Gaussian release with multiplier sigma / 2C (replace-one)
    expected = _reference_rdp(1.0, 1.5 / 2, int(counts.max()), 1e-4, NeighboringRelation.REPLACE_ONE)
    assert trainer.history[-1]["epsilon"] == expected


def test_target_epsilon_calibrates_the_noise(log_dir):
    noise = GaussianNoise(target_epsilon=3.0, delta=1e-4, placement="central")
    trainer = quiet_trainer(log_dir, rounds=10, clients_per_round=4, sampling="poisson",
                            plugins=[UpdateNormalization(1.0), noise])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=40))
    assert noise.noise_multiplier > 0
    assert 3.0 * 0.99 <= trainer.history[-1]["epsilon"] <= 3.0


def test_target_epsilon_without_delta_uses_the_default_delta(log_dir):
    # 40 clients: the default delta is a power of ten at most 0.1 / 40
    noise = GaussianNoise(target_epsilon=3.0, placement="central")
    trainer = quiet_trainer(log_dir, rounds=5, clients_per_round=4, sampling="poisson",
                            plugins=[UpdateNormalization(1.0), noise])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=40))
    assert noise.delta == 1e-3
    assert 3.0 * 0.99 <= trainer.history[-1]["epsilon"] <= 3.0


def test_zero_noise_is_refused_unless_infinite_epsilon_is_allowed(log_dir):
    from dpfl_lightning.algorithms import PFL, DPFedAvg
    from dpfl_lightning.plugins import DPSGD

    for make in (lambda: GaussianNoise(noise_multiplier=0.0), lambda: GaussianNoise(std=0.0),
                 lambda: DPSGD(noise_multiplier=0.0), lambda: DPFedAvg(noise_multiplier=0.0).plugins(),
                 lambda: PFL(noise_multiplier=0.0).plugins()):
        with pytest.raises(ConfigError, match="allow_infinite_epsilon"):
            make()
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=2,
                      plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=0.0, allow_infinite_epsilon=True)])
    t.fit(TinyClassifier(), tiny_data())
    assert t.history[-1]["epsilon"] == math.inf  # and the ledger says so


@pytest.mark.parametrize("records", [3, 52], ids=["batch-holds-all", "sampled"])
def test_fixed_size_dpsgd_accounts_every_client_at_the_public_records(log_dir, records):
    """Clients of 3, 5 and 52 records: fixed-size DP-SGD accounts one profile, for every client, at the
    public ``records_per_client`` (replace-one; B of N without replacement, or the whole batch
    replaced-one at distance 2C where B >= N), never at a client's own count."""
    import torch

    from dpfl_lightning import FederatedDataModule
    from dpfl_lightning.plugins import DPSGD

    x = torch.randn(60, 10)
    data = FederatedDataModule.from_tensors(x, torch.arange(60) % 10, x[:10], torch.arange(10) % 10,
                                            client_indices=[range(0, 3), range(3, 8), range(8, 60)])
    ledger = PrivacyLedger(delta=1e-4)
    trainer = quiet_trainer(log_dir, rounds=2, batch_size=4, records_per_client=records,
                            plugins=[DPSGD(noise_multiplier=1.0, sampling="fixed"), ledger])
    trainer.fit(TinyClassifier(), data)
    (profile,) = ledger.guarantees[0].profiles
    assert profile.clients is None and profile.record.records == records
    assert profile.release.relation == "replace_one"
    if records <= 4:
        assert profile.release.sampling == "none" and profile.release.noise_multiplier == 0.5
    else:
        assert profile.release.sampling == "without_replacement"
        assert (profile.release.population, profile.release.sample_size) == (52, 4)


def test_calibrate_refuses_delta_at_or_above_one_over_n(capsys):
    from dpfl_lightning.cli import command as cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["privacy", "calibrate", "--epsilon", "2", "--delta", "0.5", "--rounds", "10", "--clients", "50"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--delta" in err and "1/50" in err


def test_accountants_come_from_one_registry():
    from dpfl_lightning.privacy import ACCOUNTANTS, GaussianRelease, create_accountant, epsilon

    assert sorted(ACCOUNTANTS) == ["pld", "prv", "rdp"]
    assert [create_accountant(name).name for name in ACCOUNTANTS] == list(ACCOUNTANTS)  # every name builds
    with pytest.raises(ConfigError, match=r"PrivacyLedger.accountant='moments': unknown accountant. Fix: use one of rdp, pld, prv"):
        create_accountant("moments", "PrivacyLedger.accountant")
    poisson = GaussianRelease(1.1, "poisson", 0.01)
    fixed = GaussianRelease(1.1, "without_replacement", 0.01, "replace_one", population=1000, sample_size=10)
    eps = {name: epsilon(poisson, 1000, 1e-5, name) for name in ACCOUNTANTS}
    assert [e.method for e in eps.values()] == list(ACCOUNTANTS)  # each accounts what it supports itself
    assert eps["pld"].epsilon < eps["rdp"].epsilon and eps["prv"].epsilon < eps["rdp"].epsilon  # tighter than RDP
    for name in ("pld", "prv"):  # sampling without replacement: RDP's bound, saying why
        e = epsilon(fixed, 1000, 1e-5, name)
        assert e.method == "rdp" and "without replacement" in e.note
        assert e.epsilon == epsilon(fixed, 1000, 1e-5, "rdp").epsilon
