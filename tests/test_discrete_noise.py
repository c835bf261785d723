"""The exact integer-noise samplers against their pmfs (chi-square), from keyed streams and the CSPRNG."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import special, stats

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


def skellam_pmf(lam: float, support: np.ndarray) -> np.ndarray:
    """Skellam(lam, lam) from its definition: exp(-2 lam) I_k(2 lam), the scaled Bessel function."""
    return special.ive(support, 2 * lam)


def poisson_pmf(lam: float, support: np.ndarray) -> np.ndarray:
    """Poisson(lam) from its definition: exp(k ln lam - lam - ln k!)."""
    k = support.astype(float)
    return np.where(k >= 0, np.exp(special.xlogy(k, lam) - lam - special.gammaln(np.maximum(k, 0) + 1)), 0.0)


def binned_chi_square_p(draws: np.ndarray, pmf, per_bin: float = 400.0) -> float:
    """Chi-square goodness of fit over runs of consecutive integers merged until each expects about
    ``per_bin`` draws (so that a wide distribution is tested over its whole range), tails pooled."""
    lo, hi = int(draws.min()), int(draws.max())
    support = np.arange(lo, hi + 1)
    expected = pmf(support) * draws.size
    observed = np.bincount(draws - lo, minlength=support.size).astype(float)
    edges = np.searchsorted(np.cumsum(expected), np.arange(per_bin, expected.sum(), per_bin))
    edges = np.unique(np.append(edges, support.size - 1))
    exp_b = np.add.reduceat(expected, np.concatenate([[0], edges[:-1] + 1]))
    obs_b = np.add.reduceat(observed, np.concatenate([[0], edges[:-1] + 1]))
    if exp_b[-1] < per_bin / 2:  # the remainder at the top (it holds the largest draw): into its neighbour
        exp_b, obs_b = np.append(exp_b[:-2], exp_b[-2:].sum()), np.append(obs_b[:-2], obs_b[-2:].sum())
    assert exp_b.size >= 3
    obs = np.append(obs_b, draws.size - obs_b.sum())
    exp = np.append(exp_b, max(draws.size - exp_b.sum(), 0.0))
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp *= obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


# ----------------------------------------------------------------------------- Poisson and Skellam
LAMS = [0.3, 7.0, 1e4, 1e8]  # small, the 16-bit quickstart's ~1e4 grid steps, the 32-bit end of the study


@pytest.mark.parametrize("lam", LAMS)
def test_skellam_matches_its_pmf_keyed(lam):
    draws = dn.skellam(rng.RandomSource(2).stream(0, 1, rng.CLIENT_NOISE), lam, 1_000_000)
    assert draws.dtype == np.int64
    assert binned_chi_square_p(draws, lambda s: skellam_pmf(lam, s)) > P_MIN
    assert abs(draws.var() / (2 * lam) - 1) < 0.01


@pytest.mark.parametrize("lam", [20.0, 1e4, 1e8])
def test_skellam_from_the_csprng_matches_its_pmf(lam):
    stream = rng.RandomSource(2, rng.new_secret()).stream(0, 1, rng.CLIENT_NOISE)
    assert isinstance(stream, rng.SecureStream)
    draws = dn.skellam(stream, lam, 1_000_000)
    assert binned_chi_square_p(draws, lambda s: skellam_pmf(lam, s)) > P_MIN


@pytest.mark.parametrize("lam", [0.3, 2.5, 123456.75, 1e8])
def test_poisson_matches_its_pmf(lam):
    draws = dn.poisson(rng.RandomSource(4).stream(0, 0, rng.DATA), lam, 1_000_000)
    assert binned_chi_square_p(draws, lambda s: poisson_pmf(lam, s)) > P_MIN
    secure = dn.poisson(rng.RandomSource(4, rng.new_secret()).stream(0, 0, rng.DATA), lam, 300_000)
    assert binned_chi_square_p(secure, lambda s: poisson_pmf(lam, s)) > P_MIN


def test_the_binned_check_rejects_a_rounded_normal_and_a_shifted_poisson():
    """What the binned check can see on 10^6 draws: a rounded normal of Poisson(400)'s mean and
    variance (skewness 1/20), and numpy's Poisson at 1e4 (1 + 2e-3)."""
    g = np.random.default_rng(0)
    rounded = np.rint(g.normal(400, 20, 1_000_000)).astype(np.int64)
    assert binned_chi_square_p(rounded, lambda s: poisson_pmf(400.0, s)) < 1e-12
    shifted = g.poisson(1e4 * 1.002, 1_000_000)
    assert binned_chi_square_p(shifted, lambda s: poisson_pmf(1e4, s)) < 1e-12


