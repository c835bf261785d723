"""PrivUnit + ScalarDP (paper 002, App. D): unbiasedness, exact norms, exact privacy ratios,
constants against independent numerical integration, norm estimation, stability at d = 1e7.

Monte Carlo tolerances: a mean of N i.i.d. draws is compared with its expected value within
``Z_TOL`` standard errors (SE = sample std / sqrt(N)). With ``Z_TOL = 4.5`` a correct sampler
fails one comparison with probability ~7e-6 (two-sided normal tail); seeds are fixed, so the
tests are deterministic, and the errors they are meant to catch (a wrong m, a cap drawn with the
wrong probability) are tens of SEs.
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from dpfl_lightning.privacy import privunit as pu

Z_TOL = 4.5


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def unit(d: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    x = torch.randn(d, generator=gen(seed), dtype=torch.float64)
    return (x / x.norm()).to(dtype)


# --------------------------------------------------------------- independent reference values


def quad_cap_law(d: int, gamma: float) -> tuple[float, float, float]:
    """``(P(t >= gamma), E[t | t >= gamma], E[t | t < gamma])`` for ``t = <V, u>``, ``V`` uniform
    on S^{d-1}: density proportional to ``(1 - t^2)^((d-3)/2)`` on [-1, 1], integrated by quad."""
    if d == 2:  # (1 - t^2)^(-1/2): integrable end-point singularities, handled by quad's weights
        cap_f = integrate.quad(lambda t: (1 + t) ** -0.5, gamma, 1, weight="alg", wvar=(0, -0.5))[0]
        cap_t = integrate.quad(lambda t: t * (1 + t) ** -0.5, gamma, 1, weight="alg", wvar=(0, -0.5))[0]
        rest_f = integrate.quad(lambda t: (1 - t) ** -0.5, -1, gamma, weight="alg", wvar=(-0.5, 0))[0]
        rest_t = integrate.quad(lambda t: t * (1 - t) ** -0.5, -1, gamma, weight="alg", wvar=(-0.5, 0))[0]
    else:
        beta = (d - 3) / 2.0
        half = min(1.0, 12.0 / math.sqrt(d))  # density beyond: < exp(-70) of its peak

        def f(t):
            return math.exp(beta * math.log1p(-t * t)) if abs(t) < 1 else (1.0 if beta == 0 else 0.0)

        kw = dict(epsabs=0.0, epsrel=1e-13, limit=500)

        def integrals(lo, hi):  # (int f, int t f) over [lo, hi], split at 0 (t f changes sign)
            cuts = [lo] + [q for q in (0.0,) if lo < q < hi] + [hi]
            pieces = list(zip(cuts[:-1], cuts[1:]))
            return (
                sum(integrate.quad(f, x, y, **kw)[0] for x, y in pieces),
                sum(integrate.quad(lambda t: t * f(t), x, y, **kw)[0] for x, y in pieces),
            )

        cap_f, cap_t = integrals(gamma, half) if gamma < half else (0.0, 0.0)
        rest_f, rest_t = integrals(-half, min(gamma, half))
    return cap_f / (cap_f + rest_f), cap_t / cap_f, rest_t / rest_f


def paper_condition(d: int, eps1: float, gamma: float) -> bool:
    """Alg. 3's admissibility of gamma, retyped from the paper."""
    c1 = gamma <= (math.exp(eps1) - 1) / (math.exp(eps1) + 1) * math.sqrt(math.pi / (2 * (d - 1)))
    c2 = (
        eps1 >= 0.5 * math.log(d) + math.log(6) - (d - 1) / 2 * math.log(1 - gamma**2) + math.log(gamma)
        and gamma >= math.sqrt(2 / d)
    )
    return c1 or c2


def rr_distribution(r: float, C: float, eps2: float, k: int) -> np.ndarray:
    """Alg. 4's output law of J_hat, retyped from the paper (stochastic rounding, then k-ary RR)."""
    x = k * r / C
    lo, hi = math.floor(x), math.ceil(x)
    pj = np.zeros(k + 1)
    if lo == hi:
        pj[lo] = 1.0
    else:
        pj[lo] = hi - x
        pj[hi] = 1 - (hi - x)
    e = math.exp(eps2)
    out = np.zeros(k + 1)
    for j in range(k + 1):
        for jj in range(k + 1):
            out[jj] += pj[j] * (e / (e + k) if jj == j else (1 - e / (e + k)) / k)
    return out


