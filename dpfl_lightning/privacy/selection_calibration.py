"""A budget for a whole private-selection search: the noise multiplier whose selected result meets
``(epsilon, delta)`` including selection, and the trade-off between epsilon and the mean number of
trials (``dpfl privacy plan``).

**The floor.** Repeat-and-select adds to epsilon a term that no noise removes. As the noise grows
the trial's RDP goes to 0 at every order, and the selected result's RDP goes to
``log(mean) / (lambda - 1)`` (Poisson, Theorem 6) or ``log(mean) / (lambda - 1) + (1 + eta)
log(1/gamma) / lambda_max`` (Theorem 2, ``lambda_max`` the largest order accounted: 1024), whose
conversion at ``delta`` stays positive: :func:`selection_floor`. A target at or below the epsilon of
the largest noise multiplier the search tries (``calibrate.Z_MAX``) is refused, naming the floor.

**The search** (:func:`calibrate_selection`) keeps a bracket ``[lo, hi]`` of noise multipliers with
``eps(lo) > target >= eps(hi)`` (epsilon falls as the noise grows), halves it in log space until
``eps(hi)`` is within ``rtol`` of the target, and returns ``hi``: never above the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.privacy.accountants import Release, fast_rdp_poisson_gaussian
from dpfl_lightning.privacy.calibrate import Z_MAX, Z_MIN
from dpfl_lightning.privacy.selection import TrialCount, trial_count
from dpfl_lightning.privacy.selection_accounting import (ORDERS, Trial, all_runs_epsilon, run_epsilon,
                                                         selected_epsilon, selected_rdp, trial)

#: the mean numbers of trials ``dpfl privacy plan`` shows by default
DEFAULT_MEANS = (1, 2, 4, 8, 16, 32)


def _check_target(target_epsilon: float, delta: float) -> None:
    require(isinstance(target_epsilon, (int, float)) and not isinstance(target_epsilon, bool)
            and math.isfinite(target_epsilon) and target_epsilon > 0, "target_epsilon", target_epsilon,
            "must be a finite number > 0", "set a positive epsilon, e.g. 4.0")
    require(isinstance(delta, (int, float)) and 0 < delta < 1, "delta", delta, "must be in (0, 1)",
            "set delta well below 1/N, e.g. 1e-5")


def selection_floor(count: TrialCount | Mapping, delta: float) -> float:
    """The epsilon of the selected result of trials that reveal nothing (RDP 0 at every order): the
    part of the bound no noise removes (0 for a point mass, one run)."""
    curve = selected_rdp(np.zeros_like(ORDERS), trial_count(count))
    return float(compute_epsilon(list(ORDERS), curve, delta)[0]) if np.any(curve) else 0.0


def _search(eps: Callable[[float], float], target_epsilon: float, rtol: float) -> float:
    """The bracketed search of the module docstring on ``eps``, decreasing in ``z``, with
    ``eps(Z_MAX) <= target``."""
    lo, hi = 1.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
    while eps(lo) <= target_epsilon and lo > Z_MIN:
        lo, hi = lo / 2, lo
    while eps(hi) < target_epsilon * (1 - rtol) and hi / lo > 1 + 1e-9:
        mid = math.sqrt(lo * hi)
        if eps(mid) > target_epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def _refuse_unreachable(eps: Callable[[float], float], count: TrialCount, target_epsilon: float,
                        delta: float) -> None:
    at_max = eps(Z_MAX)
    if at_max > target_epsilon:
        raise ConfigError("target_epsilon", target_epsilon,
                          f"is unreachable with private selection ({count.describe()}): repeat-and-select adds "
                          f"at least {selection_floor(count, delta):.3g} at delta={delta:g} that no noise removes, "
                          f"and even noise multiplier {Z_MAX:g} gives {at_max:.3g}",
                          "raise target_epsilon or delta, or lower the mean number of trials")


def calibrate_selection_at(trial_at: Callable[[float], Trial], count: TrialCount | Mapping, target_epsilon: float,
                           delta: float, rtol: float = 0.01) -> float:
    """The smallest noise multiplier ``z`` (to ``rtol``) for which the best of ``K ~ count`` trials
    ``trial_at(z)`` is ``(target_epsilon, delta)``-DP; never above the target. A target that no
    noise reaches is refused with the floor of the bound."""
    _check_target(target_epsilon, delta)
    count = trial_count(count)

    def eps(z: float) -> float:
        return selected_epsilon(trial_at(z), count, delta).epsilon

    _refuse_unreachable(eps, count, target_epsilon, delta)
    return _search(eps, target_epsilon, rtol)


def calibrate_selection(base: Release, steps: int, count: TrialCount | Mapping, target_epsilon: float,
                        delta: float, rtol: float = 0.01) -> float:
    """:func:`calibrate_selection_at` for trials of ``steps`` compositions of ``base`` with its noise
    multiplier set to ``z`` (its sampling and relation kept; its multiplier ignored).

    For a Poisson-sampled (or unsampled) Gaussian under add/remove the search runs on
    ``accountants.fast_rdp_poisson_gaussian`` (dp_accounting's RDP, vectorised, equal to ~1e-13) and
    the answer is then checked with dp_accounting itself."""
    require(base.gaussian, "privacy release", base, "only a Gaussian release has a noise multiplier to calibrate",
            "calibrate a run whose mechanisms are Gaussian")
    require(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1, "rounds", steps,
            "must be an integer >= 1", "set rounds >= 1")
    _check_target(target_epsilon, delta)
    count = trial_count(count)
    if base.sampling == "without_replacement" or base.relation != "add_remove" or count.point_mass:
        return calibrate_selection_at(lambda z: trial(base.with_noise_multiplier(z), steps), count, target_epsilon,
                                      delta, rtol)

    def fast(z: float) -> float:
        curve = selected_rdp(steps * fast_rdp_poisson_gaussian(base.effective_rate, z), count)
        return float(compute_epsilon(list(ORDERS), curve, delta)[0])

    def exact(z: float) -> float:
        return selected_epsilon(trial(base.with_noise_multiplier(z), steps), count, delta).epsilon

    _refuse_unreachable(exact, count, target_epsilon, delta)
    z = _search(fast, target_epsilon, rtol / 10)
    while exact(z) > target_epsilon:  # the two RDP computations agree to ~1e-13; guard anyway
        z *= 1 + 1e-6
    return z


@dataclass(frozen=True)
class PlanRow:
    """Epsilon at ``delta`` of the selected result with ``mean`` trials on average, and for
    comparison of one run and of releasing ``round(mean)`` runs of a plain grid."""

    mean: float
    selected: float
    one_run: float
    all_runs: float
    method: str
    note: str = ""


def selection_plan(one: Trial, delta: float, distribution: str = "poisson", shape: float | None = None,
                   means: Sequence[float] = DEFAULT_MEANS, accountant: str = "rdp") -> list[PlanRow]:
    """The epsilon of the selected result against the mean number of trials, for trials ``one``."""
    single = run_epsilon(one, delta, accountant).epsilon
    rows = []
    for mean in means:
        setting = {"distribution": distribution, "mean": mean} | ({"shape": shape} if shape is not None else {})
        sel = selected_epsilon(one, trial_count(setting), delta, accountant)
        grid = all_runs_epsilon([one] * max(1, math.floor(mean + 0.5)), delta, accountant).epsilon
        rows.append(PlanRow(float(mean), sel.epsilon, single, grid, sel.method, sel.note))
    return rows


def format_plan(rows: Sequence[PlanRow], delta: float, count_name: str = "poisson") -> str:
    """A plain-text table of :func:`selection_plan` for the console."""
    lines = [f"epsilon at delta={delta:g}: the selected result of a private-selection sweep ({count_name} number "
             "of trials) against the mean number of trials; one run; every run of a grid of that many runs",
             f"{'mean trials':>11}  {'selected':>9}  {'one run':>9}  {'all runs':>9}"]
    lines += [f"{r.mean:>11g}  {r.selected:>9.3f}  {r.one_run:>9.3f}  {r.all_runs:>9.3f}" for r in rows]
    notes = sorted({r.note for r in rows if r.note})
    return "\n".join(lines + [f"note: {n}" for n in notes])
