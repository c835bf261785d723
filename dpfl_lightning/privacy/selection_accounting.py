"""The guarantee of what a sweep releases: the selected result of a private-selection sweep, every
run of a plain grid, and the worst case over the hyperparameters a trial may draw.

**One trial** (:class:`Trial`) is one DP run: ``steps`` compositions of each of its
:class:`~dpfl_lightning.privacy.accountants.Release` s, for the unit its guarantee protects (a client,
or a record of the worst client). Its Renyi DP curve at ``dp_accounting``'s ``DEFAULT_RDP_ORDERS``
is ``sum(steps * rdp_curve(release))``, the curve ``dp_accounting.rdp.RdpAccountant`` composes.

**The selected result** of ``K ~`` :class:`~dpfl_lightning.privacy.selection.TrialCount` trials is
``dp_accounting.RepeatAndSelectDpEvent(trial_event, mean, shape)`` (:func:`selection_event`),
accounted by ``RdpAccountant``: Papernot & Steinke's Theorem 2 (truncated negative binomial,
geometric ``shape=1``, logarithmic ``shape=0``) or Theorem 6 (Poisson, ``shape=inf``), then RDP's
conversion to ``(epsilon, delta)`` (Canonne, Kamath, Steinke 2020). The theorems are statements about
Renyi DP: no PLD or PRV accounting of repeat-and-select exists, so those accountants give the RDP
bound, with a note that says so. A point mass (``K = 1``, see
:mod:`~dpfl_lightning.privacy.selection`) is one run: the trial's own guarantee, in any accountant.

**The worst case over a space.** When the hyperparameters change the event (noise multiplier,
rounds, cohort, ...), a trial draws one of several mechanisms. By the joint quasi-convexity of the
Renyi divergence, a trial that picks ``h`` at random (independently of the data) and runs ``M_h`` is
``(lambda, max_h eps_h(lambda))``-RDP at every order: the pointwise maximum of the curves is the
trial's curve, and the theorems are applied to it. Taking the one event with the largest epsilon
at ``delta`` would not be valid in general (the theorems read the curve at other orders than the
one the final conversion picks). When one hyperparameter's curve is the maximum at every order,
the result is exactly that event's; the report names it (``worst``) and lists every point whose
curve reaches the maximum at some order (``attained_by``).

**All runs of a plain grid** compose: the sum of their curves (RDP), or, where every run is the
same release, the asked accountant on the total number of compositions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import dp_accounting
from dp_accounting.dp_event import RepeatAndSelectDpEvent
import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS, compute_epsilon

from dpfl_lightning.errors import require
from dpfl_lightning.privacy.accountants import Epsilon, Release, create_accountant, epsilon, rdp_curve
from dpfl_lightning.privacy.selection import TrialCount, trial_count

ORDERS = np.array(DEFAULT_RDP_ORDERS, dtype=np.float64)


@dataclass(frozen=True)
class Trial:
    """One trial's privacy: each ``(release, steps)`` of ``parts`` composed ``steps`` times (the
    run's guarantee for its worst unit); ``label`` names its hyperparameters in reports."""

    parts: tuple[tuple[Release, int], ...]
    label: str = ""

    def __post_init__(self) -> None:
        require(len(self.parts) >= 1, "trial", self.label, "has no release", "give at least one (release, steps)")
        for release, steps in self.parts:
            require(isinstance(release, Release), "trial", self.label, f"{release!r} is not a Release",
                    "describe each mechanism with privacy.Release")
            require(isinstance(steps, (int, np.integer)) and not isinstance(steps, bool) and steps >= 0,
                    "trial.steps", steps, "must be a whole number of compositions >= 0", "count rounds as integers")

    @property
    def relation(self) -> str:
        return self.parts[0][0].relation

    def rdp(self) -> np.ndarray:
        """The trial's RDP at :data:`ORDERS`."""
        return sum((steps * rdp_curve(release) for release, steps in self.parts if steps), np.zeros_like(ORDERS))

    def dp_event(self) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of one trial (to be accounted under :attr:`relation`)."""
        events = [dp_accounting.SelfComposedDpEvent(r.dp_event(), int(s)) for r, s in self.parts if s]
        if not events:
            return dp_accounting.NoOpDpEvent()
        return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)

    @property
    def no_noise(self) -> bool:
        return any(steps and r.noise_multiplier == 0 and r.effective_rate > 0 for r, steps in self.parts)


def trial(release: Release, steps: int, label: str = "") -> Trial:
    """A :class:`Trial` of ``steps`` compositions of one release."""
    return Trial(((release, steps),), label)


def trials_over(space: Iterable[Mapping], trial_of: Callable[[Mapping], Trial]) -> list[Trial]:
    """The trial of every point of a hyperparameter ``space`` (``trial_of(point)``), labelled with
    the point (``name=value, ...``) where ``trial_of`` gave no label."""
    out = []
    for point in space:
        t = trial_of(point)
        label = t.label or ", ".join(f"{k}={v}" for k, v in point.items())
        out.append(Trial(t.parts, label))
    return out


def selection_event(one: Trial, count: TrialCount | Mapping) -> dp_accounting.DpEvent:
    """``RepeatAndSelectDpEvent`` of the trial's event with ``count``'s mean and shape (the trial's
    own event for a point mass)."""
    count = trial_count(count)
    if count.point_mass:
        return one.dp_event()
    return RepeatAndSelectDpEvent(one.dp_event(), count.mean, count.dp_shape)


def _log_delta(curve: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """``log delta`` of the RDP ``curve`` at each epsilon of ``eps``, as ``dp_accounting``'s
    ``compute_delta`` (the minimum over orders of the conversion of Canonne, Kamath, Steinke 2020,
    Prop. 12, for orders above 1.01, and of ``sqrt(1 - exp(-rdp))``), vectorised."""
    a, r = ORDERS[None, :], curve[None, :]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        kl = np.where(r > 0, 0.5 * np.log1p(-np.exp(-r)), -np.inf)
        ckks = np.where(a > 1.01, (a - 1) * (r - eps[:, None] + np.log1p(-1 / a)) - np.log(a), np.inf)
    return np.minimum(np.min(np.minimum(kl, ckks), axis=1), 0.0)


def selected_rdp(curve: np.ndarray, count: TrialCount | Mapping) -> np.ndarray:
    """The RDP at :data:`ORDERS` of the best of ``K ~ count`` trials whose RDP is ``curve``, as
    ``RdpAccountant`` computes it for a ``RepeatAndSelectDpEvent`` (``tests/test_private_selection.py``
    checks the two agree, and against an independent implementation of the theorems); on a curve,
    so that a worst case over several events can be accounted, and vectorised (dp_accounting's loop
    over orders costs ~0.3 s a call):

    - Poisson (Theorem 6): ``eps(l) + mean * delta_hat(l) + log(mean) / (l - 1)`` with ``delta_hat(l)``
      the trial's delta at ``eps_hat = log(1 + 1 / (l - 1))``;
    - truncated negative binomial (Theorem 2): ``eps(l) + log(mean) / (l - 1) + (1 + eta) min over
      l_hat of ((1 - 1/l_hat) eps(l_hat) + log(1/gamma) / l_hat)``, then made non-decreasing in the
      order (RDP is monotone in the order). ``gamma`` is solved from the mean to ~1e-15 (dp_accounting
      bisects it to 1e-9)."""
    count = trial_count(count)
    curve = np.asarray(curve, dtype=np.float64)
    if count.point_mass:
        return curve
    mean = count.mean
    if count.distribution == "poisson":
        eps_hat = np.log1p(1 / (ORDERS - 1))
        delta_hat = np.exp(_log_delta(curve, eps_hat))
        return curve + mean * delta_hat + math.log(mean) / (ORDERS - 1)
    eta, log_gamma = count.dp_shape, math.log(count.gamma)
    c = (1 + eta) * np.min((1 - 1 / ORDERS) * curve - log_gamma / ORDERS)
    out = curve + math.log(mean) / (ORDERS - 1) + c
    return np.minimum.accumulate(out[::-1])[::-1]


def _rdp_epsilon(curve: np.ndarray, delta: float) -> float:
    if not np.any(curve):
        return 0.0
    return float(compute_epsilon(DEFAULT_RDP_ORDERS, curve, delta)[0])


def _check_delta(delta: float) -> None:
    require(isinstance(delta, (int, float)) and 0 < delta < 1, "delta", delta, "must be in (0, 1)",
            "set delta well below 1/N, e.g. 1e-5")


def _as_trials(trials: Trial | Sequence[Trial]) -> list[Trial]:
    out = [trials] if isinstance(trials, Trial) else list(trials)
    require(len(out) >= 1 and all(isinstance(t, Trial) for t in out), "trials", trials,
            "must be one Trial or a non-empty list of them", "build them with selection_accounting.trial()")
    return out


def run_epsilon(one: Trial, delta: float, accountant: str = "rdp") -> Epsilon:
    """The epsilon of one run: the accountant's for a single release, RDP for a composition of
    several (with a note when another accountant was asked for)."""
    _check_delta(delta)
    create_accountant(accountant)
    if len(one.parts) == 1:
        release, steps = one.parts[0]
        return epsilon(release, int(steps), delta, accountant)
    note = "" if accountant == "rdp" else f"{accountant}: a run of several releases is composed under RDP"
    return Epsilon(math.inf if one.no_noise else _rdp_epsilon(one.rdp(), delta), "rdp", note)


@dataclass(frozen=True)
class WorstCase:
    """The trial curve a sweep's guarantee uses: the pointwise maximum of every point's curve.

    ``worst`` is the point with the largest epsilon on its own and ``attained_by`` every point whose
    curve is the maximum at some order where it is finite (both empty where every point has the
    same curve: no hyperparameter changes the event); ``exact``: one point's curve is the maximum
    at every such order, so the guarantee is that point's."""

    curve: np.ndarray
    worst: str
    attained_by: tuple[str, ...]
    exact: bool