def paper_scalar_constants(eps2: float, C: float, k: int):
    e = math.exp(eps2)
    a = (e + k) / (e - 1) * C / k
    b = k * (k + 1) / (2 * (e + k))
    c1 = (k + 1) / (e - 1)
    c2 = -c1 * C
    bracket = (2 * k + 1) * (e + k) / (6 * k * (e - 1)) - (k + 1) / (4 * (e - 1))
    c3 = (c1 + 1) * C**2 / (4 * k**2) + c1 * C**2 * bracket
    return a, b, c1, c2, c3


# --------------------------------------------------------------- PrivUnit


@pytest.mark.parametrize("d,eps0,eps1", [(5, 1.0, 1.0), (12, 0.5, 4.0), (20, 2.0, 8.0)])
def test_privunit_is_unbiased(d, eps0, eps1):
    consts = pu.privunit_constants(d, eps0, eps1, 1.0, 1.0)
    u = unit(d, seed=d)
    n = 200_000
    z = pu.privunit(u.expand(n, d), consts, gen(1))
    mean = z.mean(0)
    se = z.std(0) / math.sqrt(n)  # SE of each coordinate's Monte Carlo mean
    zscores = ((mean - u) / se).abs()
    assert float(zscores.max()) < Z_TOL, zscores
    # the component along u alone: a 2% error in m would be > 10 SE here
    along = z @ u
    se_along = float(along.std()) / math.sqrt(n)
    assert abs(float(along.mean()) - 1.0) < Z_TOL * se_along


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_privunit_norm_is_one_over_m(dtype, rtol):
    # rtol: float rounding of a d = 64 vector (float32: a few ulps of 6e-8)
    d = 64
    consts = pu.privunit_constants(d, 1.0, 3.0, 1.0, 1.0)
    z = pu.privunit(unit(d, 3, dtype).expand(5000, d), consts, gen(2))
    assert z.dtype == dtype
    norms = torch.linalg.vector_norm(z, dim=-1, dtype=torch.float64).numpy()
    np.testing.assert_allclose(norms * consts.m, 1.0, rtol=rtol, atol=0)
    # and the 1/m it is scaled to is the quadrature m, not just the module's own
    _, e_cap, e_rest = quad_cap_law(d, consts.gamma)
    np.testing.assert_allclose(consts.m, consts.p * e_cap + (1 - consts.p) * e_rest, rtol=1e-9)


@pytest.mark.parametrize("d,eps0,eps1", [(3, 1.0, 1.0), (10, 0.2, 2.0), (100, 3.0, 5.0)])
def test_fraction_in_cap_is_p(d, eps0, eps1):
    consts = pu.privunit_constants(d, eps0, eps1, 1.0, 1.0)
    u = unit(d, 4)
    n = 100_000
    z = pu.privunit(u.expand(n, d), consts, gen(5))
    t = (z @ u).numpy() * consts.m
    frac = float(np.mean(t >= consts.gamma))
    p = math.exp(eps0) / (1 + math.exp(eps0))
    assert abs(frac - p) < Z_TOL * math.sqrt(p * (1 - p) / n)  # SE of a Bernoulli(p) mean


def test_cap_coordinate_has_the_sphere_law_d3():
    # Archimedes: for d = 3, <V, u> is uniform on [-1, 1]; so uniform on [gamma, 1] in the cap
    # and on [-1, gamma) off it. KS tests at level 1e-4.
    consts = pu.privunit_constants(3, 1.0, 2.0, 1.0, 1.0)
    g = consts.gamma
    t, s, in_cap = pu.sample_cap_coordinate(consts, gen(6), 50_000)
    assert stats.kstest(t[in_cap], stats.uniform(g, 1 - g).cdf).pvalue > 1e-4
    assert stats.kstest(t[~in_cap], stats.uniform(-1, 1 + g).cdf).pvalue > 1e-4
    np.testing.assert_allclose(t**2 + s**2, 1.0, rtol=1e-14)


