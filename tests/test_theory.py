"""Paper 000 (DP-ScaffNew) theory: Corollary 1's closed form against a brute-force minimisation of
Theorem 1's bound.

``_eq2`` below is an independent, vectorised transcription of Theorem 1, eq. (2), with Lemma 1's
sigma substituted as in App. B.1; the brute-force searches use it, not the module's code.
"""

import math

import numpy as np
import pytest

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.privacy.theory import (
    ScaffNewOptimum,
    initial_lyapunov,
    privacy_sigma,
    scaffnew_bound,
    scaffnew_optimal,
)

# Two settings with T* well inside the range Theorem 1 covers (T* ~ 21 and ~ 687).
SETTINGS = {
    "fast": dict(mu=0.1, L=1.0, epsilon=1.0, delta=1e-5, C=1.0, N=10, d=100, psi0=1e6, v=1.0),
    "slow": dict(mu=0.01, L=2.0, epsilon=3.0, delta=1e-5, C=0.5, N=5, d=1000, psi0=1e7, v=2.0),
}
# Search ranges for T, fixed in advance (not derived from the code under test).
T_MAX = {"fast": 100.0, "slow": 2500.0, "ceil": 100.0}


def _eq2(eta, p, T, *, mu, L, epsilon, delta, C, N, d, psi0, v):
    """E[psi_T] <= theta^T psi0 + p N d sigma^2 / (1 - theta), theta = max(1 - mu eta, 1 - p^2),
    sigma^2 = v C^2 p T ln(1/delta) / epsilon^2 (Lemma 1)."""
    eta, p, T = np.asarray(eta, float), np.asarray(p, float), np.asarray(T, float)
    theta = np.maximum(1 - mu * eta, 1 - p**2)
    sigma2 = v * C**2 * p * T * np.log(1 / delta) / epsilon**2
    return theta**T * psi0 + p * N * d * sigma2 / (1 - theta)


def _log_grid(lo, hi, n):
    grid = np.geomspace(lo, hi, n)
    return grid, math.log(hi / lo) / (n - 1)


@pytest.mark.parametrize("name", SETTINGS)
def test_t_star_is_the_bruteforce_argmin_over_t_at_eta_star_p_star(name):
    s = SETTINGS[name]
    opt = scaffnew_optimal(**s)
    assert opt.eta == 1 / s["L"] and opt.p == pytest.approx(math.sqrt(s["mu"] / s["L"]), rel=1e-15)
    assert opt.T > 1
    grid = np.linspace(0, T_MAX[name], 20001)
    values = _eq2(opt.eta, opt.p, grid, **s)
    # The bound is convex in T, so the grid argmin is a neighbour of the true minimiser.
    assert abs(grid[np.argmin(values)] - opt.T) <= grid[1] - grid[0]
    assert values.min() >= opt.bound * (1 - 1e-12)
    assert opt.bound == pytest.approx(_eq2(opt.eta, opt.p, opt.T, **s), rel=1e-12)


@pytest.mark.parametrize("name", [*SETTINGS, "ceil"])
def test_integer_t_is_the_bruteforce_argmin_over_whole_iterations(name):
    # "ceil": T* = 30.79, where rounding up is better than down (the other two round down).
    s = SETTINGS[name] if name in SETTINGS else {**SETTINGS["fast"], "psi0": 2.8e6}
    opt = scaffnew_optimal(**s)
    assert opt.T_integer == (31 if name == "ceil" else math.floor(opt.T))
    ts = np.arange(0, int(T_MAX[name]) + 1)
    values = _eq2(opt.eta, opt.p, ts, **s)
    assert opt.T_integer == ts[np.argmin(values)]
    assert opt.bound_integer == pytest.approx(values.min(), rel=1e-12)
    assert opt.bound <= opt.bound_integer


@pytest.mark.parametrize("name", SETTINGS)
def test_eta_star_p_star_minimise_the_bound_over_a_grid_at_fixed_t(name):
    """Corollary 1 claims (1/L, sqrt(mu/L)) minimises eq. (2) over (eta, p); check it at several T."""
    s = SETTINGS[name]
    opt = scaffnew_optimal(**s)
    etas, _ = _log_grid(1e-3 / s["L"], 1 / s["L"], 61)
    ps, dlogp = _log_grid(1e-3, 1.0, 1201)
    E, P = np.meshgrid(etas, ps, indexing="ij")
    for T in (1.0, opt.T / 2, opt.T, 2 * opt.T, float(opt.T_integer)):
        values = _eq2(E, P, T, **s)
        best = _eq2(opt.eta, opt.p, T, **s)
        i, j = np.unravel_index(np.argmin(values), values.shape)
        assert values.min() >= best * (1 - 1e-12)  # no grid point beats the closed form
        assert abs(math.log(ps[j] / opt.p)) <= dlogp  # the grid's best p is next to p*
        # eta = 1/L is among the grid's minimisers (for p < p* the bound is flat in eta >= p^2/mu).
        assert _eq2(etas[-1], ps[j], T, **s) == pytest.approx(values.min(), rel=1e-12)


