"""Private selection (Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy",
ICLR 2022, arXiv:2110.03620): the number of trials ``K`` and how it is drawn.

A private-selection sweep runs ``K`` independent, identically distributed trials (each an ordinary
DP run whose hyperparameters are drawn from the sweep's space) and releases only the best one. ``K``
is random, drawn from one of the paper's distributions (:class:`TrialCount`):

=================================  ==========================  =====================================
distribution (``shape`` in          ``P[K = k]``                support, ``dp_accounting`` shape
``dp_accounting``)
=================================  ==========================  =====================================
``poisson`` (``inf``)               ``e^-mu mu^k / k!``          ``k >= 0``; ``K = 0`` releases nothing
``geometric`` (``1``)               ``gamma (1-gamma)^(k-1)``    ``k >= 1``
``logarithmic`` (``0``)             ``(1-gamma)^k /              ``k >= 1``
                                    (k log(1/gamma))``
``truncated_negative_binomial``     ``(1-gamma)^k / (gamma^-eta  ``k >= 1``, ``eta = shape > 0``
(``eta``)                           - 1) prod_{l<k} (l+eta)/(l+1)``
=================================  ==========================  =====================================

(Definition 1 of the paper; ``gamma`` is fixed by the mean. The paper also allows
``-1 < eta < 0``; ``dp_accounting`` does not, and neither do we.)

**Mean 1.** For ``geometric``, ``logarithmic`` and ``truncated_negative_binomial`` a mean of 1 is the
limit ``gamma -> 1``: the point mass ``K = 1``, one run and no selection. It is accepted and reduced
to exactly that: the sampler returns 1 without drawing, and the guarantee is the trial's own (the
paper's bound at ``gamma = 1`` would be looser than the run it describes). ``poisson`` with mean 1 is
a genuine distribution (``K = 0, 1, 2, ...``). Means below 1 are refused (``dp_accounting``'s bound
needs ``mean >= 1``), and so are means above :data:`MAX_MEAN`.

**Sampling.** ``K`` is drawn by inversion from one 53-bit uniform ``u`` of a keyed stream
(:data:`TRIALS` purpose, ``RandomSource.stream(0, SERVER_CLIENT, TRIALS, tag="count")``): with
``v = 1 - u`` in ``(0, 1]`` (exact in float64) and the survival function ``S(k) = P[K > k]``,
``K = min{k : S(k) < v}``, so ``P[K <= k] = 1 - S(k)`` up to the 2^-53 grid of ``v``. ``S`` comes
from the probabilities computed in float64 in log space (``gammaln``) up to a ``k_max`` beyond which
the mass left is below 1e-20, then summed from the far end (so small tails keep their relative
precision) and normalised. In secure mode the stream is the CSPRNG (SHAKE-256, keyed by the secret):
``K`` cannot be recomputed from the seed. A trial's hyperparameters are drawn uniformly, with
replacement, from the ``n`` points of the space (:func:`draw_trial_point`, exact: rejection on the
53-bit integers), keyed by the trial's index so that a resumed sweep draws the same trials.

**What must stay secret.** The theorems bound what the *selected* result reveals when ``K`` is
unknown. ``K`` and every trial but the best (their hyperparameters, metrics and models) must not
reach whoever the guarantee is towards, before or after the end: the pair ``(K, best result)`` is not
covered by the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import numpy as np
from scipy import optimize, special

from dpfl_lightning import rng
from dpfl_lightning.errors import require

DISTRIBUTIONS = ("poisson", "geometric", "logarithmic", "truncated_negative_binomial")
#: the largest mean number of trials accepted (the sampler's table grows like the mean over gamma)
MAX_MEAN = 1000.0
#: the stream purpose of the sweep's draws (K, and each trial's point of the space); private: the
#: guarantee of the selected result relies on K being unknown
TRIALS = rng.register_purpose("PrivateSelection.trials")
_TAIL = 1e-20  # the probability mass the sampler's table may leave out
_SETTING = "private_selection"


def _number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials ``K`` (see the module docstring).

    ``shape`` is given for ``truncated_negative_binomial`` only (``eta > 0``); the other
    distributions fix it. Build one from a sweep file's mapping with :func:`trial_count`."""

    distribution: str
    mean: float
    shape: float | None = None

    def __post_init__(self) -> None:
        d = self.distribution
        require(d in DISTRIBUTIONS, f"{_SETTING}.distribution", d, "unknown distribution of the number of trials",
                f"use one of {', '.join(DISTRIBUTIONS)}")
        require(_number(self.mean) and math.isfinite(self.mean) and 1 <= self.mean <= MAX_MEAN,
                f"{_SETTING}.mean", self.mean, f"must be a number in [1, {MAX_MEAN:g}]",
                "give the mean number of trials, e.g. mean: 8 (Papernot & Steinke's bound needs mean >= 1)")
        if d == "truncated_negative_binomial":
            require(self.shape is not None and _number(self.shape) and 0 < self.shape < math.inf,
                    f"{_SETTING}.shape", self.shape, "truncated_negative_binomial needs a finite shape > 0",
                    "give e.g. shape: 0.5 (shape 0 is distribution: logarithmic, an infinite one is poisson)")
            object.__setattr__(self, "shape", float(self.shape))
        else:
            require(self.shape is None, f"{_SETTING}.shape", self.shape, f"{d} has no shape setting",
                    "leave shape out, or use distribution: truncated_negative_binomial")
        object.__setattr__(self, "mean", float(self.mean))

    @property
    def dp_shape(self) -> float:
        """The ``shape`` of ``dp_accounting.RepeatAndSelectDpEvent``: inf (Poisson), 1 (geometric),
        0 (logarithmic) or ``eta``."""
        return {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}.get(self.distribution, self.shape)

    @property
    def point_mass(self) -> bool:
        """``K = 1`` always (mean 1 of a distribution truncated at ``K >= 1``): one run, no selection."""
        return self.distribution != "poisson" and self.mean == 1.0

    @property
    def minimum(self) -> int:
        """The smallest ``K``: 0 for Poisson, else 1."""
        return 0 if self.distribution == "poisson" else 1

    @property
    def gamma(self) -> float | None:
        """The halting probability ``gamma`` with this mean (``None`` for Poisson)."""
        if self.distribution == "poisson":
            return None
        return _gamma(self.dp_shape, self.mean)

    def describe(self) -> str:
        shape = f", shape {self.shape:g}" if self.shape is not None else ""
        return f"{self.distribution} number of trials (mean {self.mean:g}{shape})"

    def as_dict(self) -> dict:
        out = {"distribution": self.distribution, "mean": self.mean}
        return out | ({"shape": self.shape} if self.shape is not None else {})


