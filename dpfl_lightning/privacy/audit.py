"""Empirical privacy: estimates and lower bounds on epsilon from canary scores.

A *canary* is a client whose update is a fixed random direction (see
:class:`~dpfl_lightning.plugins.canary.CanaryClients`); its *score* is how much a released model
leans towards that direction (a cosine). Canaries that took part score higher than canaries that did
not, by as much as the noise lets them. Three ways to turn scores into epsilon:

- :func:`gaussian_fit_estimate` -- Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot
  Empirical Privacy Estimation for Federated Learning" (ICLR 2024), Sec. 3-4: fit a Gaussian to the
  scores of the inserted canaries and one to those of canaries never inserted, and report the
  epsilon at ``delta`` of the mechanism that distinguishes the two Gaussians. An *estimate* (exact
  for the Gaussian mechanism in high dimension), not a bound; with a bootstrap interval.
- :func:`gaussian_fit_lower_bound` -- the fit's epsilon from below, valid at any sample size for
  Gaussian scores; :func:`suspect_lower_bound` -- the ``suspect`` verdict of ``dpfl audit``: that
  bound, or with enough canaries on each side the bootstrap's lower end, whichever is higher.
- :func:`fit_assumption_fails` -- where the *suspect* verdict may not rest on the Gaussian fit: the
  fit models the scores of an additive Gaussian mechanism with noise independent across rounds.
- :func:`one_run_lower_bound` -- Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training
  Run" (NeurIPS 2023), Thm. 3.1 with the ``delta`` term of Sec. 5 (Thm. 5.2): each of ``m`` canaries
  is inserted with probability 1/2; the auditor guesses "in" for the top scores and "out" for the
  bottom ones; if the run is (eps, delta)-DP the number ``W`` of correct guesses among ``r`` obeys
  ``P[W >= v] <= P[Bin(r, q) >= v] + 2 m delta max_i P[v - i <= Bin(r, q) < v] / i`` with
  ``q = e^eps / (1 + e^eps)``. Every eps whose tail is below ``1 - confidence`` is refuted: a
  lower bound, valid at that confidence.
- :func:`many_run_lower_bound` -- the classic audit (Jagielski, Ullman, Oprea 2020; Nasr et al.
  2021): ``N`` runs with the canary in and ``N`` without; a threshold chosen on one half of the
  runs; Clopper-Pearson upper bounds on the false positive and negative rates on the other half;
  ``eps >= log((1 - delta - FNR) / FPR)`` and ``log((1 - delta - FPR) / FNR)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from dpfl_lightning.errors import require

_EPS_CAP = 512.0  # a one-run bound above this is reported as inf


@dataclass(frozen=True)
class Estimate:
    """An epsilon estimate with its interval at ``confidence``."""

    epsilon: float
    low: float
    high: float
    confidence: float


@dataclass(frozen=True)
class LowerBound:
    """An epsilon lower bound valid with probability ``confidence``, and how it was reached."""

    epsilon: float
    confidence: float
    guesses: int = 0
    correct: int = 0


# --------------------------------------------------------------------------- Gaussian fit
def gaussian_delta(eps: float, mu: float) -> float:
    """``delta(eps)`` of the Gaussian mechanism with sensitivity / std ``mu`` (mu-GDP):
    ``Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)`` (Balle & Wang 2018, Thm. 8), the second term
    in log space."""
    if mu <= 0:
        return 0.0
    first = scipy.special.ndtr(mu / 2 - eps / mu)
    return max(0.0, float(first - math.exp(eps + scipy.special.log_ndtr(-mu / 2 - eps / mu))))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest ``eps >= 0`` at which the ``mu``-GDP Gaussian mechanism is (eps, delta)-DP."""
    mu = abs(float(mu))
    if math.isnan(mu):  # identical scores on both sides: nothing tells them apart
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_delta(hi, mu) > delta:
        hi *= 2
    return float(scipy.optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-9, rtol=1e-12))


