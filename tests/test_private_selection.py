"""Private selection (Papernot & Steinke, ICLR 2022): the number of trials, its keyed sampler, the
guarantee of the selected result, the worst case over a space, all runs of a grid, and calibration.

Expected values come from an implementation of the paper's theorems written here, on closed-form
Gaussian RDP curves, and from dp_accounting's RepeatAndSelectDpEvent; distributions from scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
from scipy import stats

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.privacy.accountants import GaussianRelease
from dpfl_lightning.privacy.selection import (TrialCount, draw_trial_count, draw_trial_point, draw_trial_points,
                                              trial_count)
from dpfl_lightning.privacy.selection_accounting import (all_runs_epsilon, one_run_epsilon, selected_epsilon,
                                                         selection_event, trial, trials_over, worst_case)
from dpfl_lightning.privacy.selection_calibration import calibrate_selection, selection_floor, selection_plan

DELTA = 1e-5
SECRET = b"k" * 32
CASES = [{"distribution": "poisson", "mean": 8}, {"distribution": "geometric", "mean": 8},
         {"distribution": "logarithmic", "mean": 8},
         {"distribution": "truncated_negative_binomial", "mean": 8, "shape": 0.5},
         {"distribution": "truncated_negative_binomial", "mean": 3, "shape": 4}]
SHAPE = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}


# ------------------------------------------------------------- the paper, written out independently
def gaussian_curve(z: float, rounds: int) -> list[float]:
    """RDP of ``rounds`` unsampled Gaussians of multiplier ``z``: ``rounds * l / (2 z^2)``."""
    return [rounds * a / (2 * z * z) for a in DEFAULT_RDP_ORDERS]


def to_epsilon(curve: list[float], delta: float) -> float:
    """(eps, delta) from RDP: Canonne, Kamath, Steinke 2020 Prop. 12, eps = r + log(1 - 1/l) -
    (log delta + log l) / (l - 1), minimised over orders (0 where sqrt(1 - e^-r) <= delta)."""
    best = math.inf
    for a, r in zip(DEFAULT_RDP_ORDERS, curve):
        if delta ** 2 > -math.expm1(-r):
            return 0.0
        if a > 1.01:
            best = min(best, r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1))
    return max(best, 0.0)


def to_delta(curve: list[float], eps: float) -> float:
    """delta at eps from RDP (the same conversion, solved for delta; and sqrt(1 - e^-r))."""
    log_best = 0.0
    for a, r in zip(DEFAULT_RDP_ORDERS, curve):
        log_best = min(log_best, 0.5 * math.log(-math.expm1(-r)) if r > 0 else -math.inf)
        if a > 1.01:
            log_best = min(log_best, (a - 1) * (r - eps) + (a - 1) * math.log((a - 1) / a) - math.log(a))
    return math.exp(log_best)


def tnb_mean(gamma: float, eta: float) -> float:
    """Mean of the truncated negative binomial (Definition 1 of the paper)."""
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * (1 - gamma ** eta))


def solve_gamma(mean: float, eta: float) -> float:
    lo, hi = 1e-12, 1.0 - 1e-15  # the mean falls as gamma grows
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tnb_mean(mid, eta) > mean else (lo, mid)
    return (lo + hi) / 2


def theorem_curve(curve: list[float], mean: float, eta: float) -> list[float]:
    """RDP of the best of K trials: Theorem 6 (Poisson, eta = inf), Theorem 2 (truncated negative
    binomial; geometric eta = 1, logarithmic eta = 0) followed by monotonicity in the order."""
    orders = DEFAULT_RDP_ORDERS
    if eta == math.inf:
        out = []
        for a, r in zip(orders, curve):
            d_hat = to_delta(curve, math.log(1 + 1 / (a - 1)))
            out.append(r + mean * d_hat + math.log(mean) / (a - 1))
        return out
    gamma = solve_gamma(mean, eta)
    out = []
    for a, r in zip(orders, curve):
        extra = min((1 + eta) * (1 - 1 / ah) * rh + (1 + eta) * math.log(1 / gamma) / ah
                    for ah, rh in zip(orders, curve))
        out.append(r + extra + math.log(mean) / (a - 1))
    return [min(out[j] for j in range(i, len(out))) for i in range(len(out))]


def event_epsilon(event, delta: float = DELTA) -> float:
    acc = RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


# -------------------------------------------------------------------------------------- guarantee
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['distribution']}-{c['mean']}")
def test_selected_epsilon_is_papernot_steinke(case):
    one = trial(GaussianRelease(4.0), 20)
    eta = case["shape"] if "shape" in case else SHAPE[case["distribution"]]
    expected = to_epsilon(theorem_curve(gaussian_curve(4.0, 20), case["mean"], eta), DELTA)
    got = selected_epsilon(one, case, DELTA)
    assert got.epsilon == pytest.approx(expected, rel=1e-7)
    assert got.method == "rdp"
    # and dp_accounting's own event, built here
    event = dpe.RepeatAndSelectDpEvent(dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(4.0), 20), case["mean"], eta)
    assert got.epsilon == pytest.approx(event_epsilon(event), rel=1e-7)
    assert selection_event(one, case) == event


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c["distribution"])
def test_selected_epsilon_of_a_subsampled_run_matches_dp_accounting(case):
    release = GaussianRelease(1.0, "poisson", 0.1)
    eta = SHAPE[case["distribution"]]
    event = dpe.RepeatAndSelectDpEvent(dpe.SelfComposedDpEvent(
        dpe.PoissonSampledDpEvent(0.1, dpe.GaussianDpEvent(1.0)), 100), case["mean"], eta)
    assert selected_epsilon(trial(release, 100), case, DELTA).epsilon == pytest.approx(event_epsilon(event), rel=1e-7)


def test_selection_costs_more_than_one_run_and_less_than_all_runs():
    one = trial(GaussianRelease(1.0, "poisson", 0.1), 100)
    single = to_epsilon([100 * r for r in _dp_curve(dpe.PoissonSampledDpEvent(0.1, dpe.GaussianDpEvent(1.0)))], DELTA)
    assert one_run_epsilon(one, DELTA).epsilon == pytest.approx(single, rel=1e-9)
    for case in CASES[:3]:
        assert single < selected_epsilon(one, case, DELTA).epsilon < all_runs_epsilon([one] * 8, DELTA).epsilon


def _dp_curve(event) -> list[float]:
    acc = RdpAccountant()
    acc.compose(event)
    return list(acc._rdp)  # noqa: SLF001 - dp_accounting's curve, to compare curves with it


def test_a_point_mass_is_one_run_and_poisson_mean_one_is_not():
    one = trial(GaussianRelease(4.0), 20)
    single = to_epsilon(gaussian_curve(4.0, 20), DELTA)
    for name in ("geometric", "logarithmic"):
        count = trial_count({"distribution": name, "mean": 1})
        assert count.point_mass
        got = selected_epsilon(one, count, DELTA)
        assert got.epsilon == pytest.approx(single, rel=1e-9) and "one run" in got.note
        assert draw_trial_count(rng.RandomSource(0, SECRET), count) == 1
    poisson = selected_epsilon(one, {"distribution": "poisson", "mean": 1}, DELTA).epsilon
    assert poisson == pytest.approx(to_epsilon(theorem_curve(gaussian_curve(4.0, 20), 1.0, math.inf), DELTA), rel=1e-7)
    assert poisson > single


def test_other_accountants_give_the_rdp_bound_with_a_note():
    one = trial(GaussianRelease(1.0, "poisson", 0.1), 50)
    rdp = selected_epsilon(one, CASES[0], DELTA)
    pld = selected_epsilon(one, CASES[0], DELTA, accountant="pld")
    assert pld.epsilon == rdp.epsilon and pld.method == "rdp" and "pld" in pld.note and "Renyi" in pld.note
    # a point mass is one run: the asked accountant itself
    assert selected_epsilon(one, {"distribution": "geometric", "mean": 1}, DELTA, "pld").method == "pld"


def test_all_runs_of_a_grid_compose():
    runs = [trial(GaussianRelease(4.0), 20)] * 8
    assert all_runs_epsilon(runs, DELTA).epsilon == pytest.approx(to_epsilon(gaussian_curve(4.0, 160), DELTA), rel=1e-9)
    mixed = [trial(GaussianRelease(4.0), 20), trial(GaussianRelease(8.0), 20)]
    both = [a + b for a, b in zip(gaussian_curve(4.0, 20), gaussian_curve(8.0, 20))]
    got = all_runs_epsilon(mixed, DELTA, accountant="pld")
    assert got.epsilon == pytest.approx(to_epsilon(both, DELTA), rel=1e-9) and got.method == "rdp" and got.note


# ----------------------------------------------------------------------------------- worst case
def test_worst_case_over_two_noise_multipliers_is_the_smaller_noise_and_names_it():
    space = [{"noise_multiplier": 8.0, "lr": 0.1}, {"noise_multiplier": 4.0, "lr": 0.1}]
    trials = trials_over(space, lambda h: trial(GaussianRelease(h["noise_multiplier"]), 20))
    got = selected_epsilon(trials, CASES[1], DELTA)
    assert got.epsilon == pytest.approx(to_epsilon(theorem_curve(gaussian_curve(4.0, 20), 8, 1.0), DELTA), rel=1e-7)
    assert got.worst == "noise_multiplier=4.0, lr=0.1" and got.attained_by == (got.worst,)
    assert "noise_multiplier=4.0" in got.describe()
    assert one_run_epsilon(trials, DELTA).worst == got.worst
    # a space whose points share one event names no hyperparameter
    same = trials_over([{"lr": 0.1}, {"lr": 1.0}], lambda h: trial(GaussianRelease(4.0), 20))
    assert selected_epsilon(same, CASES[1], DELTA).worst == "" and worst_case(same, DELTA).exact


def test_worst_case_of_crossing_curves_is_their_pointwise_maximum():
    # the sampled curve is convex in the order, the unsampled one a line through 0: they cross
    sampled = dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.05, dpe.GaussianDpEvent(0.7)), 100)
    trials = [trial(GaussianRelease(0.7, "poisson", 0.05), 100, "sampled"), trial(GaussianRelease(3.5), 20, "full")]
    top = [max(a, b) for a, b in zip(_dp_curve(sampled), gaussian_curve(3.5, 20))]
    case = worst_case(trials, DELTA, CASES[0])
    assert set(case.attained_by) == {"sampled", "full"} and not case.exact
    got = selected_epsilon(trials, CASES[0], DELTA)
    assert got.epsilon == pytest.approx(to_epsilon(theorem_curve(top, 8, math.inf), DELTA), rel=1e-7)
    alone = max(selected_epsilon(t, CASES[0], DELTA).epsilon for t in trials)
    assert got.epsilon >= alone


# ---------------------------------------------------------------------------------- the sampler
def expected_pmf(case: dict, k: np.ndarray) -> np.ndarray:
    name, mean = case["distribution"], case["mean"]
    if name == "poisson":
        return stats.poisson.pmf(k, mean)
    eta = case["shape"] if "shape" in case else SHAPE[name]
    gamma = solve_gamma(mean, eta)
    if name == "geometric":
        return stats.geom.pmf(k, gamma)
    if name == "logarithmic":
        return stats.logser.pmf(k, 1 - gamma)
    return stats.nbinom.pmf(k, eta, gamma) / (1 - gamma ** eta)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['distribution']}-{c['mean']}")
def test_the_number_of_trials_follows_its_distribution(case):
    count = trial_count(case)
    draws = np.array([draw_trial_count(rng.RandomSource(seed, SECRET), count) for seed in range(8000)])
    low = 0 if case["distribution"] == "poisson" else 1
    assert draws.min() >= low
    k = np.arange(low, draws.max() + 1)
    p = expected_pmf(case, k)
    keep = np.cumsum(p) < 1 - 5 / len(draws)  # bins with enough expected draws; the rest pooled
    observed = np.append(np.bincount(draws - low)[: keep.sum()], 0)
    observed[-1] = len(draws) - observed[:-1].sum()
    expected = np.append(p[keep], 1 - p[keep].sum()) * len(draws)
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_the_draws_are_keyed_and_secret_in_secure_mode():
    count = trial_count(CASES[0])
    sim = [draw_trial_count(rng.RandomSource(s), count) for s in range(40)]
    assert sim == [draw_trial_count(rng.RandomSource(s), count) for s in range(40)]
    secure = [draw_trial_count(rng.RandomSource(s, SECRET), count) for s in range(40)]
    assert secure == [draw_trial_count(rng.RandomSource(s, SECRET), count) for s in range(40)]
    other = [draw_trial_count(rng.RandomSource(s, b"z" * 32), count) for s in range(40)]
    assert secure != other and secure != sim
    assert rng.is_private(rng.PLUGIN_PURPOSES["PrivateSelection.trials"].number)


def test_trial_points_are_uniform_with_replacement_and_keyed_by_trial():
    source = rng.RandomSource(5, SECRET)
    points = draw_trial_points(source, 6000, 3)
    assert stats.chisquare(np.bincount(points, minlength=3)).pvalue > 1e-3
    assert draw_trial_point(source, 17, 3) == points[17]  # a resumed sweep draws trial 17 again
    assert draw_trial_point(rng.RandomSource(5, SECRET), 4, 1) == 0


# ----------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("setting, named", [
    ({"distribution": "binomial", "mean": 8}, "private_selection.distribution"),
    ({"distribution": "poisson", "mean": 0.5}, "private_selection.mean"),
    ({"distribution": "poisson", "mean": True}, "private_selection.mean"),
    ({"distribution": "geometric", "mean": float("nan")}, "private_selection.mean"),
    ({"distribution": "truncated_negative_binomial", "mean": 8}, "private_selection.shape"),
    ({"distribution": "truncated_negative_binomial", "mean": 8, "shape": 0}, "private_selection.shape"),
    ({"distribution": "poisson", "mean": 8, "shape": 1}, "private_selection.shape"),
    ({"distribution": "poisson", "mean": 8, "trials": 3}, "private_selection"),
    ({"mean": 8}, "private_selection"),
    ("poisson", "private_selection"),
])
def test_bad_settings_are_refused_naming_the_setting_and_the_fix(setting, named):
    with pytest.raises(ConfigError) as err:
        trial_count(setting)
    assert str(err.value).startswith(named + "=") and "Fix:" in str(err.value)


def test_a_spec_is_frozen_and_maps_to_dp_accounting_shapes():
    count = trial_count({"distribution": "Truncated_Negative_Binomial", "mean": 8, "shape": 0.5})
    assert count == TrialCount("truncated_negative_binomial", 8.0, 0.5) and count.dp_shape == 0.5
    assert [trial_count(c).dp_shape for c in CASES[:3]] == [math.inf, 1.0, 0.0]
    with pytest.raises(AttributeError):
        count.mean = 2.0


# ---------------------------------------------------------------------------------- calibration
def test_calibration_meets_the_target_including_selection():
    release = GaussianRelease(1.0, "poisson", 0.1)
    z = calibrate_selection(release, 100, CASES[1], 4.0, DELTA, rtol=1e-3)

    def eps(x: float) -> float:
        inner = dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.1, dpe.GaussianDpEvent(x)), 100)
        return event_epsilon(dpe.RepeatAndSelectDpEvent(inner, 8, 1.0))

    assert eps(z) <= 4.0 < eps(z * 0.99)


def test_an_unreachable_target_is_refused_with_the_floor():
    floor = selection_floor(CASES[0], DELTA)
    assert floor > 0  # no noise removes it
    assert floor == pytest.approx(to_epsilon(theorem_curve([0.0] * len(DEFAULT_RDP_ORDERS), 8, math.inf), DELTA))
    with pytest.raises(ConfigError, match=r"target_epsilon=.*unreachable.*no noise removes.*Fix: .*mean number"):
        calibrate_selection(GaussianRelease(1.0), 10, CASES[0], floor / 2, DELTA)


def test_the_plan_gives_epsilon_against_the_mean_number_of_trials():
    one = trial(GaussianRelease(4.0), 20)
    rows = selection_plan(one, DELTA, "poisson", means=(1, 2, 8))
    expected = [to_epsilon(theorem_curve(gaussian_curve(4.0, 20), m, math.inf), DELTA) for m in (1, 2, 8)]
    assert [r.selected for r in rows] == pytest.approx(expected, rel=1e-7)
    assert [r.all_runs for r in rows] == pytest.approx([to_epsilon(gaussian_curve(4.0, 20 * m), DELTA) for m in (1, 2, 8)])
    geometric = selection_plan(one, DELTA, "geometric", means=(1, 4))
    assert geometric[0].selected == pytest.approx(to_epsilon(gaussian_curve(4.0, 20), DELTA), rel=1e-9)
