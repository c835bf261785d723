"""Noise calibration: the smallest noise multiplier for a target (epsilon, delta), and the inverse,
the largest number of steps a noise multiplier allows.

Both are bracketed root searches on a monotone function (epsilon falls as the noise multiplier
grows and rises with the number of steps). The result never exceeds the target: the search keeps a
bracket ``[lo, hi]`` with ``eps(hi) <= target < eps(lo)`` and returns ``hi``, and it stops once
``eps(hi)`` is within ``rtol`` (1%) of the target.

Speed: for RDP the bracket is narrowed with a vectorised copy of dp_accounting's RDP computation
(identical to ~1e-13) and the answer is then checked with dp_accounting itself; for PLD/PRV the
RDP answer is the upper end of the bracket (RDP is never tighter) and a secant search in
log-space needs a handful of PLD evaluations.
"""

from __future__ import annotations

import math
from typing import Callable

from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.privacy.accountants import GaussianRelease, Release, create_accountant, epsilon, fast_rdp_epsilon
from dpfl_lightning.privacy.guarantees import Guarantee, Profile

Z_MIN, Z_MAX = 1e-3, 1e5


def _validate(target_epsilon: float, delta: float, accountant: str) -> None:
    require(isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0,
            "target_epsilon", target_epsilon, "must be a finite number > 0", "set a positive epsilon, e.g. 3.0")
    require(isinstance(delta, (int, float)) and 0 < delta < 1, "delta", delta, "must be in (0, 1)",
            "set delta well below 1/N, e.g. 1e-5")
    create_accountant(accountant)


def _check_sampling_rate(rate: float) -> None:
    require(isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and 0 < rate <= 1,
            "sampling_rate", rate, "must be a number in (0, 1]", "give the fraction of units sampled per step, e.g. 0.01")


def _bracket(eps: Callable[[float], float], target_epsilon: float) -> tuple[float, float]:
    """Noise multipliers ``lo < hi`` with ``eps(lo) > target >= eps(hi)`` (or ``lo`` at ``Z_MIN``),
    found by factors of 4 from 1."""
    lo, hi = 1.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 4
    while eps(lo) <= target_epsilon and lo > Z_MIN:
        lo, hi = lo / 4, lo
    return lo, hi


def _search(f: Callable[[float], float], target: float, lo: float, hi: float, rtol: float, max_iter: int = 200) -> float:
    """Root of the decreasing ``f`` with ``f(lo) > target >= f(hi)``: return ``x`` with
    ``target * (1 - rtol) <= f(x) <= target``.

    Illinois false position on ``g(log x) = log(f(x) / target)``, which is close to linear, so a
    few evaluations suffice; the bracket always holds, so the answer is on the safe side."""

    def g(x: float) -> float:
        v = f(x)
        return 50.0 if not math.isfinite(v) else (-50.0 if v <= 0 else math.log(v / target))

    a, b = math.log(lo), math.log(hi)
    ga, gb = g(lo), g(hi)
    last = 0
    for _ in range(max_iter):
        if gb >= math.log1p(-rtol) or b - a < 1e-12:
            break
        c = b - gb * (b - a) / (gb - ga)
        if not a < c < b:
            c = (a + b) / 2
        gc = g(math.exp(c))
        if gc > 0:
            a, ga = c, gc
            if last == -1:
                gb /= 2
            last = -1
        else:
            b, gb = c, gc
            if last == 1:
                ga /= 2
            last = 1
    return math.exp(b)


def calibrate_noise(target_epsilon: float, delta: float, steps: int, sampling_rate: float = 1.0,
                    sampling: str | None = None, accountant: str = "rdp", relation: str = "add_remove",
                    population: int | None = None, sample_size: int | None = None, rtol: float = 0.01) -> float:
    """The smallest noise multiplier (to ``rtol``) whose ``steps``-fold composition is
    (``target_epsilon``, ``delta``)-DP under ``accountant``; never above the target.

    ``sampling`` defaults to ``poisson`` when ``sampling_rate < 1`` and ``none`` otherwise.
    """
    _check_sampling_rate(sampling_rate)
    if sampling is None:
        sampling = "poisson" if sampling_rate < 1 else "none"
    return calibrate_release(GaussianRelease(1.0, sampling, sampling_rate, relation, population, sample_size),
                             target_epsilon, delta, steps, accountant, rtol)