def _separation(x1: np.ndarray, x0: np.ndarray, axis: int | None = None) -> np.ndarray:
    """``|mean1 - mean0| / s`` with ``s`` the pooled standard deviation of the two samples."""
    pooled = np.sqrt((np.var(x1, axis=axis, ddof=1) + np.var(x0, axis=axis, ddof=1)) / 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.mean(x1, axis=axis) - np.mean(x0, axis=axis)) / pooled


def gaussian_fit_estimate(inserted, unseen, delta: float, confidence: float = 0.95, resamples: int = 1000,
                          seed: int = 0) -> Estimate:
    """Andrew et al. (2024), Sec. 3-4: Gaussians fitted to the inserted and to the unseen canaries'
    scores, and the epsilon at ``delta`` of the Gaussian mechanism that tells them apart: with one
    pooled variance ``s^2``, ``mu = (mean_in - mean_unseen) / s``-GDP (signed: inserted canaries
    scoring no higher than unseen ones are no evidence of a leak, and the interval reaches 0 when the
    scores do not separate). The interval maps the bootstrap percentile interval of ``mu`` (both
    samples resampled ``resamples`` times, clamped at 0) through the monotone ``mu -> eps``.

    Why one pooled variance: with a variance per sample, sampling noise in the variance ratio alone
    moves epsilon at a small delta (the likelihood ratio turns quadratic): at 50 + 50 canaries and a
    true 7.05 (mu = 1.5, delta = 1e-5) that fit gave a median of 10.5 over 60 draws and its percentile
    interval covered the truth in 60% of them; pooled: a median of 7.4 and 90% coverage."""
    x1, x0 = np.asarray(inserted, dtype=np.float64), np.asarray(unseen, dtype=np.float64)
    require(len(x1) >= 2 and len(x0) >= 2, "canaries", (len(x1), len(x0)),
            "the Gaussian fit needs at least 2 inserted and 2 unseen canaries", "use more canaries")
    point = gaussian_epsilon(max(float(_separation(x1, x0)), 0.0), delta)
    rng = np.random.default_rng(seed)
    b1 = x1[rng.integers(0, len(x1), (resamples, len(x1)))]
    b0 = x0[rng.integers(0, len(x0), (resamples, len(x0)))]
    alpha = 1.0 - confidence
    low, high = np.nanquantile(_separation(b1, b0, axis=1), [alpha / 2, 1 - alpha / 2])
    return Estimate(point, gaussian_epsilon(max(low, 0.0), delta), gaussian_epsilon(max(high, 0.0), delta), confidence)



def gaussian_fit_lower_bound(inserted, unseen, delta: float, confidence: float = 0.95) -> float:
    """A lower confidence bound on the Gaussian fit's epsilon, valid at ``confidence`` for any sample
    size when the scores are Gaussian with one common variance (the fit's own model), where the
    bootstrap interval of :func:`gaussian_fit_estimate` is not: with 4 + 6 canaries its lower end
    lay above the truth in about a quarter of draws. With ``a = (1 - confidence) / 2`` each,
    ``sigma <= s_up = s_p sqrt(df / chi2_{df}(a))`` (the pooled variance's chi-square) and
    ``mean_in - mean_unseen - Delta <= z_a sigma k`` (``k = sqrt(1/n1 + 1/n0)``), so
    ``mu = Delta / sigma >= (mean_in - mean_unseen) / s_up - z_a k``; its epsilon at ``delta``."""
    x1, x0 = np.asarray(inserted, dtype=np.float64), np.asarray(unseen, dtype=np.float64)
    require(len(x1) >= 2 and len(x0) >= 2, "canaries", (len(x1), len(x0)),
            "the Gaussian fit needs at least 2 inserted and 2 unseen canaries", "use more canaries")
    df = len(x1) + len(x0) - 2
    a = (1.0 - confidence) / 2
    pooled = math.sqrt(((len(x1) - 1) * np.var(x1, ddof=1) + (len(x0) - 1) * np.var(x0, ddof=1)) / df)
    s_up = pooled * math.sqrt(df / scipy.stats.chi2.ppf(a, df))
    k = math.sqrt(1 / len(x1) + 1 / len(x0))
    if s_up == 0:
        return math.inf if x1.mean() > x0.mean() else 0.0
    return gaussian_epsilon(max((x1.mean() - x0.mean()) / s_up - scipy.stats.norm.isf(a) * k, 0.0), delta)

