"""One-run f-DP audits: tests of a privacy curve, and Gaussian-DP lower bounds, from canary scores.

Mahloujifar, Melis, Chaudhuri, "Auditing f-Differential Privacy in One Run" (ICML 2025,
arXiv:2410.22235), Sec. 4-5. The game is the one of Steinke, Nasr and Jagielski (2023): each of ``m``
canaries is inserted with probability 1/2, the auditor guesses "in" or "out" for ``c'`` of them
(here: "in" for the ``k`` highest scores, "out" for the ``k`` lowest) and ``c`` of its
guesses are right. If the run is ``f``-DP towards each canary (``f`` a symmetric trade-off curve:
the smallest type-II error of a test of "in" against "out" at type-I error ``alpha``), the paper
bounds the probability of ``>= c`` right guesses by a recursion over the count of right guesses:
with ``r_i`` / ``h_i`` the per-canary probability of a right / wrong guess together with the event
"``i`` or more right",

    r_c = tau c / m,   h_c = tau (c' - c) / m,
    h_i = max(h_{i+1}, f(1 - r_{i+1})),   r_i = r_{i+1} + i / (c' - i) (h_i - h_{i+1}),

and ``P[>= c right] >= tau`` is impossible when ``r_0 + h_0 > c' / m`` (every canary is guessed
with probability ``c' / m`` in all). :func:`fdp_rejects` runs it; the ``f``-DP hypothesis is refuted
at level ``tau`` when it returns True.

What it is used for here:

- :func:`curve_rejected` -- the verdict. ``f`` is the ledger's own curve, built from its epsilon at
  many deltas (:func:`profile_tradeoff`: the trade-off curve of "(eps_j, delta_j)-DP for every j",
  a lower envelope of the ledger's true curve, so the test is conservative). A rejection says the
  run is not what the ledger states, at every delta at once, with no assumption on the shape of
  the mechanism: a statistically valid refutation at ``1 - tau``.
- :func:`gdp_lower_bound` -- the number. The largest ``mu`` for which ``mu``-Gaussian DP is refuted,
  and the epsilon of ``mu``-GDP at the ledger's delta (the empirical privacy of the paper and of Nasr
  et al. 2023). It is a lower bound on epsilon *if* the run's curve is Gaussian; it is reported
  next to the ledger, and the verdict never rests on it (a subsampled or pure-DP mechanism is not
  Gaussian: its GDP bound can exceed its true epsilon at a small delta).
- :func:`gdp_ceiling` / :func:`curve_refutable` -- what the audit can reach before it runs: the
  bound with every guess right, and whether even that could refute the ledger's curve.
- :func:`propose_settings` -- when they cannot: the canaries (else the many-run trials) whose
  ceiling exceeds the ledger's epsilon, and the client updates such an audit trains.
- :func:`noise_check` -- not a privacy bound but a test of the ledger's premise: a chi-square lower
  tail of the declared Gaussian noise in released values (valid whatever the signal), which reaches
  noise bugs at any ledger epsilon, where the canaries cannot.

Reach. A refutation needs ``r_0 + h_0 > c'/m`` from ``tau c / m``: with every guess right the
Gaussian-DP bound reaches mu ~1.1 at 100 canaries, ~1.6 at 500, ~1.8 at 1000 (confidence 0.975, four
tries), i.e. epsilon ~5-9 at delta = 1e-5 (:func:`gdp_ceiling`): a ledger epsilon above that cannot be
refuted by one run of this size however the run leaks. Canaries must also be nearly orthogonal
(model dimension well above the number of canaries), or their cross-talk caps the separation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import scipy.special
import scipy.stats

from dpfl_lightning.errors import require
from dpfl_lightning.privacy.audit import clopper_pearson_upper, epsilon_from_rates, gaussian_epsilon

#: fractions ``k / m`` of the canaries guessed "in" (top scores), each with as many "out" guesses
#: (bottom scores). Few tries keep the Bonferroni level high: on synthetic 1-GDP scores of 500
#: canaries against a 0.5-GDP hypothesis, k = 10-20% refuted it in 12-14 of 20 draws, all guesses
#: (k = 50%) in none, top-5% in none.
GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.3)
_MU_CAP = 64.0

Tradeoff = Callable[[float], float]  # alpha -> the smallest type-II error at type-I error alpha


def gdp_tradeoff(mu: float) -> Tradeoff:
    """``f(alpha) = Phi(Phi^-1(1 - alpha) - mu)``: the trade-off curve of ``mu``-Gaussian DP (Dong,
    Roth, Su 2019)."""
    return lambda a: float(scipy.special.ndtr(scipy.special.ndtri(min(max(1.0 - a, 0.0), 1.0)) - mu))


def profile_tradeoff(profile: list[tuple[float, float]]) -> Tradeoff:
    """The trade-off curve of a mechanism that is ``(eps_j, delta_j)``-DP for every pair:
    ``max(0, max_j 1 - delta_j - e^eps_j alpha, max_j e^-eps_j (1 - delta_j - alpha))`` (Kairouz,
    Oh, Viswanath 2015). With the pairs of a ledger's privacy profile this lies below the ledger's
    true curve: a test against it is conservative."""
    pairs = [(e, d) for e, d in profile if math.isfinite(e)]
    require(bool(pairs), "privacy profile", profile, "has no finite epsilon", "audit a run with a finite epsilon")
    eps = np.array([e for e, _ in pairs], dtype=np.float64)
    dlt = np.array([d for _, d in pairs], dtype=np.float64)
    grow, shrink = np.exp(eps), np.exp(-eps)

    def f(a: float) -> float:
        return float(max(0.0, np.max(1.0 - dlt - grow * a), np.max(shrink * (1.0 - dlt - a))))

    return f


def fdp_rejects(f: Tradeoff, m: int, guesses: int, correct: int, tau: float) -> bool:
    """True when no ``f``-DP run gives ``>= correct`` right guesses out of ``guesses`` with
    probability ``tau`` or more (Mahloujifar et al., the recursion of the module docstring)."""
    require(0 <= correct <= guesses <= m and m >= 1, "one-run audit", (m, guesses, correct),
            "needs 0 <= right guesses <= guesses <= canaries", "count the guesses")
    if guesses == 0:
        return False
    r = tau * correct / m
    h = tau * (guesses - correct) / m
    for i in range(correct - 1, -1, -1):
        h_next = max(h, f(1.0 - min(r, 1.0)))
        r += i / (guesses - i) * (h_next - h)
        h = h_next
        if r + h > guesses / m:
            return True
    return r + h > guesses / m


@dataclass(frozen=True)
class Guesses:
    """The auditor's guesses of one try: ``guesses`` made, ``correct`` right."""

    guesses: int
    correct: int