def trial_count(setting: Mapping | TrialCount, name: str = _SETTING) -> TrialCount:
    """The :class:`TrialCount` of a sweep file's ``private_selection`` mapping, e.g.
    ``{distribution: poisson, mean: 8}`` or ``{distribution: truncated_negative_binomial, mean: 8,
    shape: 0.5}``; anything else is refused naming the setting and the fix."""
    if isinstance(setting, TrialCount):
        return setting
    example = "e.g. {distribution: poisson, mean: 8}"
    require(isinstance(setting, Mapping), name, setting, "must be a mapping", f"write {name}: {example}")
    unknown = sorted(set(setting) - {"distribution", "mean", "shape"})
    require(not unknown, name, dict(setting), f"unknown key(s) {unknown}", "use distribution, mean and (for "
            "truncated_negative_binomial) shape")
    missing = [k for k in ("distribution", "mean") if k not in setting]
    require(not missing, name, dict(setting), f"missing {', '.join(missing)}", f"write {name}: {example}")
    distribution = setting["distribution"]
    require(isinstance(distribution, str), f"{name}.distribution", distribution, "must be a name",
            f"use one of {', '.join(DISTRIBUTIONS)}")
    return TrialCount(distribution.strip().lower(), setting["mean"], setting.get("shape"))


# ------------------------------------------------------------------------------------------- gamma
def _tnb_mean(gamma: float, eta: float) -> float:
    """The mean of the truncated negative binomial (Definition 1): ``eta (1/gamma - 1) /
    (1 - gamma^eta)``, ``(1/gamma - 1) / log(1/gamma)`` for ``eta = 0``."""
    if gamma >= 1.0:
        return 1.0
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 / gamma - 1) / -math.expm1(eta * math.log(gamma))


@lru_cache(maxsize=256)
def _gamma(eta: float, mean: float) -> float:
    """The ``gamma`` whose truncated negative binomial has ``mean`` (geometric: ``1/mean``)."""
    if mean == 1.0:
        return 1.0
    if eta == 1.0:
        return 1.0 / mean
    # the mean falls from infinity (gamma -> 0) to 1 (gamma -> 1); solve on log(gamma)
    f = lambda t: math.log(_tnb_mean(math.exp(t), eta)) - math.log(mean)  # noqa: E731
    lo = -1.0
    while f(lo) < 0:
        lo *= 2
    return math.exp(optimize.brentq(f, lo, -1e-15, xtol=1e-15, rtol=1e-15, maxiter=500))


