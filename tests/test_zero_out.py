"""Distributed noise whose shares come with their client: the neighbouring pairs computed numerically
(quadrature / direct summation), against the bounds the accounting uses."""

import math
import os

import numpy as np
import pytest
from scipy import special, stats

from dpfl_lightning import cli
from dpfl_lightning.plugins.gaussian_noise import client_noise_std
from dpfl_lightning.privacy import discrete_accounting as da
from dpfl_lightning.privacy.accountants import Release, epsilon
import dp_accounting

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDERS = np.array(da.ORDERS, dtype=np.float64)


def _renyi(logp, logq, alpha, step):
    """D_alpha(P || Q) from log-densities (or log-masses, step 1) on a grid."""
    return (special.logsumexp(alpha * logp + (1 - alpha) * logq) + math.log(step)) / (alpha - 1)


def _mix(weights, parts):
    return special.logsumexp([math.log(w) + p for w, p in zip(weights, parts)], axis=0)


def _gauss_pair(q, a, v, x):
    """Zero-out pair of one coordinate: the client's share (variance v) is in the sum iff it was sampled."""
    grid = np.linspace(-80, 80, 400001)
    A = stats.norm.logpdf(grid, 0, math.sqrt(a))
    P = _mix([1 - q, q], [A, stats.norm.logpdf(grid, x, math.sqrt(a + v))])
    Q = _mix([1 - q, q], [A, stats.norm.logpdf(grid, 0, math.sqrt(a + v))])
    return P, Q, grid[1] - grid[0]


def _dgauss_logpmf(k, s2):
    logw = -k.astype(np.float64) ** 2 / (2 * s2)
    return logw - special.logsumexp(logw)


@pytest.mark.parametrize("q,a,v", [(0.05, 4.0, 3.0), (0.2, 4.0, 1.0), (0.2, 1.0, 0.5), (0.5, 4.0, 0.5)])
def test_the_zero_out_pair_with_a_coin_revealing_share_is_within_the_joint_convexity_bound(q, a, v):
    P, Q, step = _gauss_pair(q, a, v, 1.0)
    unsampled = ORDERS / (2 * a)  # D(B_x || B_0) <= alpha / (2 (a + v)) <= this
    bound = da.revealed_coin_rdp(unsampled, q)
    for i, alpha in enumerate(ORDERS[:15]):
        exact = max(_renyi(P, Q, alpha, step), _renyi(Q, P, alpha, step))
        assert exact <= bound[i] * (1 + 1e-6)


def test_add_remove_amplification_does_not_bound_the_zero_out_pair():
    """Zhu & Wang's subsampled curve (what add/remove's equal-noise pair gives) is far below the true
    divergence at high orders: the extra share's heavier tails reveal the coin."""
    q, a, v = 0.05, 4.0, 3.0
    P, Q, step = _gauss_pair(q, a, v, 1.0)
    alpha = 16
    i = list(da.ORDERS).index(alpha)
    zhu_wang = da.poisson_subsampled_rdp(ORDERS / (2 * a), q)[i]
    exact = _renyi(P, Q, alpha, step)
    assert exact > 20 * zhu_wang
    # and the bound used is close to the truth there (within a factor 2)
    assert exact >= 0.5 * da.revealed_coin_rdp(ORDERS / (2 * (a + v)), q)[i]


@pytest.mark.parametrize("q", [0.1, 0.3])
def test_discrete_gaussian_zero_out_pair_by_direct_summation(q):
    """Integer grid: shares N_Z(0, 1) each, 3 without the client's, one more with it; the update 1."""
    k = np.arange(-200, 201)
    A = _dgauss_logpmf(k, 3.0)
    B0 = _dgauss_logpmf(k, 4.0)
    Bx = _dgauss_logpmf(k - 1, 4.0)
    P, Q = _mix([1 - q, q], [A, Bx]), _mix([1 - q, q], [A, B0])
    curve = da.ddg_rdp(1.0, 1.0, 1.0, 3, 1).rdp()  # the accounted 3 shares (the fourth: post-processing)
    bound = da.revealed_coin_rdp(curve, q)
    for i, alpha in enumerate(ORDERS[:30]):
        exact = max(_renyi(P, Q, alpha, 1.0), _renyi(Q, P, alpha, 1.0))
        assert exact <= bound[i] * (1 + 1e-9)