#: canaries on each side from which the bootstrap's lower end joins the suspect bound: with 60 + 60
#: Gaussian scores (mu 0.5 - 3) its one-sided 1.25% end lay above the truth in 1.3-2% of 300 draws,
#: with 30 + 30 in up to 5.7%; at 4 + 6 in over 10% (the parametric bound is then the only one)
BOOTSTRAP_MIN = 50


def suspect_lower_bound(inserted, unseen, delta: float, confidence: float = 0.95, resamples: int = 2000,
                        seed: int = 0) -> float:
    """The lower confidence bound on the Gaussian fit's epsilon that ``dpfl audit``'s *suspect*
    verdict rests on: the larger of :func:`gaussian_fit_lower_bound` (valid at any sample size for
    equal-variance Gaussian scores) and, with at least :data:`BOOTSTRAP_MIN` canaries on each side,
    the lower end of the bootstrap percentile interval of the fit's ``mu`` at ``confidence``
    (quantile ``(1 - confidence) / 2``, as :func:`gaussian_fit_estimate` resamples it).

    Why both: real canary scores are not equal-variance Gaussians. Under Poisson sampling an inserted
    canary that was never sampled scores like an unseen one, so the inserted scores are a mixture
    (a spike above, a mass at the baseline) with a standard deviation many times the unseen ones'
    (a planted skipped clip: 0.24 against 0.011). The parametric bound's chi-square and normal
    margins, at the audit's Bonferroni level, then take ~0.4 off ``mu`` where the bootstrap, which
    resamples the scores as they are, takes ~0.25: with a ledger of 1.98 the fit read 3.57 [2.84,
    4.34] and the parametric bound 1.69, so a run leaking twice its ledger passed as consistent."""
    low = gaussian_fit_lower_bound(inserted, unseen, delta, confidence)
    x1, x0 = np.asarray(inserted, dtype=np.float64), np.asarray(unseen, dtype=np.float64)
    if min(len(x1), len(x0)) < BOOTSTRAP_MIN:
        return low
    rng = np.random.default_rng(seed)
    b1 = x1[rng.integers(0, len(x1), (resamples, len(x1)))]
    b0 = x0[rng.integers(0, len(x0), (resamples, len(x0)))]
    mu = float(np.nanquantile(_separation(b1, b0, axis=1), (1.0 - confidence) / 2))
    return max(low, gaussian_epsilon(max(mu, 0.0), delta))


def fit_assumption_fails(releases) -> str | None:
    """Why the Gaussian fit (Andrew et al. 2024) is no estimate of the privacy of ``releases`` (the
    :class:`~dpfl_lightning.privacy.accountants.Release` of each profile of a guarantee), or ``None``
    where it is: the fit reads epsilon off the separation ``mu`` of the scores as if they came from an
    additive Gaussian mechanism whose noise is fresh each round. That holds for Gaussian events
    (central, local or distributed) and for the discrete Gaussian / Skellam sums of
    :class:`~dpfl_lightning.privacy.discrete_accounting.DiscreteNoiseDpEvent` (near-Gaussian noise,
    accounted at or above the continuous Gaussian). It fails for:

    - a non-Gaussian release, such as a pure-DP local randomizer (PrivUnit and ScalarDP, Bhowmick et
      al. 2018): its likelihood ratio is bounded by ``e^eps``, yet its output can separate inserted and
      unseen canaries by many standard deviations (randomized response at eps 6 separates by ~20), and
      the Gaussian's tail at ``delta`` turns that separation into an epsilon no bounded-ratio mechanism
      has: ``configs/ldp_fedexp_privunit.yaml`` at 2 rounds read 20.5 [15.9, 27.4] on the messages
      against its pure-DP ledger of 12;
    - correlated noise (a matrix-factorization stream, DP-FTRL): the released models' noise is
      correlated across rounds, and on the shipped ``ftrl_*`` configs the fit read 1.5-2x the
      linear-Gaussian truth (4.78 [3.16, 7.04] against a ledger of 2.976 on ``ftrl_banded``), even with
      independent noise under cyclic participation.

    There the assumption-free f-DP test and the noise check still stand; the estimate is printed."""
    from dpfl_lightning.privacy.discrete_accounting import DiscreteNoiseDpEvent
    import dp_accounting

    for r in releases:
        if r.stream is not None:
            return "correlated noise (the fit overestimates its epsilon)"
        if not all(isinstance(e, (dp_accounting.GaussianDpEvent, DiscreteNoiseDpEvent)) for e in r.events):
            return "a non-Gaussian release (no Gaussian fit estimates a pure-DP randomizer)"
    return None