def guess_tries(scores, inserted) -> tuple[int, list[Guesses]]:
    """Every try of :data:`GUESS_FRACTIONS`: "in" for the ``k`` highest scores and "out" for the
    ``k`` lowest; ties broken by canary index."""
    s, ins = np.asarray(scores, dtype=np.float64), np.asarray(inserted, dtype=bool)
    m = len(s)
    require(m >= 2 and len(ins) == m, "canaries", m, "a one-run audit needs at least 2 canaries", "use more canaries")
    order = np.argsort(-s, kind="stable")
    top_in, bottom_out = np.cumsum(ins[order]), np.cumsum(~ins[order[::-1]])
    out = []
    for k in sorted({max(1, int(round(fr * m))) for fr in GUESS_FRACTIONS}):
        if 2 * k <= m:
            out.append(Guesses(2 * k, int(top_in[k - 1]) + int(bottom_out[k - 1])))
    return m, out


def perfect_tries(m: int) -> list[Guesses]:
    """The tries of :func:`guess_tries` with every guess right (what the bound can reach)."""
    ks = sorted({max(1, int(round(fr * m))) for fr in GUESS_FRACTIONS})
    return [Guesses(2 * k, 2 * k) for k in ks if 2 * k <= m]


def _largest_refuted_mu(m: int, tries: list[Guesses], tau: float) -> float:
    """The largest ``mu`` whose ``mu``-GDP some try refutes at level ``tau`` (0 if none)."""
    best = 0.0
    for t in tries:
        if t.correct == 0 or not fdp_rejects(gdp_tradeoff(best), m, t.guesses, t.correct, tau):
            continue  # rejection is monotone in mu: a try that cannot beat the best so far is skipped
        lo, hi = best, 1.0
        while hi < _MU_CAP and fdp_rejects(gdp_tradeoff(hi), m, t.guesses, t.correct, tau):
            lo, hi = hi, hi * 2
        if hi >= _MU_CAP:
            return math.inf
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fdp_rejects(gdp_tradeoff(mid), m, t.guesses, t.correct, tau) else (lo, mid)
        best = lo
    return best