@pytest.mark.parametrize("name", SETTINGS)
def test_closed_form_is_the_joint_bruteforce_minimum_over_eta_p_t(name):
    s = SETTINGS[name]
    opt = scaffnew_optimal(**s)
    etas, _ = _log_grid(1e-3 / s["L"], 1 / s["L"], 25)
    ps, dlogp = _log_grid(1e-3, 1.0, 587)
    ts = np.linspace(0, T_MAX[name], 301)
    values = _eq2(etas[:, None, None], ps[None, :, None], ts[None, None, :], **s)
    i, j, k = np.unravel_index(np.argmin(values), values.shape)
    assert values.min() >= opt.bound * (1 - 1e-12)
    assert values.min() <= opt.bound * 1.01
    assert abs(math.log(ps[j] / opt.p)) <= dlogp
    # At a grid p within dlogp of p*, the T-minimiser moves by at most about 2 dlogp / lam.
    lam = -math.log1p(-s["mu"] / s["L"])
    assert abs(ts[k] - opt.T) <= (ts[1] - ts[0]) + 2 * dlogp / lam


@pytest.mark.parametrize("name", SETTINGS)
def test_optimum_fields_follow_corollary_1(name):
    s = SETTINGS[name]
    opt = scaffnew_optimal(**s)
    lam = math.log(1 / (1 - s["mu"] / s["L"]))
    K = s["v"] * s["C"] ** 2 * s["N"] * s["d"] * math.log(1 / s["delta"]) / s["epsilon"] ** 2
    arg = s["psi0"] * s["epsilon"] ** 2 * lam / (s["v"] * s["C"] ** 2 * s["N"] * s["d"] * math.log(1 / s["delta"]))
    assert opt.log_argument == pytest.approx(arg, rel=1e-12)
    assert opt.T == pytest.approx(math.log(arg) / lam, rel=1e-10)
    assert opt.expected_local_steps == pytest.approx(1 / opt.p, rel=1e-15)
    assert opt.expected_rounds == pytest.approx(opt.p * opt.T, rel=1e-15)
    # Stationarity of B(T) = (1 - mu/L)^T psi0 + K T gives B(T*) = K (T* + 1/lam).
    assert opt.bound == pytest.approx(K * (opt.T + 1 / lam), rel=1e-10)
    sigma = s["C"] * math.sqrt(s["v"] * opt.p * opt.T * math.log(1 / s["delta"])) / s["epsilon"]
    assert opt.sigma == pytest.approx(sigma, rel=1e-12)
    assert opt.noise_multiplier == pytest.approx(sigma / s["C"], rel=1e-12)
    assert opt.sigma_integer == pytest.approx(privacy_sigma(opt.p, opt.T_integer, s["epsilon"], s["delta"],
                                                            s["C"], s["v"]), rel=1e-15)


def test_module_bound_matches_the_transcription_of_eq2():
    s = SETTINGS["fast"]
    rng = np.random.default_rng(0)
    for eta, p, T in zip(rng.uniform(1e-3, 1, 50), rng.uniform(1e-3, 1, 50), rng.uniform(0, 200, 50)):
        assert scaffnew_bound(eta, p, T, **s) == pytest.approx(float(_eq2(eta, p, T, **s)), rel=1e-12)
    assert scaffnew_bound(0.5, 0.3, 0, **s) == s["psi0"]


@pytest.mark.parametrize("factor", [1e-6, 0.5, 0.999])
def test_no_training_when_the_log_argument_is_at_most_one(factor):
    s = dict(SETTINGS["fast"])
    lam = -math.log1p(-s["mu"] / s["L"])
    K = s["v"] * s["C"] ** 2 * s["N"] * s["d"] * math.log(1 / s["delta"]) / s["epsilon"] ** 2
    s["psi0"] = factor * K / lam  # Corollary 1's argument psi0 lam / K equals `factor`
    opt = scaffnew_optimal(**s)
    assert opt.log_argument == pytest.approx(factor, rel=1e-12)
    assert opt.T == 0 and opt.expected_rounds == 0 and opt.T_integer == 0
    assert opt.sigma == 0 and opt.bound == s["psi0"]
    assert opt.expected_local_steps == pytest.approx(math.sqrt(s["L"] / s["mu"]))
    # And indeed the bound only grows with T: no iteration count beats not training.
    ts = np.linspace(0, 100, 1001)
    assert np.all(np.diff(_eq2(opt.eta, opt.p, ts, **s)) > 0)
    assert "no training helps" in opt.describe()
    # Just above 1 the optimum is positive.
    s["psi0"] = 1.01 * K / lam
    assert scaffnew_optimal(**s).T > 0