def test_cap_coordinate_large_d_is_gaussian_with_right_tails():
    # d = 1e6: t sqrt(d) ~ N(0, 1) to O(1/d); compare the truncated laws by KS (level 1e-4)
    d = 10**6
    consts = pu.privunit_constants(d, 1.0, 6.0, 1.0, 1.0)
    c = consts.gamma * math.sqrt(d)
    t, _, in_cap = pu.sample_cap_coordinate(consts, gen(7), 40_000)
    x = t * math.sqrt(d)
    assert np.all(x[in_cap] >= c) and np.all(x[~in_cap] < c)
    assert stats.kstest(x[in_cap], stats.truncnorm(c, np.inf).cdf).pvalue > 1e-4
    assert stats.kstest(x[~in_cap], stats.truncnorm(-np.inf, c).cdf).pvalue > 1e-4


@pytest.mark.parametrize("d", [2, 3, 4, 7, 20, 50, 1000])
@pytest.mark.parametrize("eps0,eps1", [(1.0, 0.5), (0.5, 3.0), (2.0, 9.0)])
def test_m_and_cap_mass_against_quadrature(d, eps0, eps1):
    consts = pu.privunit_constants(d, eps0, eps1, 1.0, 1.0)
    P, e_cap, e_rest = quad_cap_law(d, consts.gamma)
    p = math.exp(eps0) / (1 + math.exp(eps0))
    m = p * e_cap + (1 - p) * e_rest  # E[<V, u>]: V = m u on average
    # rtol 1e-8: quad is asked for 1e-13; the module uses betainc/betaln (~1e-14 each)
    np.testing.assert_allclose(consts.cap_mass, P, rtol=1e-8)
    np.testing.assert_allclose(consts.rest_mass, 1 - P, rtol=1e-8)
    np.testing.assert_allclose(consts.m, m, rtol=1e-8)
    if d == 3:  # closed form: t uniform, so m = (gamma + 2p - 1) / 2
        np.testing.assert_allclose(consts.m, (consts.gamma + 2 * p - 1) / 2, rtol=1e-12)


@pytest.mark.parametrize("d", [10**6, 10**7])
def test_m_large_d_against_quadrature_and_gaussian_limit(d):
    consts = pu.privunit_constants(d, 1.0, 4.0, 2.0, 1.0)
    assert math.isfinite(consts.m) and consts.m > 0
    P, e_cap, e_rest = quad_cap_law(d, consts.gamma)
    np.testing.assert_allclose(consts.cap_mass, P, rtol=1e-7)
    np.testing.assert_allclose(consts.m, consts.p * e_cap + (1 - consts.p) * e_rest, rtol=1e-7)
    # Gaussian limit: t ~ N(0, 1/d); relative error O(1/d)
    c = consts.gamma * math.sqrt(d)
    phi, tail = stats.norm.pdf(c), stats.norm.sf(c)
    m_gauss = (consts.p * phi / tail - (1 - consts.p) * phi / (1 - tail)) / math.sqrt(d)
    np.testing.assert_allclose(consts.m, m_gauss, rtol=1e-4)
    np.testing.assert_allclose(consts.cap_mass, tail, rtol=1e-4)


@pytest.mark.parametrize("d", [3, 4, 5, 10, 50, 1000, 10**7])
@pytest.mark.parametrize("eps1", [0.1, 1.0, 3.0, 5.0, 10.0])
def test_gamma_satisfies_alg3_and_is_largest(d, eps1):
    consts = pu.privunit_constants(d, 1.0, eps1, 1.0, 1.0)
    g = consts.gamma
    assert 0 < g < 1
    # admissible, and the largest such gamma; the condition is evaluated 1e-12 (relative) inside
    # the boundary to absorb rounding (the module evaluates log1p(-g^2), this test log(1 - g^2))
    assert paper_condition(d, eps1, g * (1 - 1e-12))
    assert not paper_condition(d, eps1, g * (1 + 1e-9))
    # the conditions are sufficient: the exact privacy loss of the cap (by quadrature) is <= eps1
    P, _, _ = quad_cap_law(d, g)
    assert math.log((1 - P) / P) <= eps1
    np.testing.assert_allclose(consts.direction_epsilon, 1.0 + math.log((1 - P) / P), rtol=1e-7)