@pytest.mark.parametrize("lam, n", [(0.3, 20_000), (7.5, 20_000), (1e4, 5_000), (123456.75, 2_000), (1e8, 10)])
def test_the_float_filter_gives_the_exact_references_draws(lam, n):
    """Every acceptance decided in exact rational arithmetic (the fallback path, run for every
    candidate) gives the same draws, word for word: the float bounds never decide an outcome."""
    fast = dn.skellam(rng.RandomSource(1).stream(0, 0, rng.DATA), lam, n)
    exact = dn.skellam(rng.RandomSource(1).stream(0, 0, rng.DATA), lam, n, exact_reference=True)
    assert np.array_equal(fast, exact)


def test_uninformative_bounds_change_no_draw():
    """The table's float bounds only decide when the exact comparison runs: widened to [0, 1] (every
    candidate through bernoulli_interval's exact branch), the same stream gives the same draws."""
    table = dn.poisson_table(Fraction(1e4))
    wide = table._replace(accept_lo=np.zeros_like(table.accept_lo), accept_hi=np.ones_like(table.accept_hi))
    tight = dn.sample_poisson(table, rng.RandomSource(9).stream(0, 0, rng.DATA), 5000)
    assert np.array_equal(tight, dn.sample_poisson(wide, rng.RandomSource(9).stream(0, 0, rng.DATA), 5000))


def test_the_exact_reference_matches_the_pmf():
    draws = dn.poisson(rng.RandomSource(3).stream(0, 0, rng.DATA), 7.5, 100_000, exact_reference=True)
    assert binned_chi_square_p(draws, lambda s: poisson_pmf(7.5, s)) > P_MIN


def ratio_mp(lam: Fraction, k: int, m: int):
    """p(k) / p(m) for Poisson(lam) in mpmath (60 digits), from the definition."""
    import mpmath

    lam_mp = mpmath.mpf(lam.numerator) / lam.denominator
    return mpmath.exp((k - m) * mpmath.log(lam_mp) + mpmath.loggamma(m + 1) - mpmath.loggamma(k + 1))