def worst_case(trials: Trial | Sequence[Trial], delta: float, count: TrialCount | Mapping | None = None) -> WorstCase:
    """The worst case over ``trials`` (see the module docstring); ``worst`` is ranked by each
    trial's epsilon at ``delta`` after selection by ``count`` (or alone when ``count`` is ``None``)."""
    _check_delta(delta)
    trials = _as_trials(trials)
    curves = np.stack([np.full_like(ORDERS, np.inf) if t.no_noise else t.rdp() for t in trials])
    top = curves.max(axis=0)
    if all(np.array_equal(c, curves[0]) for c in curves[1:]):
        return WorstCase(top, "", (), True)
    finite = np.isfinite(top) if np.isfinite(top).any() else np.ones_like(top, dtype=bool)
    reaches = [c[finite] >= top[finite] for c in curves]
    attained = tuple(dict.fromkeys(t.label for t, r in zip(trials, reaches) if r.any()))

    def alone(c: np.ndarray) -> float:
        return _rdp_epsilon(c if count is None else selected_rdp(c, count), delta)

    worst = trials[int(np.argmax([alone(c) for c in curves]))].label
    return WorstCase(top, worst, attained, any(r.all() for r in reaches))


@dataclass(frozen=True)
class SelectedEpsilon:
    """The guarantee of a sweep's released result at ``delta``, and which hyperparameter set it."""

    epsilon: float
    delta: float
    method: str
    note: str
    worst: str
    attained_by: tuple[str, ...]
    count: TrialCount | None = None
    exact: bool = True

    def describe(self) -> str:
        what = "selected result" if self.count is not None else "one run"
        by = f"; worst case: {self.worst}" if self.worst else ""
        if not self.exact:
            by += f" (pointwise maximum over {', '.join(self.attained_by)})"
        extra = f" ({self.count.describe()})" if self.count is not None else ""
        note = f" [{self.note}]" if self.note else ""
        return f"{what}{extra}: epsilon {self.epsilon:.4g} at delta {self.delta:g} ({self.method}){by}{note}"