def calibrate_release(base: Release, target_epsilon: float, delta: float, steps: int,
                      accountant: str = "rdp", rtol: float = 0.01) -> float:
    """:func:`calibrate_noise` for the sampling and relation of ``base`` (its multiplier is ignored)."""
    _validate(target_epsilon, delta, accountant)
    require(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1, "rounds", steps, "must be an integer >= 1", "set rounds >= 1")

    def exact(z: float) -> float:
        return epsilon(base.with_noise_multiplier(z), steps, delta, accountant).epsilon

    def fast(z: float) -> float:
        return fast_rdp_epsilon(base.with_noise_multiplier(z), steps, delta)

    if fast(Z_MAX) > target_epsilon:
        raise ConfigError("target_epsilon", target_epsilon,
                          f"is unreachable: even noise multiplier {Z_MAX:g} gives more at delta={delta:g}",
                          "raise the target epsilon or delta, or lower the number of rounds")
    z_rdp = _search(fast, target_epsilon, *_bracket(fast, target_epsilon), rtol / 10)
    while epsilon(base.with_noise_multiplier(z_rdp), steps, delta, "rdp").epsilon > target_epsilon:
        z_rdp *= 1 + 1e-6  # the vectorised and dp_accounting's RDP agree to ~1e-13; guard anyway
    if accountant == "rdp" or epsilon(base.with_noise_multiplier(z_rdp), steps, delta, accountant).method == "rdp":
        return z_rdp
    hi = z_rdp
    while exact(hi) > target_epsilon:  # RDP is normally the looser bound; do not rely on it
        hi *= 1.25
        if hi > Z_MAX:
            raise ConfigError("target_epsilon", target_epsilon, f"is unreachable under {accountant}",
                              "raise the target epsilon or delta")
    lo = hi * 0.8
    while exact(lo) <= target_epsilon and lo > Z_MIN:
        lo, hi = lo * 0.8, lo
    return _search(exact, target_epsilon, lo, hi, rtol)


def max_steps(noise_multiplier: float, target_epsilon: float, delta: float, sampling_rate: float = 1.0,
              sampling: str | None = None, accountant: str = "rdp", relation: str = "add_remove",
              population: int | None = None, sample_size: int | None = None, limit: int = 10**7) -> int:
    """The largest number of compositions with epsilon at most ``target_epsilon`` (0 if even one
    step exceeds it)."""
    _validate(target_epsilon, delta, accountant)
    require(isinstance(noise_multiplier, (int, float)) and not isinstance(noise_multiplier, bool)
            and math.isfinite(noise_multiplier) and noise_multiplier > 0, "noise_multiplier", noise_multiplier,
            "must be a finite number > 0", "give a positive noise multiplier")
    _check_sampling_rate(sampling_rate)
    if sampling is None:
        sampling = "poisson" if sampling_rate < 1 else "none"
    release = GaussianRelease(noise_multiplier, sampling, sampling_rate, relation, population, sample_size)

    return largest_within(lambda t: epsilon(release, t, delta, accountant).epsilon, target_epsilon, limit)


def largest_within(eps_of: Callable[[int], float], target: float, cap: int) -> int:
    """Largest integer ``t <= cap`` with ``eps_of(t) <= target`` for a non-decreasing ``eps_of``
    (0 if even ``t = 1`` exceeds it): doubling to bracket ``eps(lo) <= target < eps(hi)``, then
    bisection."""
    if eps_of(1) > target:
        return 0
    lo, hi = 1, 2
    while eps_of(hi) <= target:
        if hi >= cap:
            return cap
        lo, hi = hi, min(2 * hi, cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if eps_of(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def calibrate_guarantee(guarantee_at: Callable[[float], Guarantee], compositions: Callable[[Profile], int],
                        target_epsilon: float, delta: float, accountant: str = "rdp", rtol: float = 0.01) -> float:
    """The smallest multiplier ``z`` (to ``rtol``) for which the guarantee built by
    ``guarantee_at(z)`` stays within ``target_epsilon`` after ``compositions(profile)``
    compositions of each of its profiles (its worst client); never above the target.

    Every calibrated plugin goes through here (Gaussian noise, DP-SGD, ...). Where a profile's
    release is one Gaussian whose multiplier scales with ``z`` (the common case) the fast
    :func:`calibrate_release` does the work; otherwise (other mechanisms composed in the same
    guarantee) a bracketed search runs on the exact epsilon.
    """
    _validate(target_epsilon, delta, accountant)
    one, two = guarantee_at(1.0), guarantee_at(2.0)
    z = 0.0
    for k, profile in enumerate(one.profiles):
        steps = int(compositions(profile))
        if steps == 0:
            continue
        r1, r2 = profile.release, two.profiles[k].release
        if r1.gaussian and r2.gaussian and r1.noise_multiplier > 0 and \
                math.isclose(r2.noise_multiplier, 2 * r1.noise_multiplier, rel_tol=1e-12):
            z = max(z, calibrate_release(r1, target_epsilon, delta, steps, accountant, rtol) / r1.noise_multiplier)
            continue

        def eps(x: float, k: int = k, steps: int = steps) -> float:
            return epsilon(guarantee_at(x).profiles[k].release, steps, delta, accountant).epsilon

        if eps(Z_MAX) > target_epsilon:
            raise ConfigError("target_epsilon", target_epsilon, f"is unreachable at delta={delta:g}",
                              "raise the target epsilon or delta, or lower the number of rounds")
        z = max(z, _search(eps, target_epsilon, *_bracket(eps, target_epsilon), rtol))
    return z
