"""Paper 001's accountant (DP-SCAFFOLD / DP-FedAvg), next to modern ``dp_accounting`` accountants.

Paper 001: M. Noble, A. Bellet, A. Dieuleveut, "Differentially Private Federated Learning on
Heterogeneous Data", AISTATS 2022 (HAL hal-03905078). Setting (Sec. 3, Alg. 1): each round the
server samples ``m = floor(l M)`` of the ``M`` users without replacement; each sampled user runs
``K`` local steps, each on ``floor(s R)`` of its ``R`` records sampled without replacement, clips
per-record gradients at ``C`` and adds ``(2C / sR) N(0, sigma_g^2)`` to the mini-batch mean
gradient. Neighbouring datasets differ in one record (replace-one, Sec. 3.2), so the mean has
sensitivity ``S = 2C / sR`` and a user's noise is ``sigma_g`` times it: noise multiplier
``sigma_g`` per user (App. B.4: "calibration is made with constant S", so the accountant analyses a
sensitivity-1 query with noise std ``sigma_g``). Two caveats we do not model, both outside the
accountant that produced Table 1: the authors' released training code draws noise with std
``sigma_g C / sR``, half of Alg. 1's, i.e. multiplier ``sigma_g / 2`` under replace-one; and ``C``
is set to the median of the batch's gradient norms (App. D.1, a leak the paper neglects).

**The paper's accountant** (:func:`paper_epsilon`, App. B "Implementation." paragraph, towards a
third party that sees the global models only):

- Noise: the third party sees the average of ``m`` users' noisy gradients, whose noise has std
  ``S sigma_g / sqrt(m)`` against a sensitivity ``S / m``; so the Gaussian mechanism analysed has
  noise multiplier ``z = sigma_g sqrt(m)`` (App. B.4 Step 1: ``eps''(alpha, l M sigma_g^2)``).
  This counts the other users' noise as hiding the target user's gradient; it is exact for one
  local step of a linear aggregate and the paper's assumption for ``K > 1``.
- Step 1 (data sampling): Lemma B.7 (Wang, Balle, Kasiviswanathan 2019, Thm. 9 with the Gaussian's
  ``eps(j) = j / 2z^2`` and ``eps(inf) = inf``) at ratio ``q = floor(sR)/R`` and integer orders,
  times ``K`` (Lemma B.5): the per-round RDP ``eps_r(j)``.
- Step 2 (user sampling): the same general theorem (Thm. 9, not restricted to Gaussians) applied
  to ``eps_r`` with ratio ``floor(lM)/M``; ``eps_r(inf) = inf`` (composed Gaussians), so every
  ``min{2, (e^{eps(inf)} - 1)^j}`` factor is 2. Times ``T`` (Lemma B.5).
- Real orders via Eq. (7)/(8) (linear interpolation of the CGF ``(alpha - 1) eps(alpha)``, with
  CGF(1) = 0); conversion by Eq. (5), ``eps = min_alpha eps_RDP(alpha) + log(1/delta)/(alpha - 1)``
  (Mironov 2017, Prop. 3; written with ``lambda = alpha - 1``).
- Grid: the paper searches a fine grid of real ``alpha``. On each ``[n, n+1]`` the interpolated CGF
  is affine, so ``(CGF + log(1/delta)) / (alpha - 1)`` is a linear-fractional, hence monotone,
  function of ``alpha``, and on ``(1, 2]`` it is ``eps(2) + log(1/delta)/(alpha - 1)``, decreasing:
  the infimum over real ``alpha`` in ``(1, 256]`` is attained at an integer. We minimise over the
  integer orders ``2..256``: that infimum, which any finer real grid only approaches from above.
  The authors' script uses orders ``2..100`` and then a fine real grid around the best integer;
  the extra orders matter only when the best order exceeds 100 (a handful of rounds), where ours
  is the smaller, still valid, bound.

This reproduces Table 1 (= Table 4) of the paper exactly for sigma_g = 10, 20, 40, 80 and all K.
For sigma_g = 160 it gives T = 546, 507, 459, 363, 87 against the printed 546, 506, 458, 362, 87:
at T + 1 our epsilon is 2.99993, 2.99956, 2.99985 (K = 5, 10, 20), below 3 by < 5e-4, and the
procedure of the authors' released script (``get_epsilon_bound.py``: orders 2..100, then 1000 real
orders around the best integer) gives the same T. The printed sigma_g = 160 row repeats the
sigma_g = 80 row exactly, so it was most likely copied rather than computed: the variants we
tried (the authors' real grid, epsilon rounded to 4 decimals, delta with R = 5000) either change
nothing or break the other 20 cells.

Why T hardly depends on sigma_g: the general bound keeps, for ``j >= 3``, terms
``2 q^j binom(alpha, j) e^{(j-1) eps(j)}`` whose factor ``min{2, (e^{eps(inf)} - 1)^j} = 2`` does
not vanish with the noise, so as ``sigma_g -> inf`` Step 1 tends to
``K/(alpha-1) log(1 + 2 sum_{j>=3} s^j binom(alpha, j))`` and Step 2 to a positive floor as well
(App. D.3.2 of the paper says so). With l = 0.05, s = 0.2 these floors, not the noise, set T:
sigma_g -> inf gives T = 546, 507, 459, 363, 87.

**Modern accountants** (:func:`modern_epsilon`), built from ``dp_accounting`` (RDP of the
sampled-without-replacement Gaussian, Wang et al. Thm. 27, and the improved RDP-to-DP conversion
of Canonne, Kamath, Steinke 2020, over ``DEFAULT_RDP_ORDERS``):

- ``method="record"``: ``RdpAccountant(REPLACE_ONE)`` over ``SelfComposedDpEvent(
  SampledWithoutReplacementDpEvent(R, floor(sR), GaussianDpEvent(z)), K T)``: DP-SGD on the
  user's records as if the user took part in every round; no amplification by user sampling.
- ``method="participation"``: the tightest valid use of user sampling we can build from
  ``dp_accounting`` pieces. ``dp_accounting`` cannot express two-level sampling (its sampled
  events only accept Gaussian sub-events; PLD/PRV do not support sampling without replacement),
  so amplification by *hidden* user sampling (the paper's Step 2) is not available. Instead the
  user sample ``C_t`` is treated as revealed (data-independent): for a revealed label the Renyi
  divergence of the pair is exactly ``1/(a-1) log E_c exp((a-1) D_a(P_c || Q_c))``, so a round is
  ``1/(a-1) log(1 - q_u + q_u exp((a-1) K rho(a)))``-RDP, ``rho`` = dp_accounting's per-step RDP,
  ``q_u = floor(lM)/M``; composed ``T`` times and converted by dp_accounting. Valid also towards
  the honest-but-curious server (who knows ``C_t``) with ``noise_view="client"``.
- ``noise_view="client"`` (default): ``z = sigma_g``, what one user's update carries; no trust in
  other users' noise. ``noise_view="aggregate"``: ``z = sigma_g sqrt(m)``, the paper's
  third-party assumption, for a like-for-like comparison of the accounting alone.

**Which is tighter** (Table 1 setting; ``benchmarks/paper001_table1.py`` prints every cell).
Neither uniformly. The paper's accountant gains twice - amplification by *hidden* user sampling
(order ``l^2`` at low orders) and, as an assumption, the ``sqrt(lM)`` noise of the aggregate - and
loses twice: the general Thm. 9 with its noise-independent ``2 q^j`` terms at both steps (the
floor above) instead of the Gaussian-specific Thm. 27, and Mironov's conversion instead of the
improved one.
At sigma_g = 10 its T (542 at K = 1) is already within 1% of its sigma_g -> inf limit (546): the
floor, not the noise, binds, so its T saturates while the modern accountants' T grows like
sigma_g^2.

- vs ``record``/``client`` (no user sampling, no trust in other users' noise): the paper allows
  more rounds at sigma_g = 10 (all K; 542 vs 235 at K = 1), at sigma_g = 20 for K >= 5 and at
  sigma_g = 40 for K = 10, 20; ``record`` allows more everywhere else (15745 vs 546 at
  sigma_g = 80, K = 1). Where the paper wins, it is by amplification by user sampling and the
  aggregate noise, which this accountant does not use.
- vs ``participation``/``client``: more rounds than the paper everywhere except sigma_g = 10 with
  K >= 10 (381, 159, 58 vs 428, 324, 72), while also holding towards the server.
- Like for like (``noise_view="aggregate"``): ``participation`` allows more rounds than the paper
  in every cell, 3.4 times (sigma_g = 10, K = 20) to 11600 times (sigma_g = 160, K = 1) more;
  ``record`` alone, ignoring user sampling, already allows more except at sigma_g = 10 with
  K >= 5 and sigma_g = 20 with K = 20.
"""