def selected_epsilon(trials: Trial | Sequence[Trial], count: TrialCount | Mapping, delta: float,
                     accountant: str = "rdp") -> SelectedEpsilon:
    """The guarantee of the best of ``K ~ count`` trials, each drawing one of ``trials`` (one or the
    points of a space: their worst case). RDP for every accountant but for a point mass (one run),
    with a note where another accountant was asked for."""
    count = trial_count(count)
    create_accountant(accountant)
    trials = _as_trials(trials)
    case = worst_case(trials, delta, count)
    if count.point_mass:
        one = max((run_epsilon(t, delta, accountant) for t in trials), key=lambda e: e.epsilon)
        return SelectedEpsilon(one.epsilon, delta, one.method, "point mass K = 1: one run, no selection"
                               + (f"; {one.note}" if one.note else ""), case.worst, case.attained_by, count, case.exact)
    eps = _rdp_epsilon(selected_rdp(case.curve, count), delta)
    note = "" if accountant == "rdp" else \
        f"{accountant} cannot account repeat-and-select (Papernot & Steinke bound Renyi DP): RDP bound"
    return SelectedEpsilon(eps, delta, "rdp", note, case.worst, case.attained_by, count, case.exact)


def one_run_epsilon(trials: Trial | Sequence[Trial], delta: float, accountant: str = "rdp") -> SelectedEpsilon:
    """The epsilon of one run of the space: the largest over its points (a run with hyperparameters
    drawn at random is a mixture, no worse than its worst point)."""
    trials = _as_trials(trials)
    eps = [run_epsilon(t, delta, accountant) for t in trials]
    i = int(np.argmax([e.epsilon for e in eps]))
    if all(e.epsilon == eps[i].epsilon for e in eps):  # no hyperparameter changes it
        return SelectedEpsilon(eps[i].epsilon, delta, eps[i].method, eps[i].note, "", ())
    return SelectedEpsilon(eps[i].epsilon, delta, eps[i].method, eps[i].note, trials[i].label, (trials[i].label,))


def all_runs_epsilon(runs: Sequence[Trial], delta: float, accountant: str = "rdp") -> Epsilon:
    """The epsilon of releasing every run of ``runs`` (a plain grid: one trial per run, repeated
    where a point ran several times): their composition. Runs of one release compose under the asked
    accountant; different releases under RDP (with a note when another accountant was asked for)."""
    _check_delta(delta)
    create_accountant(accountant)
    runs = _as_trials(runs)
    releases = {release for t in runs for release, steps in t.parts if steps}
    if len(releases) <= 1:
        total = sum(int(steps) for t in runs for _, steps in t.parts)
        if not releases:
            return Epsilon(0.0, accountant)
        return epsilon(next(iter(releases)), total, delta, accountant)
    if any(t.no_noise for t in runs):
        return Epsilon(math.inf, "rdp", "no noise")
    note = "" if accountant == "rdp" else f"{accountant}: runs of different releases are composed under RDP"
    return Epsilon(_rdp_epsilon(sum(t.rdp() for t in runs), delta), "rdp", note)