@pytest.mark.parametrize("eps1", [0.5, 2.0, 8.0])
def test_d2_falls_back_to_the_exact_gamma(eps1):
    # on S^1, P(cap) = arccos(gamma) / pi exactly
    consts = pu.privunit_constants(2, 1.0, eps1, 1.0, 1.0)
    P = math.acos(consts.gamma) / math.pi
    assert math.log((1 - P) / P) <= eps1 + 1e-12
    if eps1 >= 2.0:  # condition 1 admits gamma with a loss > eps1 (or >= 1), condition 2 none
        assert consts.gamma_source.startswith("exact")
        np.testing.assert_allclose(math.log((1 - P) / P), eps1, rtol=1e-9)


@pytest.mark.parametrize("eps1", [0.3, 1.0, 4.0, 12.0])
def test_exact_gamma_rule_d3_closed_form(eps1):
    # d = 3: P = (1 - gamma)/2, so log((1-P)/P) = eps1 gives gamma = tanh(eps1 / 2)
    exact = pu.privunit_constants(3, 1.0, eps1, 1.0, 1.0, gamma_rule="exact")
    paper = pu.privunit_constants(3, 1.0, eps1, 1.0, 1.0)
    np.testing.assert_allclose(exact.gamma, math.tanh(eps1 / 2), rtol=1e-12)
    assert exact.gamma >= paper.gamma and exact.m >= paper.m
    assert exact.direction_epsilon <= 1.0 + eps1


# --------------------------------------------------------------- ScalarDP


@pytest.mark.parametrize("eps2,k", [(0.5, 2), (1.0, 2), (3.0, 3), (3 * math.log(2), 2), (6.0, 8), (10.0, 29)])
def test_levels_are_ceil_exp_eps2_over_3(eps2, k):
    assert pu.privunit_constants(10, 1.0, 1.0, eps2, 1.0).k == k


@pytest.mark.parametrize("eps2", [0.5, 1.0, 3.0, 6.0])
def test_scalar_dp_exactly_unbiased(eps2):
    C = 2.5
    consts = pu.privunit_constants(10, 1.0, 1.0, eps2, C)
    a, b, *_ = paper_scalar_constants(eps2, C, consts.k)
    np.testing.assert_allclose([consts.a, consts.b], [a, b], rtol=1e-14)
    for r in [0.0, 1e-9, 0.3, C / consts.k, 1.7, C * (1 - 1e-12), C]:
        dist = rr_distribution(r, C, eps2, consts.k)
        np.testing.assert_allclose(pu.scalar_dp_probabilities(r, consts), dist, rtol=1e-12, atol=1e-15)
        mean = float(np.sum(dist * a * (np.arange(consts.k + 1) - b)))
        assert abs(mean - r) < 1e-12 * C


@pytest.mark.parametrize("eps2", [1.0, 6.0])
def test_scalar_dp_sampler_matches_its_law(eps2):
    C = 1.5
    consts = pu.privunit_constants(10, 1.0, 1.0, eps2, C)
    n = 100_000
    for i, r in enumerate([0.0, 0.4, C]):
        r_hat = pu.scalar_dp(np.full(n, r), consts, gen(10 + i))
        assert abs(r_hat.mean() - r) < Z_TOL * r_hat.std() / math.sqrt(n)
        j = np.rint(r_hat / consts.a + consts.b).astype(int)
        np.testing.assert_allclose(consts.a * (j - consts.b), r_hat, rtol=0, atol=1e-12)
        freq = np.bincount(j, minlength=consts.k + 1) / n
        prob = rr_distribution(r, C, eps2, consts.k)
        assert np.all(np.abs(freq - prob) <= Z_TOL * np.sqrt(prob * (1 - prob) / n) + 1e-12)