# ---------------------------------------------------------------------------------------- sampling
def _log_pmf(count: TrialCount, k: np.ndarray) -> np.ndarray:
    """``log P[K = k]`` in float64 (Definition 1; Poisson's pmf for ``poisson``)."""
    if count.distribution == "poisson":
        mu = count.mean
        return -mu + k * math.log(mu) - special.gammaln(k + 1)
    gamma, eta = count.gamma, count.dp_shape
    log_q = math.log1p(-gamma)
    if eta == 0:
        return k * log_q - np.log(k) - math.log(-math.log(gamma))
    norm = math.log(-math.expm1(eta * math.log(gamma))) - eta * math.log(gamma)  # log(gamma^-eta - 1)
    return k * log_q - norm + special.gammaln(k + eta) - special.gammaln(eta) - special.gammaln(k + 1)


@lru_cache(maxsize=32)
def _table(count: TrialCount) -> tuple[np.ndarray, np.ndarray]:
    """The support ``k_min .. k_max`` and ``S(k) = P[K > k]`` on it (normalised; ``S(k_max) = 0``)."""
    n = 64 + int(8 * count.mean)
    while True:
        k = np.arange(count.minimum, count.minimum + n, dtype=np.float64)
        log_p = _log_pmf(count, k)
        ratio = math.exp(log_p[-1] - log_p[-2])  # the tail falls faster than this ratio from here on
        if ratio < 1 and log_p[-1] - math.log1p(-ratio) < math.log(_TAIL):
            break
        n *= 2
    p = np.exp(log_p)
    tail = np.cumsum(p[::-1])[::-1]  # sum_{j >= i}, accumulated from the small end
    survival = np.append(tail[1:], 0.0) / tail[0]
    return k.astype(np.int64), survival


def quantile(count: TrialCount, v: np.ndarray | float) -> np.ndarray:
    """``K = min{k : P[K > k] < v}`` for ``v`` in ``(0, 1]`` (``v = 1 - u``, ``u`` uniform on [0, 1)):
    the inverse-CDF map the sampler applies to its uniform."""
    v = np.asarray(v, dtype=np.float64)
    if count.point_mass:
        return np.ones(v.shape, dtype=np.int64)
    ks, survival = _table(count)
    return ks[np.searchsorted(-survival, -v, side="right")]


def describe_trial_count(count: TrialCount) -> str:
    """The distribution of ``K`` in words, for a plan made before drawing: its support, median and
    95th percentile (from :func:`quantile`) and, for Poisson, ``P[K = 0]`` (a draw that releases
    nothing)."""
    count = trial_count(count)
    if count.point_mass:
        return f"{count.describe()}: K = 1 always (one run, no selection)"
    median, high = int(quantile(count, 0.5)), int(quantile(count, 0.05))
    text = f"{count.describe()}: K >= {count.minimum}, median {median}, P[K > {high}] < 5%"
    if count.distribution == "poisson":
        text += f"; P[K = 0] = {math.exp(-count.mean):.3g} (then nothing is released)"
    return text


def draw_trial_count(source: rng.RandomSource, count: TrialCount | Mapping) -> int:
    """The sweep's number of trials ``K``, from the keyed stream ``(0, SERVER_CLIENT, TRIALS,
    tag="count")`` of ``source`` (the CSPRNG in secure mode). ``0`` (Poisson) releases nothing."""
    count = trial_count(count)
    if count.point_mass:
        return 1
    u = float(source.stream(0, rng.SERVER_CLIENT, TRIALS, tag="count").uniform(1)[0])
    return int(quantile(count, 1.0 - u))


def draw_trial_point(source: rng.RandomSource, trial: int, points: int) -> int:
    """The index (in ``range(points)``) of the point of the sweep's space that trial ``trial`` runs:
    uniform, independent across trials (drawn with replacement), keyed by the trial's index."""
    require(isinstance(trial, (int, np.integer)) and trial >= 0, "trial", trial, "must be an index >= 0",
            "number the trials 0, 1, ...")
    require(isinstance(points, (int, np.integer)) and points >= 1, "sweep space", points,
            "has no point to draw", "give the sweep at least one configuration")
    stream = source.stream(int(trial), rng.SERVER_CLIENT, TRIALS, tag="point")
    full = 1 << 53
    limit = full - full % points  # words below it map uniformly onto range(points)
    while True:
        word = int(float(stream.uniform(1)[0]) * full)  # the 53-bit integer of the uniform, exactly
        if word < limit:
            return word % points


def draw_trial_points(source: rng.RandomSource, trials: int, points: int) -> list[int]:
    """:func:`draw_trial_point` for trials ``0 .. trials-1``."""
    return [draw_trial_point(source, t, points) for t in range(trials)]


__all__ = ["DISTRIBUTIONS", "MAX_MEAN", "TRIALS", "TrialCount", "trial_count", "quantile", "describe_trial_count",
           "draw_trial_count", "draw_trial_point", "draw_trial_points"]