@dataclass(frozen=True)
class GdpBound:
    """``mu``-GDP refuted at ``confidence`` (if the run's curve is Gaussian), and its epsilon at ``delta``."""

    mu: float
    epsilon: float
    delta: float
    confidence: float
    guesses: int = 0
    correct: int = 0


def gdp_lower_bound(scores, inserted, delta: float, confidence: float = 0.95) -> GdpBound:
    """Mahloujifar et al.'s empirical privacy: the largest refuted ``mu`` over every try of
    :func:`guess_tries`, each at ``tau = (1 - confidence) / tries`` (Bonferroni), so the bound holds at
    ``confidence`` under the Gaussian hypothesis; its epsilon at ``delta``."""
    m, tries = guess_tries(scores, inserted)
    tau = (1.0 - confidence) / len(tries)
    mu = _largest_refuted_mu(m, tries, tau)
    best = max(tries, key=lambda t: (t.correct / t.guesses, t.guesses))
    return GdpBound(mu, gaussian_epsilon(mu, delta), delta, confidence, best.guesses, best.correct)


def gdp_ceiling(m: int, delta: float, confidence: float = 0.95) -> GdpBound:
    """What :func:`gdp_lower_bound` gives with every guess right: the most ``m`` canaries can show."""
    tries = perfect_tries(m)
    mu = _largest_refuted_mu(m, tries, (1.0 - confidence) / len(tries))
    return GdpBound(mu, gaussian_epsilon(mu, delta), delta, confidence, m, m)


def curve_rejected(f: Tradeoff, scores, inserted, confidence: float = 0.95) -> Guesses | None:
    """The first try of :func:`guess_tries` whose guesses refute ``f``-DP at ``(1 - confidence) /
    tries`` (so a refutation holds at ``confidence``), or None."""
    m, tries = guess_tries(scores, inserted)
    tau = (1.0 - confidence) / len(tries)
    return next((t for t in tries if fdp_rejects(f, m, t.guesses, t.correct, tau)), None)


def curve_refutable(f: Tradeoff, m: int, confidence: float = 0.95) -> bool:
    """Whether ``m`` canaries with every guess right would refute ``f``-DP: if not, no run can."""
    tries = perfect_tries(m)
    tau = (1.0 - confidence) / len(tries)
    return any(fdp_rejects(f, m, t.guesses, t.correct, tau) for t in tries)



def many_run_ceiling(trials: int, delta: float, confidence: float) -> float:
    """The most :func:`~dpfl_lightning.privacy.audit.many_run_lower_bound` can give with ``trials``
    runs per world: no error among the held-out half (``trials - trials // 2`` runs per world)."""
    n = trials - trials // 2
    rate = clopper_pearson_upper(0, n, (1.0 - confidence) / 2)
    return epsilon_from_rates(rate, rate, delta)


def _first_above(ceiling: Callable[[int], float], eps: float, start: int, cap: int) -> int | None:
    """An ``n`` in ``(start, cap]`` with ``ceiling(n) > eps``, near the fewest: doubling from
    ``start`` until one is found, then bisection between the last two (the ceilings grow with ``n``
    up to the rounding of guess counts, so the answer is checked, not assumed: ``ceiling(n) > eps``
    always holds for the ``n`` returned). None when not even ``cap`` reaches ``eps``."""
    lo, hi = start, max(start + 1, 2 * start)
    while hi < cap and not ceiling(hi) > eps:
        lo, hi = hi, 2 * hi
    hi = min(hi, cap)
    if hi <= start or not ceiling(hi) > eps:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ceiling(mid) > eps else (mid, hi)
    return hi