def table_violations(table: dn.PoissonTable, every: int = 1) -> list[str]:
    """Each table entry (every ``every``-th) against mpmath: ``2^K R_k <= W_b`` (the acceptance is at
    most 1) and ``accept_lo <= 2^K R_k / W_b <= accept_hi``."""
    import mpmath

    out = []
    with mpmath.workdps(60):
        for i in range(0, table.accept_lo.size, every):
            k = table.k_lo + i
            weight = int(table.block_weights[i // table.width])
            a = ratio_mp(table.lam, k, table.mode) * mpmath.mpf(2) ** table.shift / weight
            lo, hi = float(table.accept_lo[i]), float(table.accept_hi[i])
            if not (a <= 1 and mpmath.mpf(lo) <= a <= mpmath.mpf(hi)):
                out.append(f"k={k}: acceptance {mpmath.nstr(a, 20)} outside [{lo!r}, {hi!r}] or above 1")
    return out


@pytest.mark.parametrize("lam, every", [(0.3, 1), (7.5, 1), (1000.25, 1), (123456.75, 7), (1e8, 997)])
def test_the_tables_weights_and_acceptance_bounds_hold_exactly(lam, every):
    table = dn.poisson_table(Fraction(lam))
    assert table_violations(table, every) == []
    assert (table.accept_hi - table.accept_lo).max() < 2.0**-45  # the exact path runs ~never


@pytest.mark.parametrize("lam", [Fraction(3, 10), Fraction(15, 2), Fraction(400001, 4)])
def test_pmf_ratio_bounds_enclose_the_exact_ratios(lam):
    m = math.floor(lam)
    lo, hi = max(0, m - 60), m + 60
    u = dn.pmf_ratio_bounds(lam, m, lo, hi, bits=100)
    for k, uk in zip(range(lo, hi + 1), u):
        falling = math.prod(range(m + 1, k + 1)) if k >= m else Fraction(1, math.prod(range(k + 1, m + 1)))
        exact = lam ** (k - m) / falling  # lam^(k-m) m!/k!
        assert uk <= exact * 2**100 <= uk + abs(k - m)


@pytest.mark.parametrize("lam, half_width", [(50.0, 3), (3.5, 1), (0.3, 0)])
def test_the_geometric_tails_are_exact(lam, half_width):
    """A narrow table sends most candidates to the tails (blocks of several integers at 50, the left
    tail truncated at 0 at 3.5; each tail candidate decided exactly): still the pmf, and the float
    path still gives the exact reference's draws."""
    table = dn.poisson_table(Fraction(lam), half_width)
    assert len(table.tails) == (1 if table.k_lo == 0 else 2)
    draws = dn.sample_poisson(table, rng.RandomSource(5).stream(0, 0, rng.DATA), 50_000)
    assert binned_chi_square_p(draws, lambda s: poisson_pmf(lam, s), per_bin=200.0) > P_MIN
    assert (draws < table.k_lo).any() and (draws > table.k_lo + table.accept_lo.size - 1).any() or table.k_lo == 0
    a = dn.sample_poisson(table, rng.RandomSource(6).stream(0, 0, rng.DATA), 3000)
    b = dn.sample_poisson(table, rng.RandomSource(6).stream(0, 0, rng.DATA), 3000, exact_reference=True)
    assert np.array_equal(a, b)


def test_the_integer_alias_table_is_a_bijection():
    g = np.random.default_rng(0)
    for _ in range(200):
        masses = [int(x) for x in g.integers(0, 40, g.integers(1, 12))]
        if sum(masses) == 0:
            continue
        t = dn.integer_alias(masses)
        full = masses + [t.capacity * t.cut.size - sum(masses)]
        assert 0 <= full[-1] < t.cut.size
        entry, offset = t.locate(np.arange(t.capacity * t.cut.size, dtype=np.int64))
        for i, mass in enumerate(full):
            assert np.array_equal(np.sort(offset[entry == i]), np.arange(mass)), (masses, i)


# ----------------------------------------------------------------------------- planted bugs
def _biased_accept(monkeypatch, lam):  # the acceptance's float bounds 5% too high: the float path accepts too often
    t = dn.poisson_table(Fraction(lam))
    return t._replace(accept_lo=np.minimum(t.accept_lo * 1.05, 1.0), accept_hi=np.minimum(t.accept_hi * 1.05, 1.0))


def _wrong_ratio(monkeypatch, lam):  # the pmf ratios of a lam 0.1% off: weights below 2^K R_k on one side
    real = dn.pmf_ratio_bounds
    monkeypatch.setattr(dn, "pmf_ratio_bounds", lambda l, *a, **k: real(l * Fraction(1001, 1000), *a, **k))
    dn.poisson_table.cache_clear()
    try:
        return dn.poisson_table(Fraction(lam))
    finally:
        dn.poisson_table.cache_clear()


@pytest.mark.parametrize("plant", [_biased_accept, _wrong_ratio])
def test_planted_bugs_are_caught(monkeypatch, plant):
    lam = 1e4
    table = plant(monkeypatch, lam)
    assert table_violations(table, every=3)
    if plant is _biased_accept:  # too close to 1 to move the pmf visibly: the exact reference sees it
        fast = dn.sample_poisson(table, rng.RandomSource(8).stream(0, 0, rng.DATA), 20_000)
        exact = dn.sample_poisson(table, rng.RandomSource(8).stream(0, 0, rng.DATA), 20_000, exact_reference=True)
        assert not np.array_equal(fast, exact)
    else:
        draws = dn.sample_poisson(table, rng.RandomSource(7).stream(0, 0, rng.DATA), 1_000_000)
        assert binned_chi_square_p(draws, lambda s: poisson_pmf(lam, s)) < 1e-6


def test_draws_repeat_from_the_key_and_not_from_the_cache():
    a = dn.skellam(rng.RandomSource(3).stream(4, 5, rng.CLIENT_NOISE), 1e6, 5000)
    dn.poisson_table.cache_clear()
    b = dn.skellam(rng.RandomSource(3).stream(4, 5, rng.CLIENT_NOISE), 1e6, 5000)
    c = dn.skellam(rng.RandomSource(3).stream(4, 6, rng.CLIENT_NOISE), 1e6, 5000)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert dn.poisson(rng.RandomSource(3).stream(4, 5, rng.DATA), 5.0, 0).shape == (0,)


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
    n = 10_000
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