from __future__ import annotations

import math
from functools import lru_cache

import dp_accounting
import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS, compute_epsilon
from scipy import special

from dpfl_lightning.errors import require
from dpfl_lightning.privacy.accountants import GaussianRelease, rdp_curve
from dpfl_lightning.privacy.calibrate import largest_within

MAX_ORDER = 256  # integer RDP orders 2..MAX_ORDER (the authors' script: 2..100)
T_CAP = 10**9  # max_rounds never searches past this
MODERN_METHODS = ("record", "participation")
NOISE_VIEWS = ("client", "aggregate")

# Table 1 of the paper (Table 4 prints the same T): largest T for epsilon = 3, l = 0.05, s = 0.2,
# M = 100, R = 4000 (80% of 5000), delta = 1 / (M R). {sigma_g: {K: T}}.
TABLE1_SETTING = {"target_epsilon": 3.0, "l": 0.05, "s": 0.2, "R": 4000, "M": 100}
TABLE1_T = {
    10.0: {1: 542, 5: 488, 10: 428, 20: 324, 40: 72},
    20.0: {1: 545, 5: 502, 10: 451, 20: 352, 40: 83},
    40.0: {1: 546, 5: 505, 10: 457, 20: 360, 40: 86},
    80.0: {1: 546, 5: 506, 10: 458, 20: 362, 40: 87},
    160.0: {1: 546, 5: 506, 10: 458, 20: 362, 40: 87},
}


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------
def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_run(sigma_g: float, K: int, l: float, s: float, R: int, M: int) -> None:
    require(isinstance(sigma_g, (int, float)) and math.isfinite(sigma_g) and sigma_g > 0, "sigma_g", sigma_g,
            "must be a finite number > 0", "use the paper's noise scale, e.g. 10.0")
    require(_is_int(K) and K >= 1, "K", K, "must be an integer >= 1", "give the number of local steps per round")
    require(_is_int(R) and R >= 1, "R", R, "must be an integer >= 1", "give the training records per user")
    require(_is_int(M) and M >= 1, "M", M, "must be an integer >= 1", "give the number of users")
    require(isinstance(l, (int, float)) and 0 < l <= 1 and _count(l, M) >= 1, "l", l,
            "must be in (0, 1] with floor(l * M) >= 1", "sample at least one user per round")
    require(isinstance(s, (int, float)) and 0 < s <= 1 and _count(s, R) >= 1, "s", s,
            "must be in (0, 1] with floor(s * R) >= 1", "sample at least one record per step")