@pytest.mark.parametrize("eps2", [0.3, 1.0, 3.0, 6.0, 10.0])
def test_scalar_dp_is_exactly_eps2_dp(eps2):
    # worst-case ratio of output probabilities over all pairs of inputs in [0, C] (a grid with
    # every level and the midpoints) and every output: exactly e^eps2, no more
    C = 1.0
    consts = pu.privunit_constants(10, 1.0, 1.0, eps2, C)
    k = consts.k
    grid = [np.arange(k + 1) / k, (np.arange(k) + 0.5) / k, np.linspace(0, 1, 37)]
    rs = np.unique(np.concatenate(grid)) * C
    probs = np.array([pu.scalar_dp_probabilities(float(r), consts) for r in rs])
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-13)
    assert np.all(probs > 0)
    worst = float(np.max(np.log(probs.max(0) / probs.min(0))))
    np.testing.assert_allclose(worst, eps2, rtol=1e-12)


# --------------------------------------------------------------- norm estimation (Alg. 5)


@pytest.mark.parametrize("eps2", [0.5, 1.0, 3.0, 6.0, 10.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sign_and_r_hat_recovered_for_every_outcome(eps2, dtype):
    d, C = 300, 3.0
    consts = pu.privunit_constants(d, 1.0, 2.0, eps2, C)
    a, b, *_ = paper_scalar_constants(eps2, C, consts.k)
    js = np.arange(consts.k + 1)
    r_hat = a * (js - b)  # every value ScalarDP can output
    z = pu.privunit(unit(d, 11, dtype).expand(len(js), d), consts, gen(12))
    c = z * torch.as_tensor(r_hat, dtype=dtype).unsqueeze(-1)
    norms = torch.linalg.vector_norm(c, dim=-1, dtype=torch.float64).numpy()
    got, got_j = pu.recover_r_hat(norms, consts)
    np.testing.assert_array_equal(got_j, js)
    np.testing.assert_allclose(got, r_hat, rtol=0, atol=1e-12 * C)
    # the vectorised estimator and the per-update one agree with s_hat of the true r_hat
    s_true = (r_hat**2 - consts.c2 * r_hat - consts.c3) / (1 + consts.c1)
    np.testing.assert_allclose(pu.estimate_sq_norm(norms, consts), s_true, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(pu.estimate_sq_norm_of(c, consts), s_true, rtol=1e-12, atol=1e-12)


def test_recover_refuses_norms_off_the_lattice():
    consts = pu.privunit_constants(50, 1.0, 2.0, 3.0, 1.0)
    half_way = (consts.a * 0.5) / consts.m  # m||c||/a = 1/2: between two levels
    with pytest.raises(ValueError, match="not within"):
        pu.recover_r_hat(half_way, consts)


@pytest.mark.parametrize("eps2", [0.5, 1.0, 3.0, 6.0, 10.0])
def test_expected_s_hat_at_most_r_squared_exact(eps2):
    C = 2.0
    consts = pu.privunit_constants(10, 1.0, 1.0, eps2, C)
    k = consts.k
    a, b, c1, c2, c3 = paper_scalar_constants(eps2, C, k)
    np.testing.assert_allclose([consts.c1, consts.c2, consts.c3], [c1, c2, c3], rtol=1e-13)
    values = a * (np.arange(k + 1) - b)
    s_values = pu.s_hat_from_r_hat(values, consts)
    scale = C * C
    for r in np.linspace(0, C, 41):
        dist = rr_distribution(float(r), C, eps2, k)
        var = float(np.sum(dist * (values - r) ** 2))
        bound = c1 * r * r + c2 * r + c3
        assert var <= bound + 1e-12 * scale  # Lemma D.3's variance bound
        assert float(np.sum(dist * s_values)) <= r * r + 1e-12 * scale
        # exactly: Var r_hat = c1 r^2 + c2 r + c3 - a^2 lambda (1/4 - f(1-f)), f = frac(kr/C),
        # lambda = (e^eps2 - 1)/(e^eps2 + k) = 1/(1 + c1); so E[s_hat] = r^2 - (C/k)^2 (1/4 - f(1-f))
        f = k * r / C - math.floor(k * r / C)
        gap = (C / k) ** 2 * (0.25 - f * (1 - f))
        np.testing.assert_allclose(float(np.sum(dist * s_values)), r * r - gap, rtol=0, atol=1e-11 * scale)
    for j in range(k):  # frac(kr/C) = 1/2: the bound is tight, so E[s_hat] = r^2 exactly
        r = (j + 0.5) * C / k
        dist = rr_distribution(r, C, eps2, k)
        np.testing.assert_allclose(float(np.sum(dist * s_values)), r * r, rtol=0, atol=1e-11 * scale)


def test_ambiguous_sign_is_reported():
    # eps2 = log 4: k = 2, k(k+1)/(e^eps2 + k) = 1, an integer (Lemma D.3's excluded case)
    with pytest.warns(RuntimeWarning, match="cannot tell the sign"):
        consts = pu.privunit_constants(11, 1.0, 1.0, math.log(4.0), 1.0)
    assert consts.k == 2 and consts.sign_margin < 1e-12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pu.privunit_constants(11, 1.0, 1.0, 1.0, 1.0).sign_margin > 0.2


# --------------------------------------------------------------- the combined randomizer


def test_privatize_is_unbiased_and_reports_epsilon():
    d, C = 8, 2.0
    consts = pu.privunit_constants(d, 1.0, 2.0, 3.0, C)
    x = unit(d, 13) * 1.3
    n = 100_000
    rel = pu.privatize(x.expand(n, d), consts, gen(14))
    assert rel.epsilon == pytest.approx(6.0)
    zs = ((rel.c.mean(0) - x) / (rel.c.std(0) / math.sqrt(n))).abs()
    assert float(zs.max()) < Z_TOL, zs
    # ||c|| = |r_hat| / m for each client
    norms = torch.linalg.vector_norm(rel.c, dim=-1, dtype=torch.float64).numpy()
    np.testing.assert_allclose(norms * consts.m, np.abs(rel.r_hat), rtol=1e-13, atol=1e-15)


def test_privatize_zero_vector_and_norm_bound():
    d, C = 6, 1.0
    consts = pu.privunit_constants(d, 1.0, 2.0, 2.0, C)
    n = 100_000
    rel = pu.privatize(torch.zeros(n, d), consts, gen(15))
    assert torch.isfinite(rel.c).all()
    zs = (rel.c.double().mean(0) / (rel.c.double().std(0) / math.sqrt(n))).abs()
    assert float(zs.max()) < Z_TOL  # E[c] = 0
    x = unit(d, 16, torch.float32)
    pu.privatize(x * C * (1 + 1e-6), consts, gen(17))  # rounding above C: accepted
    with pytest.raises(ValueError, match="Clip the update"):
        pu.privatize(x * C * 1.001, consts, gen(17))


def test_same_generator_state_same_release():
    consts = pu.privunit_constants(40, 1.0, 2.0, 2.0, 1.0)
    x = unit(40, 18) * 0.5
    c1 = pu.privatize(x, consts, gen(19)).c
    c2 = pu.privatize(x, consts, gen(19)).c
    c3 = pu.privatize(x, consts, gen(20)).c
    assert torch.equal(c1, c2) and not torch.equal(c1, c3)


def test_d_1e7_is_stable_and_fast():
    d, C = 10**7, 1.0
    start = time.perf_counter()
    consts = pu.privunit_constants(d, 1.0, 4.0, 3.0, C)
    x = torch.randn(d, generator=gen(21))
    x = x * (0.7 * C / torch.linalg.vector_norm(x, dtype=torch.float64).item())
    rel = pu.privatize(x, consts, gen(22))
    norm = torch.linalg.vector_norm(rel.c, dtype=torch.float64).item()
    elapsed = time.perf_counter() - start
    assert torch.isfinite(rel.c).all() and math.isfinite(consts.m) and consts.m > 0
    # ||c|| = |r_hat| / m to float32 rounding (each entry rounds by <= 6e-8 relative)
    np.testing.assert_allclose(norm * consts.m, abs(float(rel.r_hat)), rtol=1e-5)
    # and r_hat is one of ScalarDP's levels a(j - b), recovered from ||c|| alone
    r_hat, j = pu.recover_r_hat(norm, consts)
    np.testing.assert_allclose(r_hat, float(rel.r_hat), rtol=0, atol=1e-12)
    assert 0 <= int(j) <= consts.k
    # the direction correlates with x as PrivUnit's cap law says: <V, x/|x|> is t = m<Z, u>
    t = float(torch.dot(rel.c.double(), x.double())) / (0.7 * C) / (float(rel.r_hat) / consts.m)
    assert -1 <= t <= 1
    assert elapsed < 15.0, elapsed