# --------------------------------------------------------------------------- one run (Steinke et al.)
def _p_value_of(m: int, r: int, v: int, delta: float):
    """``eps -> p-value`` for ``v`` correct guesses out of ``r`` with ``m`` canaries (see
    :func:`one_run_p_value`), the binomial coefficients computed once."""
    k = np.arange(v - 1, -1, -1)  # P[Bin = v-1], P[Bin = v-2], ...
    log_choose = scipy.special.gammaln(r + 1) - scipy.special.gammaln(k + 1) - scipy.special.gammaln(r - k + 1)
    divisors = np.arange(1, v + 1)

    def p_value(eps: float) -> float:
        if v <= 0:
            return 1.0
        q = float(scipy.special.expit(eps))
        tail = float(scipy.special.betainc(v, r - v + 1, q))  # P[Bin(r, q) >= v]
        pmf = np.exp(log_choose + k * math.log(q) + (r - k) * math.log1p(-q))
        spread = float(np.max(np.cumsum(pmf) / divisors))  # max_i P[v-i <= Bin < v] / i
        return min(1.0, tail + 2.0 * m * delta * spread)

    return p_value


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The largest probability an (eps, delta)-DP run gives ``>= v`` correct guesses out of ``r``
    with ``m`` canaries: ``P[Bin(r, q) >= v] + 2 m delta max_i P[v-i <= Bin(r, q) < v] / i``,
    ``q = e^eps / (1 + e^eps)`` (Steinke et al. 2023, Thm. 3.1 and the delta term of Thm. 5.2)."""
    return _p_value_of(m, r, v, delta)(eps)


def _one_run_eps(m: int, r: int, v: int, delta: float, beta: float) -> float:
    """The largest eps whose p-value stays below ``beta`` (0 if even eps = 0 is not refuted)."""
    p_value = _p_value_of(m, r, v, delta)
    if p_value(0.0) >= beta:
        return 0.0
    hi = 1.0
    while p_value(hi) < beta and hi < _EPS_CAP:
        hi *= 2
    if hi >= _EPS_CAP:
        return math.inf
    return float(scipy.optimize.brentq(lambda e: p_value(e) - beta, 0.0, hi, xtol=1e-5))


#: fractions of the canaries guessed, top ("in") and bottom ("out") of the scores
GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5)


def one_run_lower_bound(scores, inserted, delta: float, confidence: float = 0.95) -> LowerBound:
    """Steinke et al. (2023): guess "in" for the ``k`` highest scores, and "out" for the ``k`` lowest
    or for none, for every ``k`` of :data:`GUESS_FRACTIONS`; the best bound, each tried at
    ``1 - (1 - confidence) / tries`` (Bonferroni), so the reported one holds at ``confidence``."""
    s, ins = np.asarray(scores, dtype=np.float64), np.asarray(inserted, dtype=bool)
    m = len(s)
    require(m >= 2 and len(ins) == m, "canaries", m, "the one-run bound needs at least 2 canaries", "use more canaries")
    order = np.argsort(-s, kind="stable")
    top_in, bottom_out = np.cumsum(ins[order]), np.cumsum(~ins[order[::-1]])
    ks = sorted({max(1, int(round(f * m))) for f in GUESS_FRACTIONS})
    tries = [(k, 0) for k in ks] + [(k, k) for k in ks if 2 * k <= m]
    beta = (1.0 - confidence) / len(tries)
    best = LowerBound(0.0, confidence)
    for k_in, k_out in tries:
        r = k_in + k_out
        v = int(top_in[k_in - 1]) + (int(bottom_out[k_out - 1]) if k_out else 0)
        eps = _one_run_eps(m, r, v, delta, beta)
        if eps > best.epsilon:
            best = LowerBound(eps, confidence, r, v)
    return best


# --------------------------------------------------------------------------- many runs
def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """The one-sided ``1 - alpha`` Clopper-Pearson upper bound on a rate with ``k`` successes in
    ``n`` trials: the ``p`` with ``P[Bin(n, p) <= k] = alpha`` (1 when ``k == n``)."""
    require(0 <= k <= n and n >= 1, "Clopper-Pearson", (k, n), "needs 0 <= k <= n and n >= 1", "count the trials")
    if k == n:
        return 1.0
    return float(scipy.optimize.brentq(lambda p: scipy.stats.binom.cdf(k, n, p) - alpha, k / n, 1.0, xtol=1e-14))


def epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    """``max(log((1 - delta - FNR) / FPR), log((1 - delta - FPR) / FNR), 0)``: what an
    (eps, delta)-DP mechanism's error rates must satisfy (Kairouz et al. 2015)."""
    out = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        if 1 - delta - a > 0:
            out = max(out, math.inf if b <= 0 else math.log((1 - delta - a) / b))
    return out