def _check_rounds(T: int) -> None:
    require(_is_int(T) and T >= 0, "T", T, "must be an integer >= 0", "count communication rounds from 0")


def _resolve_delta(delta: float | None, R: int, M: int) -> float:
    """``delta``, or the paper's choice ``1 / (M R)`` when it is None."""
    if delta is None:
        return 1.0 / (M * R)
    require(isinstance(delta, (int, float)) and 0 < delta < 1, "delta", delta, "must be in (0, 1)",
            "use delta < 1 / (M R), e.g. the paper's 1 / (M R)")
    return float(delta)


def _check_target(target_epsilon: float) -> None:
    require(isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0,
            "target_epsilon", target_epsilon, "must be a finite number > 0", "set a positive epsilon, e.g. 3.0")


def _count(ratio: float, n: int) -> int:
    """``floor(ratio * n)``, as Alg. 1 sizes its samples; robust to ``0.29 * 100 = 28.999...``."""
    return math.floor(ratio * n + 1e-9)


def _counts(l: float, s: float, R: int, M: int) -> tuple[int, int]:
    """Users per round ``floor(lM)`` and records per step ``floor(sR)``."""
    return _count(l, M), _count(s, R)


# ---------------------------------------------------------------------------------------------
# The paper's accountant
# ---------------------------------------------------------------------------------------------
def _log_comb(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def wang_general_cgf(base_rdp: np.ndarray, q: float) -> np.ndarray:
    """Wang, Balle, Kasiviswanathan (2019), Thm. 9, for a base mechanism with ``eps(inf) = inf``.

    ``base_rdp[j]`` is the base mechanism's RDP at integer order ``j`` (entries 0 and 1 unused).
    Returns ``cgf`` with ``cgf[a] = (a - 1) * eps_q(a)`` for ``a = 2..len - 1`` (0 at ``a < 2``),
    where ``eps_q`` bounds the RDP of the mechanism on a ``q``-fraction sampled without replacement:

        (a-1) eps_q(a) <= log(1 + q^2 C(a,2) min{4(e^{eps(2)} - 1), 2 e^{eps(2)}}
                              + sum_{j=3}^{a} 2 q^j C(a,j) e^{(j-1) eps(j)}).

    This is the paper's Lemma B.7 when the base is a Gaussian. ``q = 1`` (no sampling) returns the
    base CGF itself.
    """
    n = len(base_rdp) - 1
    orders = np.arange(n + 1, dtype=np.float64)
    cgf = np.zeros(n + 1)
    if q >= 1:
        cgf[2:] = (orders[2:] - 1) * base_rdp[2:]
        return cgf
    a = orders[2:, None]
    j = orders[None, 3:]
    e2 = float(base_rdp[2])
    # log min{4 (e^{eps(2)} - 1), 2 e^{eps(2)}}; -inf when eps(2) = 0
    log_min2 = -math.inf if e2 <= 0 else min(math.log(4) + e2 + math.log(-math.expm1(-e2)), math.log(2) + e2)
    term2 = 2 * math.log(q) + _log_comb(a, 2.0) + log_min2
    termj = math.log(2) + j * math.log(q) + _log_comb(a, np.minimum(j, a)) + (j - 1) * base_rdp[None, 3:]
    termj = np.where(j <= a, termj, -np.inf)
    cgf[2:] = special.logsumexp(np.concatenate([np.zeros_like(a), term2, termj], axis=1), axis=1)
    return cgf


def paper_noise_multiplier(sigma_g: float, l: float, M: int) -> float:
    """Noise multiplier of the aggregate the paper analyses: ``sigma_g * sqrt(floor(lM))``."""
    return sigma_g * math.sqrt(_count(l, M))


@lru_cache(maxsize=512)
def _paper_round_cgf(z: float, K: int, q_data: float, q_user: float, max_order: int) -> np.ndarray:
    """CGF bound of one round (Steps 1 and 2) at integer orders ``0..max_order`` (read-only)."""
    orders = np.arange(max_order + 1, dtype=np.float64)
    gaussian = orders / (2 * z * z)  # Lemma B.6: eps(j) = j / (2 z^2)
    step1 = wang_general_cgf(gaussian, q_data)  # Lemma B.7, one s-subsampled Gaussian
    round_rdp = np.zeros(max_order + 1)
    round_rdp[2:] = K * step1[2:] / (orders[2:] - 1)  # Lemma B.5 over K local steps
    cgf = wang_general_cgf(round_rdp, q_user)  # Step 2: l-subsampled round, eps_r(inf) = inf
    cgf.flags.writeable = False
    return cgf


def _paper_inputs(sigma_g: float, K: int, l: float, s: float, R: int, M: int) -> tuple[float, int, float, float]:
    m_users, m_records = _counts(l, s, R, M)
    return paper_noise_multiplier(sigma_g, l, M), int(K), m_records / R, m_users / M


def paper_rdp(alpha: float | np.ndarray, sigma_g: float, K: int, T: int, l: float, s: float, R: int, M: int,
              max_order: int = MAX_ORDER) -> np.ndarray:
    """The paper's RDP bound after ``T`` rounds at real orders ``1 < alpha <= max_order``.

    Integer orders from Steps 1-2; real orders by Eq. (7) (equivalently Eq. (8)): the CGF
    ``(alpha - 1) eps(alpha)`` is interpolated linearly between consecutive integers, with CGF(1) = 0.
    """
    _check_run(sigma_g, K, l, s, R, M)
    _check_rounds(T)
    alpha = np.asarray(alpha, dtype=np.float64)
    require(alpha.size > 0 and bool(np.all((alpha > 1) & (alpha <= max_order))), "alpha",
            f"[{alpha.min(initial=np.inf)}, {alpha.max(initial=-np.inf)}]", f"must be in (1, {max_order}]",
            f"use RDP orders in (1, {max_order}]")
    cgf = T * _paper_round_cgf(*_paper_inputs(sigma_g, K, l, s, R, M), max_order)
    lo = np.floor(alpha).astype(int)
    hi = np.ceil(alpha).astype(int)
    frac = alpha - lo
    return ((1 - frac) * cgf[lo] + frac * cgf[hi]) / (alpha - 1)


def paper_epsilon(sigma_g: float, K: int, T: int, l: float, s: float, R: int, M: int,
                  delta: float | None = None) -> float:
    """Epsilon towards a third party after ``T`` rounds of DP-SCAFFOLD / DP-FedAvg, by paper 001's
    method (App. B.4, "Implementation."; see the module docstring for every step and assumption).

    ``sigma_g``: noise std in units of the replace-one sensitivity ``2C/sR`` of one user's mean
    gradient; ``K`` local steps per round; ``l``, ``s``: user and data sampling ratios (Alg. 1 takes
    ``floor(lM)`` users and ``floor(sR)`` records); ``R`` records per user; ``M`` users; ``delta``
    defaults to the paper's ``1 / (M R)``. Returns the minimum over integer ``2 <= alpha <= 256`` of
    ``(T * CGF_round(alpha) + log(1/delta)) / (alpha - 1)`` (Eq. (5)), which equals the infimum
    over real ``alpha`` in ``(1, 256]`` of the Eq. (7)-interpolated bound. ~3 ms the first time for
    given ``(sigma_g, K, l, s, R, M)`` (Steps 1-2), microseconds after (cached per-round curve).
    """
    _check_run(sigma_g, K, l, s, R, M)
    _check_rounds(T)
    delta = _resolve_delta(delta, R, M)
    if T == 0:
        return 0.0
    cgf = _paper_round_cgf(*_paper_inputs(sigma_g, K, l, s, R, M), MAX_ORDER)
    return float(np.min((T * cgf[2:] - math.log(delta)) / np.arange(1, MAX_ORDER, dtype=np.float64)))


# ---------------------------------------------------------------------------------------------
# Largest T under a target
# ---------------------------------------------------------------------------------------------
def max_rounds(target_epsilon: float, sigma_g: float, K: int, l: float, s: float, R: int, M: int,
               delta: float | None = None) -> int:
    """Largest ``T`` with :func:`paper_epsilon` ``<= target_epsilon`` (0 if even one round exceeds it).

    This is how the paper fills Table 1 ("the maximal value of T such that the privacy bound is
    still maintained after T communication rounds"). Epsilon is non-decreasing in ``T`` (a minimum
    over orders of functions increasing in ``T``), so the bracketed bisection is exact.
    """
    _check_target(target_epsilon)
    _check_run(sigma_g, K, l, s, R, M)
    delta = _resolve_delta(delta, R, M)
    return largest_within(lambda t: paper_epsilon(sigma_g, K, t, l, s, R, M, delta), target_epsilon, T_CAP)


# ---------------------------------------------------------------------------------------------
# Modern accountants (dp_accounting)
# ---------------------------------------------------------------------------------------------
def modern_noise_multiplier(sigma_g: float, l: float, M: int, noise_view: str = "client") -> float:
    """``sigma_g`` (``client``: one user's update) or ``sigma_g sqrt(floor(lM))`` (``aggregate``:
    the paper's third-party view, trusting the other sampled users' noise)."""
    require(noise_view in NOISE_VIEWS, "noise_view", noise_view, "unknown noise view", f"use one of {NOISE_VIEWS}")
    return float(sigma_g) if noise_view == "client" else paper_noise_multiplier(sigma_g, l, M)


def modern_event(z: float, K: int, T: int, s: float, R: int) -> dp_accounting.DpEvent:
    """``SelfComposedDpEvent(SampledWithoutReplacementDpEvent(R, floor(sR), GaussianDpEvent(z)), K T)``:
    ``K T`` DP-SGD steps on one user's ``R`` records, for ``RdpAccountant(REPLACE_ONE)``."""
    step = dp_accounting.SampledWithoutReplacementDpEvent(R, _count(s, R), dp_accounting.GaussianDpEvent(z))
    return dp_accounting.SelfComposedDpEvent(step, K * T)


def _step_rdp(z: float, s: float, R: int) -> np.ndarray:
    """dp_accounting's RDP (``DEFAULT_RDP_ORDERS``) of one step: the same number ``RdpAccountant``
    adds for the event of :func:`modern_event` with count 1 (cached by ``accountants.rdp_curve``)."""
    return rdp_curve(GaussianRelease(z, "without_replacement", relation="replace_one", population=R,
                                     sample_size=_count(s, R)))


def _participation_round_rdp(step_rdp: np.ndarray, K: int, q_user: float) -> np.ndarray:
    """RDP of one round whose user sample is revealed: with probability ``q_user`` the user takes
    part (``K`` steps), else the round does not touch its data. For a revealed data-independent
    label ``c``, ``exp((a-1) D_a) = E_c exp((a-1) D_a(P_c || Q_c))`` exactly."""
    orders = np.asarray(DEFAULT_RDP_ORDERS, dtype=np.float64)
    if q_user >= 1:
        return K * step_rdp
    x = (orders - 1) * K * step_rdp
    return np.logaddexp(math.log1p(-q_user), math.log(q_user) + x) / (orders - 1)


def modern_epsilon(sigma_g: float, K: int, T: int, l: float, s: float, R: int, M: int, delta: float | None = None,
                   method: str = "record", noise_view: str = "client") -> float:
    """Epsilon after ``T`` rounds from ``dp_accounting`` (module docstring, "Modern accountants").

    ``method="record"`` equals ``RdpAccountant(REPLACE_ONE).compose(modern_event(...)).get_epsilon``
    exactly (same per-step RDP times ``K T``, same orders, same conversion); ``"participation"``
    composes ``T`` revealed-participation rounds with user ratio ``floor(lM)/M``.
    """
    _check_run(sigma_g, K, l, s, R, M)
    _check_rounds(T)
    delta = _resolve_delta(delta, R, M)
    require(method in MODERN_METHODS, "method", method, "unknown modern accountant", f"use one of {MODERN_METHODS}")
    z = modern_noise_multiplier(sigma_g, l, M, noise_view)
    if T == 0:
        return 0.0
    step = _step_rdp(z, s, R)
    if method == "record":
        rdp = (K * T) * step
    else:
        rdp = T * _participation_round_rdp(step, K, _count(l, M) / M)
    return float(compute_epsilon(DEFAULT_RDP_ORDERS, rdp, delta)[0])


def modern_max_rounds(target_epsilon: float, sigma_g: float, K: int, l: float, s: float, R: int, M: int,
                      delta: float | None = None, method: str = "record", noise_view: str = "client") -> int:
    """Largest ``T`` with :func:`modern_epsilon` ``<= target_epsilon`` (capped at ``T_CAP``)."""
    _check_target(target_epsilon)
    _check_run(sigma_g, K, l, s, R, M)
    delta = _resolve_delta(delta, R, M)
    require(method in MODERN_METHODS, "method", method, "unknown modern accountant", f"use one of {MODERN_METHODS}")
    modern_noise_multiplier(sigma_g, l, M, noise_view)  # validates noise_view
    return largest_within(lambda t: modern_epsilon(sigma_g, K, t, l, s, R, M, delta, method, noise_view),
                          target_epsilon, T_CAP)