def _t_star(**changes):
    return scaffnew_optimal(**{**SETTINGS["fast"], **changes}).T


def test_t_star_grows_with_epsilon_delta_and_psi0():
    for name, values in {"epsilon": [0.5, 1, 2, 4, 8], "delta": [1e-9, 1e-7, 1e-5, 1e-3, 0.1],
                         "psi0": [1e5, 1e6, 1e7, 1e8]}.items():
        ts = [_t_star(**{name: x}) for x in values]
        assert all(b > a for a, b in zip(ts, ts[1:])), (name, ts)
    # epsilon does not change the expected local steps 1/p*, only T* and the rounds p* T*.
    a, b = (scaffnew_optimal(**{**SETTINGS["fast"], "epsilon": e}) for e in (1.0, 4.0))
    assert a.expected_local_steps == b.expected_local_steps and b.expected_rounds > a.expected_rounds


def test_t_star_shrinks_with_n_d_c_and_v():
    """More clients shorten the run at a fixed psi0 (the noise sits on N d coordinates)."""
    for name, values in {"N": [1, 2, 10, 50], "d": [10, 100, 1000], "C": [0.25, 0.5, 1, 2],
                         "v": [0.5, 1, 2, 4]}.items():
        ts = [_t_star(**{name: x}) for x in values]
        assert all(b < a for a, b in zip(ts, ts[1:])), (name, ts)


def test_t_star_does_not_depend_on_n_when_psi0_scales_with_n():
    """Common start and h_0 = h*: psi0 = N ||x_0 - x*||^2, and N cancels in Corollary 1."""
    s = SETTINGS["fast"]
    eta, p = 1 / s["L"], math.sqrt(s["mu"] / s["L"])
    ts = [_t_star(N=n, psi0=initial_lyapunov(eta, p, n * 1e5, 0.0)) for n in (1, 3, 10, 100)]
    assert max(ts) - min(ts) < 1e-9 * max(ts) and ts[0] > 0


def test_initial_lyapunov_weights_the_control_variates_by_eta_over_p_squared():
    mu, L = 0.1, 1.0
    assert initial_lyapunov(1 / L, math.sqrt(mu / L), 2.0, 3.0) == pytest.approx(2.0 + 3.0 / (mu * L))
    assert initial_lyapunov(0.5, 0.25, 1.0, 1.0) == pytest.approx(1.0 + 4.0)


GOOD = SETTINGS["fast"]
BAD = [
    ("mu", 0.0), ("mu", -1.0), ("mu", math.nan),
    ("L", 0.1), ("L", 0.05), ("L", math.inf),
    ("epsilon", 0.0), ("epsilon", -1.0), ("epsilon", math.inf),
    ("delta", 0.0), ("delta", 1.0), ("delta", 2.0),
    ("C", 0.0), ("C", -0.5),
    ("N", 0), ("N", 2.5), ("N", True),
    ("d", 0), ("d", 10.0),
    ("psi0", 0.0), ("psi0", -1.0),
    ("v", 0.0), ("v", "1"),
]


@pytest.mark.parametrize("name,value", BAD)
def test_bad_input_names_the_argument(name, value):
    with pytest.raises(ConfigError) as err:
        scaffnew_optimal(**{**GOOD, name: value})
    assert err.value.setting == name
    message = str(err.value)
    assert message.startswith(f"{name}=") and "Fix:" in message and "\n" not in message


@pytest.mark.parametrize("name,value", [("eta", 0.0), ("eta", 1.5), ("p", 0.0), ("p", 1.2), ("T", -1.0),
                                        ("T", math.inf)])
def test_bound_rejects_parameters_outside_theorem_1(name, value):
    args = {"eta": 1.0, "p": 0.3, "T": 10.0, name: value}
    with pytest.raises(ConfigError) as err:
        scaffnew_bound(args["eta"], args["p"], args["T"], **GOOD)
    assert err.value.setting == name


def test_describe_prints_the_values_in_one_block():
    opt = scaffnew_optimal(**SETTINGS["fast"])
    assert isinstance(opt, ScaffNewOptimum)
    text = str(opt)
    assert text == opt.describe()
    for value in (f"{opt.T:.6g}", f"{opt.p:.6g}", f"{opt.expected_local_steps:.6g}", f"{opt.expected_rounds:.6g}",
                  f"{opt.bound:.6g}", f"{opt.sigma:.6g}", f"best integer: {opt.T_integer}"):
        assert value in text
    with pytest.raises(AttributeError):
        opt.T = 3.0  # frozen