def _threshold(ins: np.ndarray, outs: np.ndarray, delta: float, alpha: float) -> float:
    """The threshold ("in" when the score is >= it) with the best bound on these runs, among the
    midpoints between consecutive distinct scores."""
    u = np.unique(np.concatenate([ins, outs]))
    best, best_t = -1.0, math.inf
    for t in np.concatenate([(u[:-1] + u[1:]) / 2, u[-1:]]):
        fp, fn = int((outs >= t).sum()), int((ins < t).sum())
        eps = epsilon_from_rates(clopper_pearson_upper(fp, len(outs), alpha / 2),
                                 clopper_pearson_upper(fn, len(ins), alpha / 2), delta)
        if eps > best:
            best, best_t = eps, float(t)
    return best_t


def many_run_lower_bound(in_scores, out_scores, delta: float, confidence: float = 0.95) -> LowerBound:
    """Runs with the canary in and without: a threshold chosen on the first half of each, then
    Clopper-Pearson bounds (each at ``1 - (1 - confidence) / 2``) on the other half."""
    ins, outs = np.asarray(in_scores, dtype=np.float64), np.asarray(out_scores, dtype=np.float64)
    require(len(ins) >= 4 and len(outs) >= 4, "--trials", (len(ins), len(outs)),
            "the many-run bound needs at least 4 runs per world (2 to choose the threshold, 2 to test it)",
            "set --trials 4 or more")
    hi, ho = len(ins) // 2, len(outs) // 2
    alpha = 1.0 - confidence
    t = _threshold(ins[:hi], outs[:ho], delta, alpha)
    test_in, test_out = ins[hi:], outs[ho:]
    fp, fn = int((test_out >= t).sum()), int((test_in < t).sum())
    fpr = clopper_pearson_upper(fp, len(test_out), alpha / 2)
    fnr = clopper_pearson_upper(fn, len(test_in), alpha / 2)
    correct = (len(test_out) - fp) + (len(test_in) - fn)
    return LowerBound(epsilon_from_rates(fpr, fnr, delta), confidence, len(test_in) + len(test_out), correct)
