"""The exact integer-noise samplers against their pmfs (chi-square), from keyed streams and the CSPRNG."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpfl_lightning import rng
from dpfl_lightning.privacy import discrete_noise as dn

P_MIN = 1e-4  # chi-square p-value below which a sampler is rejected (fixed seeds: the outcome is fixed)


def dg_pmf(sigma2: float, support: np.ndarray) -> np.ndarray:
    """N_Z(0, sigma2) written from its definition: exp(-x^2 / (2 sigma2)) normalised over the integers."""
    wide = np.arange(-int(40 * math.sqrt(sigma2)) - 40, int(40 * math.sqrt(sigma2)) + 41)
    z = np.exp(-wide.astype(float) ** 2 / (2 * sigma2)).sum()
    return np.exp(-support.astype(float) ** 2 / (2 * sigma2)) / z


def chi_square_p(draws: np.ndarray, pmf) -> float:
    """Chi-square goodness of fit, bins with expected count >= 20 and the two tails pooled."""
    lo, hi = int(draws.min()), int(draws.max())
    support = np.arange(lo, hi + 1)
    expected = pmf(support) * draws.size
    keep = expected >= 20
    inner = support[keep]
    observed = np.bincount(draws - lo, minlength=support.size)[keep].astype(float)
    exp_inner = expected[keep]
    tail_obs = draws.size - observed.sum()
    tail_exp = draws.size - exp_inner.sum()
    assert inner.size >= 2
    obs = np.append(observed, tail_obs)
    exp = np.append(exp_inner, tail_exp)
    exp *= obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("sigma", [0.5, 3.0, 20.0])
def test_discrete_gaussian_matches_its_pmf_keyed(sigma):
    stream = rng.RandomSource(1).stream(0, 7, rng.CLIENT_NOISE)
    draws = dn.discrete_gaussian(stream, sigma * sigma, 1_000_000)
    assert draws.dtype == np.int64
    p = chi_square_p(draws, lambda s: dg_pmf(sigma * sigma, s))
    assert p > P_MIN, p


def test_discrete_gaussian_matches_its_pmf_secure():
    stream = rng.RandomSource(1, rng.new_secret()).stream(0, 7, rng.CLIENT_NOISE)
    assert isinstance(stream, rng.SecureStream)
    draws = dn.discrete_gaussian(stream, 9.0, 300_000)
    assert chi_square_p(draws, lambda s: dg_pmf(9.0, s)) > P_MIN


def test_the_chi_square_check_rejects_a_rounded_continuous_gaussian():
    g = np.random.default_rng(0)
    rounded = np.rint(g.normal(0, 0.5, 1_000_000)).astype(np.int64)
    assert chi_square_p(rounded, lambda s: dg_pmf(0.25, s)) < 1e-12


def test_keyed_draws_repeat_and_secure_draws_do_not():
    a = dn.discrete_gaussian(rng.RandomSource(3).stream(2, 5, rng.CLIENT_NOISE), 4.0, 1000)
    b = dn.discrete_gaussian(rng.RandomSource(3).stream(2, 5, rng.CLIENT_NOISE), 4.0, 1000)
    c = dn.discrete_gaussian(rng.RandomSource(3).stream(2, 6, rng.CLIENT_NOISE), 4.0, 1000)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    h1 = dn.skellam(rng.RandomSource(3).stream(2, 5, rng.DATA), 5.0, 1000)  # a HashStream
    h2 = dn.skellam(rng.RandomSource(3).stream(2, 5, rng.DATA), 5.0, 1000)
    assert np.array_equal(h1, h2)
    s1 = dn.discrete_gaussian(rng.RandomSource(3, rng.new_secret()).stream(2, 5, rng.CLIENT_NOISE), 4.0, 1000)
    s2 = dn.discrete_gaussian(rng.RandomSource(3, rng.new_secret()).stream(2, 5, rng.CLIENT_NOISE), 4.0, 1000)
    assert not np.array_equal(s1, s2) and not np.array_equal(s1, a)


@pytest.mark.parametrize("lam", [0.3, 7.0, 1000.0])
def test_skellam_matches_scipy_pmf(lam):
    stream = rng.RandomSource(2).stream(0, 1, rng.CLIENT_NOISE)
    draws = dn.skellam(stream, lam, 400_000)
    assert chi_square_p(draws, lambda s: stats.skellam.pmf(s, lam, lam)) > P_MIN


def test_skellam_from_the_csprng_matches_scipy_pmf():
    stream = rng.RandomSource(2, rng.new_secret()).stream(0, 1, rng.CLIENT_NOISE)
    draws = dn.skellam(stream, 20.0, 300_000)
    assert chi_square_p(draws, lambda s: stats.skellam.pmf(s, 20.0, 20.0)) > P_MIN


@pytest.mark.parametrize("lam", [2.5, 123456.75])
def test_poisson_matches_scipy_pmf(lam):
    draws = dn.poisson(rng.RandomSource(4).stream(0, 0, rng.DATA), lam, 300_000)
    assert chi_square_p(draws, lambda s: stats.poisson.pmf(s, lam)) > P_MIN


def test_exact_paths_give_the_exact_probabilities():
    """Intervals too wide to decide anything: every draw takes the exact rational path."""
    src = dn.WordSource(rng.RandomSource(5).stream(0, 0, rng.DATA))
    n = 40_000
    third = dn.bernoulli_interval(src, np.zeros(n), np.ones(n), lambda i: Fraction(1, 3))
    assert abs(third.mean() - 1 / 3) < 4 * math.sqrt(2 / 9 / n)
    g = Fraction(7, 3)
    e = dn.bernoulli_exp_interval(src, np.zeros(n), np.full(n, 10.0), lambda i: g)
    p = math.exp(-7 / 3)
    assert abs(e.mean() - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_bad_parameters_are_refused_with_the_setting_named():
    from dpfl_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="sigma2"):
        dn.discrete_gaussian(rng.RandomSource(0).stream(0, 0, rng.DATA), -1.0, 10)
    with pytest.raises(ConfigError, match="poisson.lam"):
        dn.poisson(rng.RandomSource(0).stream(0, 0, rng.DATA), 2.0**40, 10)


# ----------------------------------------------------------------------------- the block sampler's parts
@pytest.mark.parametrize("sigma2", [262_144.0, 16_777_216.0])
def test_discrete_gaussian_matches_its_pmf_at_the_plugins_scales(sigma2):
    """DiscreteDistributedNoise passes sigma^2 of 1e4 to 2^24 grid steps (16 to 32 bits)."""
    draws = dn.discrete_gaussian(rng.RandomSource(6).stream(0, 3, rng.CLIENT_NOISE), sigma2, 1_000_000)
    assert chi_square_p(draws, lambda s: dg_pmf(sigma2, s)) > P_MIN
    assert abs(draws.var() / sigma2 - 1) < 0.01  # N_Z(0, s2) has variance within 1e-9 of s2 at these scales


@pytest.mark.parametrize("g", [Fraction(0), Fraction(1, 3), Fraction(7, 3), Fraction(101, 2), Fraction(10**6, 7)])
def test_exp_enclosures_contain_exp_and_are_tight(g):
    import mpmath

    with mpmath.workdps(400):
        for bits in (60, 200):
            lo, hi = dn.exp_neg_fixed(g, bits)
            true = mpmath.exp(-mpmath.mpf(g.numerator) / g.denominator) * mpmath.mpf(2) ** bits
            assert lo <= true <= hi and hi - lo <= 2


@pytest.mark.parametrize("sigma2", [0.01, 0.5, 2.0, 9.0, 1234.5, 2.0**24])
def test_block_width_keeps_every_acceptance_at_most_one(sigma2):
    import mpmath

    w = dn.block_width(Fraction(sigma2))
    with mpmath.workdps(50):  # the block's smallest x, b w, has the largest exp(-x^2 / (2 s2)) 2^b
        worst = max(mpmath.exp(-mpmath.mpf(b * w) ** 2 / (2 * mpmath.mpf(sigma2))) * 2**b for b in range(1, 80))
    assert worst <= 1
    assert (w - 1) ** 2 < 1.4 * sigma2 or w == 1  # and it is the smallest such width


def test_the_enclosed_exact_path_gives_the_exact_probability():
    """Float intervals too wide to decide anything: every draw takes the exact path."""
    src = dn.WordSource(rng.RandomSource(8).stream(0, 0, rng.DATA))
    n = 40_000
    a = dn.bernoulli_enclosed(src, np.zeros(n), np.ones(n), lambda i, bits: dn.exp_neg_fixed(Fraction(7, 3), bits + 1))
    p = 2 * math.exp(-7 / 3)  # exp(-7/3) 2^1: the enclosure to bits + 1 bits read as one to bits bits
    assert abs(a.mean() - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_the_block_sampler_and_the_cks_reference_agree():
    fast = dn.discrete_gaussian(rng.RandomSource(9).stream(0, 1, rng.CLIENT_NOISE), 30.25, 300_000)
    ref = dn.discrete_gaussian_cks(rng.RandomSource(9).stream(0, 2, rng.CLIENT_NOISE), 30.25, 300_000)
    lo = min(fast.min(), ref.min())
    table = np.stack([np.bincount(fast - lo), np.bincount(ref - lo, minlength=fast.max() - lo + 1)[: fast.max() - lo + 1]])
    table = table[:, table.sum(0) >= 40]
    assert stats.chi2_contingency(table).pvalue > P_MIN