def test_skellam_zero_out_pair_by_direct_summation():
    q, k = 0.2, np.arange(-60, 61)  # +-20 standard deviations: the pmf stays finite
    A = stats.skellam.logpmf(k, 3.0, 3.0)
    B0 = stats.skellam.logpmf(k, 4.0, 4.0)
    Bx = stats.skellam.logpmf(k - 1, 4.0, 4.0)
    P, Q = _mix([1 - q, q], [A, Bx]), _mix([1 - q, q], [A, B0])
    assert np.isfinite(P).all() and np.isfinite(Q).all()
    bound = da.revealed_coin_rdp(da.skellam_rdp(1.0, 1.0, 3.0).rdp(), q)
    for i, alpha in enumerate(ORDERS[:30]):
        assert max(_renyi(P, Q, alpha, 1.0), _renyi(Q, P, alpha, 1.0)) <= bound[i] * (1 + 1e-9)


def _gaussian_renyi_closed_form(m, s1, s0, a):
    """D_a(N(m, s1^2) || N(0, s0^2)), s_a^2 = a s0^2 + (1 - a) s1^2 > 0 (Gil, Alajaji, Linder 2013)."""
    sa2 = a * s0**2 + (1 - a) * s1**2
    return math.log(s0 / s1) + math.log(s0**2 / sa2) / (2 * (a - 1)) + a * m**2 / (2 * sa2)


def test_the_add_remove_pair_with_the_share_leaving_grows_with_the_dimension():
    """Add/remove with the share leaving: N(D, (k+1) I_d) vs N(0, k I_d); one coordinate's closed form
    checked by quadrature, then d coordinates (the shift spread over them) grow as d alpha / (4 k^2)."""
    k, alpha = 40, 8.0
    grid = np.linspace(-200, 200, 800001)
    num = _renyi(stats.norm.logpdf(grid, 1.0, math.sqrt(k + 1)), stats.norm.logpdf(grid, 0, math.sqrt(k)), alpha,
                 grid[1] - grid[0])
    assert num == pytest.approx(_gaussian_renyi_closed_form(1.0, math.sqrt(k + 1), math.sqrt(k), alpha), rel=1e-6)
    per_d = {d: d * _gaussian_renyi_closed_form(1.0 / math.sqrt(d), math.sqrt(k + 1), math.sqrt(k), alpha)
             for d in (1, 100, 10_000)}
    assert per_d[1] < per_d[100] < per_d[10_000]
    assert per_d[10_000] > 10  # nats: no useful add/remove guarantee
    assert per_d[10_000] == pytest.approx(10_000 * alpha / (4 * k**2), rel=0.15)  # leading order


def test_zero_out_release_is_add_remove_without_sampling_and_joint_convexity_with():
    ev = (dp_accounting.GaussianDpEvent(2.0),)
    same = epsilon(Release(ev, "none", 1.0, "zero_out"), 60, 1e-4).epsilon
    add = epsilon(Release(ev, "none", 1.0, "add_remove"), 60, 1e-4).epsilon
    assert same == pytest.approx(add, rel=0.02)
    zo = epsilon(Release(ev, "poisson", 0.2, "zero_out"), 60, 1e-4).epsilon
    ar = epsilon(Release(ev, "poisson", 0.2, "add_remove"), 60, 1e-4).epsilon
    assert ar < zo < add
    expected = da.epsilon_from_rdp(60 * da.revealed_coin_rdp(ORDERS / (2 * 4.0), 0.2), 1e-4)
    assert zo == pytest.approx(expected, rel=1e-9)
    # the curve private selection composes is the same bound (at dp_accounting's orders)
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS
    from dpfl_lightning.privacy.accountants import rdp_curve

    orders = np.array(DEFAULT_RDP_ORDERS)
    want = np.minimum(orders / 8.0, np.log1p(0.2 * np.expm1((orders - 1) * orders / 8.0)) / (orders - 1))
    np.testing.assert_allclose(rdp_curve(Release(ev, "poisson", 0.2, "zero_out"))[orders < 50], want[orders < 50],
                               rtol=1e-9)


def test_gaussian_distributed_shares_sum_to_the_same_noise_whatever_the_cohort():
    """GaussianNoise(placement='distributed') sizes its shares by the cohort: sigma^2 in the sum whether
    the client took part or not, so its guarantee stays add/remove (no variance gap)."""
    for n in (1, 7, 40, 41):
        assert n * client_noise_std(3.0, "distributed", n) ** 2 == pytest.approx(9.0, rel=1e-12)


@pytest.mark.parametrize("config", ["ddp_quickstart.yaml", "ddp_skellam_quickstart.yaml"])
def test_ddp_models_line_names_zero_out(config, capsys):
    cli.main(["privacy", "epsilon", "--config", os.path.join(ROOT, "configs", config)])
    out = capsys.readouterr().out.splitlines()
    (line,) = [x for x in out if "towards anyone who sees the models" in x]
    assert "zero-out neighbours (a client's update replaced by zero; its participation and noise share kept: " \
           "whether it took part is not protected)" in line
    assert "add/remove" not in line