@dataclass(frozen=True)
class AuditProposal:
    """Audit settings whose bound can exceed a ledger's epsilon: ``canaries`` for one run (None when
    none up to the cap can), else ``trials`` runs per world of the many-run audit (None when none up
    to the cap can); the ``ceiling`` of the settings proposed, and ``client_updates`` (rounds x
    expected cohort, summed over the runs) as the basis of the audit's run time."""

    canaries: int | None
    trials: int | None
    ceiling: float
    client_updates: float


def propose_settings(eps: float, delta: float, *, canaries: int, clients: int, rounds: int, cohort: float,
                     canary_confidence: float, trial_confidence: float, max_trials: int = 1 << 15) -> AuditProposal:
    """What would reach a ledger epsilon ``eps`` at ``delta`` that ``canaries`` cannot: more canaries
    (at most half the ``clients``; each one-run test at ``canary_confidence``, :func:`gdp_ceiling`),
    else the many-run audit's trials (each test at ``trial_confidence``, :func:`many_run_ceiling`).
    ``rounds`` and the expected ``cohort`` of the configuration give the client updates to train:
    ``rounds x cohort`` for one run, ``2 trials`` times that for the many-run audit."""
    require(eps >= 0 and 0 < delta < 1, "audit proposal", (eps, delta), "needs epsilon >= 0 and delta in (0, 1)",
            "pass the ledger's epsilon and delta")
    per_run = rounds * cohort
    k = _first_above(lambda n: gdp_ceiling(n, delta, canary_confidence).epsilon, eps, max(canaries, 2), clients // 2)
    if k is not None:
        return AuditProposal(k, None, gdp_ceiling(k, delta, canary_confidence).epsilon, per_run)
    n = _first_above(lambda t: many_run_ceiling(t, delta, trial_confidence), eps, 3, max_trials)
    if n is not None:
        return AuditProposal(None, n, many_run_ceiling(n, delta, trial_confidence), 2 * n * per_run)
    return AuditProposal(None, None, max(gdp_ceiling(max(clients // 2, 2), delta, canary_confidence).epsilon,
                                         many_run_ceiling(max_trials, delta, trial_confidence)), 0.0)

# --------------------------------------------------------------------------- the noise the run really adds
#: contiguous blocks of the update whose noise is checked one by one (noise missing from part of the
#: vector shows in the blocks it is missing from)
NOISE_BLOCKS = 8


@dataclass(frozen=True)
class NoiseCheck:
    """The declared noise against what a released value holds, block by block.

    ``ratio``: the observed over the declared std (``sqrt(S_b / D_b)``, an upper estimate: the
    signal adds to it) of the block with the lowest ``upper``, its one-sided upper confidence bound
    at ``confidence`` (Bonferroni over the blocks); ``refuted``: that bound is below 1 (the declared
    noise is not there)."""

    ratio: float
    upper: float
    refuted: bool
    confidence: float
    coordinates: int


def noise_check(sums, counts, confidence: float = 0.95) -> NoiseCheck | None:
    """Is a declared Gaussian noise of std ``sigma_t`` present in released values ``y = a + N``?

    ``sums[b]`` holds ``sum ||y_b||^2 / sigma_t^2`` over the releases of block ``b`` (rounds, or
    canary messages) and ``counts[b]`` the number ``D_b`` of coordinates summed. Whatever the signal
    ``a`` (a function of the past, independent of the fresh noise), ``||a + N||^2 / sigma^2`` is a
    non-central chi-square, stochastically above the central ``chi^2`` of the same degrees of
    freedom, and so is the sum over releases (each one given the past): ``P[S_b <= s] <=
    P[chi^2_{D_b} <= s]``. A block whose lower tail is below ``(1 - confidence) / blocks`` refutes the
    declaration: the noise in it is smaller than declared (a statistically valid refutation at
    ``confidence``, with no assumption on the data). The upper bound on the std ratio is the ``r``
    with ``P[chi^2_{D_b} <= S_b / r^2] = (1 - confidence) / blocks``. None when nothing was read."""
    s, d = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    keep = d > 0
    if not keep.any():
        return None
    s, d = s[keep], d[keep]
    alpha = (1.0 - confidence) / len(d)
    upper = np.sqrt(s / scipy.stats.chi2.ppf(alpha, d))
    b = int(np.argmin(upper))
    return NoiseCheck(float(np.sqrt(s[b] / d[b])), float(upper[b]), bool(upper[b] < 1.0), confidence, int(d.sum()))

