"""Epsilon of composed releases, from Google's ``dp_accounting`` (RDP, PLD) and Opacus (PRV).

A :class:`Release` describes one use of some mechanisms (``dp_accounting`` events: Gaussian,
Laplace, randomized response for pure-epsilon local randomizers) and the sampling in front of them;
:func:`epsilon` composes it ``steps`` times. Nothing here re-derives a bound the libraries
already implement:

- ``rdp``: ``dp_accounting.rdp.RdpAccountant`` (Mironov 2017; Poisson subsampling: Mironov, Talwar,
  Zhang 2019; sampling without replacement under replace-one: Wang, Balle, Kasiviswanathan 2019),
  with its default orders and the improved RDP-to-DP conversion (Canonne, Kamath, Steinke 2020).
- ``pld``: ``dp_accounting.pld.PLDAccountant`` (privacy loss distributions, pessimistic
  discretisation: a valid upper bound; tight up to the discretisation interval).
- ``prv``: ``opacus.accountants.PRVAccountant`` (Gopi, Lee, Wutschitz 2021).
- the exact Gaussian (:func:`gaussian_epsilon`; Balle & Wang, "Improving the Gaussian Mechanism for
  Differential Privacy", ICML 2018, Thm 8) wherever what is accounted is one Gaussian mechanism: a
  correlated-noise stream without amplification (its Gaussian, and those composed with it, are one
  Gaussian of multiplier ``(sum z_i^-2)^(-1/2)``). Every accountant above is an upper bound on it
  (RDP's conversion ~10% above for the ``ftrl_*`` configs), so it is used whichever was asked for,
  and the result says so.

Where a method does not support a release (PLD and PRV do not handle sampling without
replacement; PRV only add/remove neighbours) the RDP bound, which is valid, is returned and the
result says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import dp_accounting
import numpy as np
from absl import logging as absl_logging
from dp_accounting import pld as dp_pld
from dp_accounting import rdp as dp_rdp
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS, compute_epsilon

from dpfl_lightning.errors import require
from dpfl_lightning.privacy.discrete_accounting import DiscreteNoiseDpEvent, release_epsilon

# dp_accounting warns (via absl) for every RDP order whose series does not converge; that order is
# then excluded, which is what we want. Keep the console readable.
absl_logging.set_verbosity(absl_logging.ERROR)

SAMPLINGS = ("poisson", "without_replacement", "none")
#: ``zero_out``: one unit's contribution replaced by zero, its participation coin, dropout and noise share
#: kept (Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep) Learning without
#: Sampling or Shuffling", ICML 2021, Sec. 2; Ponomareva et al., "How to DP-fy ML", JAIR 2023, zero-out
#: adjacency). It is the relation of distributed noise whose shares come and go with the participants
#: (:attr:`~dpfl_lightning.privacy.mechanisms.Mechanism.share_per_participant`): under add/remove the
#: sum without the client also lacks its share, so the neighbours differ in variance, not only in mean,
#: a gap that grows with the dimension (``d alpha / (4 k^2)`` nats at order ``alpha`` for ``k`` shares)
#: and that no amplification argument covers. Under zero-out both neighbours hold the same shares, the
#: distance is ``C`` as under add/remove, and without sampling the release is add/remove's unsampled
#: one. What it protects: a client's data, not whether it took part. Under Poisson sampling the share
#: still tells the coin (the sum with the client's share has one share more, in both neighbours), so the
#: neighbours are ``(1-q) A + q B_x`` and ``(1-q) A + q B_0`` with ``A`` lacking the share: not
#: add/remove's subsampled pair. The bound used is joint convexity (:func:`~dpfl_lightning.privacy.
#: discrete_accounting.revealed_coin_rdp`), accounted through :func:`~dpfl_lightning.privacy.
#: discrete_accounting.release_epsilon` for every event.
RELATIONS = {"add_remove": NeighboringRelation.ADD_OR_REMOVE_ONE, "replace_one": NeighboringRelation.REPLACE_ONE,
             "zero_out": NeighboringRelation.ADD_OR_REMOVE_ONE}
PLD_DISCRETIZATION = 1e-3  # dp_accounting's default is 1e-4: ~10x slower for a ~1e-4 relative gain


def _effective_gaussian(events: tuple[dp_accounting.DpEvent, ...]) -> float | None:
    """The multiplier of the one Gaussian equivalent to Gaussians applied to the same sample:
    ``(sum z_i^-2)^(-1/2)`` (their privacy losses add as one Gaussian's); ``None`` otherwise."""
    if not events or not all(isinstance(e, dp_accounting.GaussianDpEvent) for e in events):
        return None
    zs = [float(e.noise_multiplier) for e in events]
    if any(z == 0 for z in zs):
        return 0.0
    low = min(zs)  # scaled by the smallest, so that neither z^-2 of a tiny z nor of a huge one leaves the floats
    return low / math.sqrt(sum((low / z) ** 2 for z in zs))


# ------------------------------------------------------------------ the exact Gaussian
EXACT = "exact Gaussian"
EXACT_NOTE = ("one Gaussian mechanism: its exact epsilon (Balle & Wang 2018, Thm 8), which every accountant "
              "bounds from above")


def gaussian_log_delta(noise_multiplier: float, epsilon: float) -> float:
    """``log delta(eps)`` of the Gaussian mechanism of multiplier ``z`` (std over sensitivity): the
    least ``delta`` for which it is ``(eps, delta)``-DP, ``Phi(1/(2z) - eps z) - e^eps Phi(-1/(2z) - eps z)``
    (Balle & Wang 2018, Thm 8), in logs (``log Phi`` from ``scipy.special.log_ndtr``) so that small
    deltas keep their digits."""
    from scipy import special

    z, eps = float(noise_multiplier), float(epsilon)
    a = float(special.log_ndtr(0.5 / z - eps * z))
    b = eps + float(special.log_ndtr(-0.5 / z - eps * z))
    return a + math.log(-math.expm1(b - a)) if b < a else -math.inf


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """The least ``eps >= 0`` with :func:`gaussian_log_delta` ``<= log(delta)``: the exact epsilon of
    the Gaussian mechanism of multiplier ``noise_multiplier`` at ``delta`` (never below it: the root's
    bracket end on the safe side is returned)."""
    from scipy import optimize

    _check(delta)
    z = float(noise_multiplier)
    if z <= 0:
        return math.inf
    if math.isinf(z):
        return 0.0
    target = math.log(delta)
    g = lambda eps: gaussian_log_delta(z, eps) - target  # noqa: E731 - decreasing in eps
    if g(0.0) <= 0:
        return 0.0
    hi = 1.0
    while g(hi) > 0:
        hi *= 2.0
    eps = float(optimize.brentq(g, hi / 2 if hi > 1 else 0.0, hi, xtol=1e-13, rtol=4 * np.finfo(float).eps))
    while g(eps) > 0:  # brentq's root may sit a rounding below the true one
        eps = float(np.nextafter(eps, math.inf))
    return eps


def one_gaussian(events) -> float | None:
    """The multiplier of the one Gaussian that ``(event, relation)`` pairs are, when every event is an
    unsampled Gaussian (or one self-composed) under add/remove neighbours: ``(sum_i n_i z_i^-2)^(-1/2)``
    (their privacy losses add); ``None`` otherwise (sampling, a tree event, another mechanism)."""
    inverse_sq = 0.0
    for event, relation in events:
        count = 1
        if isinstance(event, dp_accounting.SelfComposedDpEvent):
            event, count = event.event, int(event.count)
        if relation != NeighboringRelation.ADD_OR_REMOVE_ONE or not isinstance(event, dp_accounting.GaussianDpEvent):
            return None
        if count == 0:
            continue
        if event.noise_multiplier == 0:
            return 0.0
        inverse_sq += count / float(event.noise_multiplier) ** 2
    return math.inf if inverse_sq == 0 else inverse_sq ** -0.5


@dataclass(frozen=True)
class Release:
    """What one use of a set of mechanisms on the same sample releases about one unit (a client or a
    record), preceded by ``sampling``:

    - ``poisson``: every unit independently with probability ``rate``;
    - ``without_replacement``: a fixed-size sample of ``sample_size`` out of ``population``
      (accounted under ``replace_one``, as the bound requires);
    - ``none``: every unit takes part (``rate = 1``).

    ``events`` are ``dp_accounting`` events of the unsampled mechanisms, in the units of
    ``relation``: a Gaussian's multiplier is its standard deviation over the distance between two
    neighbours' outputs (``C`` under add/remove, ``2C`` under replace-one for a sum of
    ``C``-bounded contributions). Gaussians on the same sample are one Gaussian
    (:attr:`noise_multiplier`).
    """

    events: tuple[dp_accounting.DpEvent, ...]
    sampling: str = "none"
    rate: float = 1.0
    relation: str = "add_remove"
    population: int | None = None
    sample_size: int | None = None
    #: a correlated-noise stream (:class:`~dpfl_lightning.privacy.mechanisms.Stream`): ``events`` are then
    #: the other mechanisms of each participation, and :func:`epsilon` composes the stream's own event
    stream: Any = None
    #: the events are a correlated-noise run's, one Gaussian mechanism (``dpfl sweep`` composes whole runs):
    #: its compositions are accounted with the exact Gaussian, as the run's own ledger does
    exact: bool = False

    def __post_init__(self) -> None:
        require(self.sampling in SAMPLINGS, "privacy.sampling", self.sampling, "unknown sampling", f"use one of {SAMPLINGS}")
        require(self.relation in RELATIONS, "privacy.relation", self.relation, "unknown neighbouring relation",
                f"use one of {tuple(RELATIONS)}")
        require(len(self.events) >= 1 or self.stream is not None, "privacy.events", self.events, "a release needs at least one event",
                "declare the mechanism's event")
        z = self.noise_multiplier
        require(z is None or z >= 0, "noise_multiplier", z, "must be >= 0", "use z >= 0")
        if self.sampling == "poisson":
            require(0 < self.rate <= 1, "sampling_rate", self.rate, "must be in (0, 1]", "use a rate in (0, 1]")
        if self.sampling == "without_replacement":
            require(self.relation == "replace_one", "privacy.relation", self.relation,
                    "sampling without replacement is accounted under replace-one neighbours",
                    "use relation='replace_one' (sensitivity 2C for a sum of C-bounded updates)")
            require(self.population is not None and self.sample_size is not None
                    and 1 <= self.sample_size <= self.population, "sample_size", self.sample_size,
                    "needs 1 <= sample_size <= population", "give population and sample_size")

    @property
    def noise_multiplier(self) -> float | None:
        """The equivalent Gaussian's multiplier when every event is Gaussian, else ``None``."""
        return None if self.stream is not None else _effective_gaussian(self.events)

    @property
    def gaussian(self) -> bool:
        return self.noise_multiplier is not None

    def with_noise_multiplier(self, z: float) -> Release:
        """The same sampling with one Gaussian of multiplier ``z`` (for calibration)."""
        return replace(self, events=(dp_accounting.GaussianDpEvent(z),))

    @property
    def pure_epsilon(self) -> float | None:
        """The epsilon of one unsampled use when every event is pure DP (randomized response,
        Laplace), else ``None``: ``steps`` uses are then also ``steps * pure_epsilon``-DP."""
        total = 0.0
        for e in self.events:
            if isinstance(e, dp_accounting.RandomizedResponseDpEvent) and e.num_buckets == 2 and e.noise_parameter > 0:
                total += math.log((2 - e.noise_parameter) / e.noise_parameter)
            elif isinstance(e, dp_accounting.LaplaceDpEvent) and e.noise_multiplier > 0:
                total += 1.0 / e.noise_multiplier
            else:
                return None
        return total

    @property
    def effective_rate(self) -> float:
        if self.sampling == "poisson":
            return self.rate
        if self.sampling == "without_replacement":
            return self.sample_size / self.population
        return 1.0

    def base_event(self) -> dp_accounting.DpEvent:
        """The unsampled event (Gaussians merged into one)."""
        z = self.noise_multiplier
        if z is not None:
            return dp_accounting.GaussianDpEvent(z)
        return self.events[0] if len(self.events) == 1 else dp_accounting.ComposedDpEvent(list(self.events))

    def dp_event(self) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of one release."""
        inner = self.base_event()
        if self.sampling == "poisson" and self.rate < 1:
            return dp_accounting.PoissonSampledDpEvent(self.rate, inner)
        if self.sampling == "without_replacement" and self.sample_size < self.population:
            return dp_accounting.SampledWithoutReplacementDpEvent(self.population, self.sample_size, inner)
        return inner


def GaussianRelease(noise_multiplier: float, sampling: str = "none", rate: float = 1.0, relation: str = "add_remove",
                    population: int | None = None, sample_size: int | None = None) -> Release:
    """A :class:`Release` of one Gaussian mechanism with multiplier ``std / distance``."""
    return Release((dp_accounting.GaussianDpEvent(float(noise_multiplier)),), sampling, rate, relation, population,
                   sample_size)


@dataclass(frozen=True)
class Epsilon:
    """An epsilon and how it was obtained (``method`` may differ from the one asked for)."""

    epsilon: float
    method: str
    note: str = ""


def _check(delta: float) -> None:
    require(isinstance(delta, (int, float)) and 0 < delta < 1, "delta", delta, "must be in (0, 1)",
            "set delta well below 1/N, e.g. 1e-5")


def _unamplified(release: Release) -> tuple[Release, str]:
    """dp_accounting amplifies only Gaussian (RDP) or Gaussian/Laplace (PLD) events by sampling;
    other releases are accounted as if every unit took part (a valid upper bound)."""
    if release.gaussian or release.sampling == "none":
        return release, ""
    return replace(release, sampling="none", rate=1.0, population=None, sample_size=None), \
        "no amplification by sampling for a non-Gaussian release: upper bound"


@lru_cache(maxsize=256)
def rdp_curve(release: Release) -> np.ndarray:
    """RDP of one release at ``DEFAULT_RDP_ORDERS``, as ``dp_accounting`` computes it.

    Composition multiplies this curve by the number of steps, which is what ``RdpAccountant``
    does for a self-composed event; so ``epsilon`` from it equals the accountant's bit for bit.
    """
    release, _ = _unamplified(release)
    if release.relation == "zero_out" and release.sampling == "poisson" and release.rate < 1:
        # the share shows the coin: joint convexity (RELATIONS), at any order > 1
        from dpfl_lightning.privacy.discrete_accounting import revealed_coin_rdp

        unsampled = rdp_curve(replace(release, sampling="none", rate=1.0))
        return revealed_coin_rdp(unsampled, release.rate, DEFAULT_RDP_ORDERS)
    acc = dp_rdp.RdpAccountant(neighboring_relation=RELATIONS[release.relation])
    acc.compose(release.dp_event())
    return np.array(acc._rdp, dtype=np.float64)  # noqa: SLF001 - the public API only gives epsilon


def _rdp_epsilon(release: Release, steps: int, delta: float) -> float:
    if steps == 0 or release.effective_rate == 0:
        return 0.0
    if release.relation == "zero_out":
        return release_epsilon(release.events, release.sampling, release.effective_rate, steps, delta, "zero_out")[0]
    eps, _ = compute_epsilon(DEFAULT_RDP_ORDERS, steps * rdp_curve(release), delta)
    return float(eps)


@lru_cache(maxsize=64)
def _base_pld(release: Release, discretization: float):
    # Our noise multiplier is std / (distance between the neighbours' outputs) in both relations.
    # dp_accounting's PLD under REPLACE_ONE compares means -s and +s (distance 2s), so an unsampled
    # Gaussian is passed as add/remove (distance 1): for a Gaussian without sampling only the
    # distance matters. (Replace-one is only used here without sampling or with sampling without
    # replacement, which PLD does not handle anyway.)
    relation = RELATIONS["add_remove"] if release.sampling == "none" else RELATIONS[release.relation]
    return dp_pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=release.noise_multiplier, sampling_prob=release.effective_rate,
        value_discretization_interval=discretization, neighboring_relation=relation)


def _unsampled_event_pld(event: dp_accounting.DpEvent, discretization: float):
    """The PLD of one unsampled event in our units (multiplier = scale / distance between the
    neighbours' outputs), whatever the relation: only the distance matters without sampling.
    Randomized response is defined on replaced records, which is its relation."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return dp_pld.privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier, value_discretization_interval=discretization)
    if isinstance(event, dp_accounting.LaplaceDpEvent):
        return dp_pld.privacy_loss_distribution.from_laplace_mechanism(
            parameter=event.noise_multiplier, value_discretization_interval=discretization)
    if isinstance(event, dp_accounting.RandomizedResponseDpEvent):
        return dp_pld.privacy_loss_distribution.from_randomized_response(
            noise_parameter=event.noise_parameter, num_buckets=event.num_buckets,
            value_discretization_interval=discretization)
    raise TypeError(f"no PLD for {type(event).__name__}")


def _pld_epsilon(release: Release, steps: int, delta: float, discretization: float) -> float:
    if steps == 0:
        return 0.0
    if not release.gaussian:
        # One release's PLD, composed over its events and then with itself ``steps`` times.
        # (dp_accounting's PLDAccountant drops the count of a self-composed randomized response.)
        release, _ = _unamplified(release)
        if any(isinstance(e, dp_accounting.RandomizedResponseDpEvent) and e.noise_parameter == 0
               for e in release.events) or any(
                isinstance(e, dp_accounting.LaplaceDpEvent) and e.noise_multiplier == 0 for e in release.events):
            return math.inf
        plds = [_unsampled_event_pld(e, discretization) for e in release.events]
        one = plds[0]
        for other in plds[1:]:
            one = one.compose(other)
        return float(one.self_compose(steps).get_epsilon_for_delta(delta))
    if release.noise_multiplier == 0:
        return math.inf
    return float(_base_pld(release, discretization).self_compose(steps).get_epsilon_for_delta(delta))


def _prv_epsilon(release: Release, steps: int, delta: float) -> float:
    """Opacus's PRV of the (Poisson-subsampled) Gaussian; its multiplier is std / distance, as ours
    (an unsampled replace-one release is the same Gaussian as an add/remove one)."""
    from opacus.accountants import PRVAccountant

    if steps == 0:
        return 0.0
    acc = PRVAccountant()
    acc.history = [(release.noise_multiplier, release.effective_rate, steps)]
    with np.errstate(divide="ignore"):  # Opacus takes log(1 - q) = log(0) for q = 1, harmlessly
        return float(acc.get_epsilon(delta))


class Accountant:
    """One way of composing releases into an epsilon, registered in :data:`ACCOUNTANTS` by ``name``."""

    name = ""

    def unsupported(self, release: Release) -> str | None:
        """Why this accountant cannot account ``release`` (RDP's bound is then given, with this reason),
        or ``None``."""
        return None

    def epsilon(self, release: Release, steps: int, delta: float, pld_discretization: float, note: str) -> Epsilon:
        raise NotImplementedError


class RdpAccountant(Accountant):
    """Renyi DP (``dp_accounting.rdp``): every release the package declares."""

    name = "rdp"

    def epsilon(self, release: Release, steps: int, delta: float, pld_discretization: float, note: str) -> Epsilon:
        return Epsilon(_rdp_epsilon(release, steps, delta), "rdp", note)


class PldAccountant(Accountant):
    """Privacy loss distributions (``dp_accounting.pld``, pessimistic)."""

    name = "pld"

    def unsupported(self, release: Release) -> str | None:
        if release.sampling == "without_replacement":
            return "pld does not support sampling without replacement: RDP upper bound"
        return None

    def epsilon(self, release: Release, steps: int, delta: float, pld_discretization: float, note: str) -> Epsilon:
        return Epsilon(_pld_epsilon(release, steps, delta, pld_discretization), "pld", note)


class PrvAccountant(Accountant):
    """Opacus's privacy random variables: the Poisson-subsampled Gaussian under add/remove."""

    name = "prv"

    def unsupported(self, release: Release) -> str | None:
        if release.sampling == "without_replacement":
            return "prv does not support sampling without replacement: RDP upper bound"
        if not release.gaussian:
            return "prv supports Gaussian releases only: RDP upper bound"
        if release.relation != "add_remove" and release.sampling != "none":
            return "prv supports add/remove neighbours only: RDP upper bound"
        return None

    def epsilon(self, release: Release, steps: int, delta: float, pld_discretization: float, note: str) -> Epsilon:
        return Epsilon(_prv_epsilon(release, steps, delta), "prv")


#: every accountant by the name a configuration gives (``accountant: pld``)
ACCOUNTANTS: dict[str, type[Accountant]] = {a.name: a for a in (RdpAccountant, PldAccountant, PrvAccountant)}


def create_accountant(name: str, setting: str = "privacy.accountant") -> Accountant:
    """The accountant named ``name``; an unknown name is refused naming ``setting`` and the valid names."""
    require(name in ACCOUNTANTS, setting, name, "unknown accountant", f"use one of {', '.join(ACCOUNTANTS)}")
    return ACCOUNTANTS[name]()


def accountant_used(release: Release, accountant: str) -> tuple[str, str | None]:
    """The accountant that gives ``release``'s epsilon when ``accountant`` is asked for: itself, the
    exact Gaussian where the release is one Gaussian mechanism (with the reason), or ``rdp`` with the
    reason where it cannot account the release (:meth:`Accountant.unsupported`)."""
    if release.stream is not None and one_gaussian(
            stream_events(release, release.stream.start + release.stream.rounds)) is not None:
        return EXACT, EXACT_NOTE
    if release.exact and release.gaussian and release.effective_rate == 1 and release.relation == "add_remove":
        return EXACT, EXACT_NOTE
    if release.relation == "zero_out" and accountant != "rdp":
        return "rdp", f"{accountant} does not account zero-out neighbours (their RDP bound): RDP upper bound"
    reason = create_accountant(accountant).unsupported(release)
    return ("rdp", reason) if reason is not None else (accountant, None)


def epsilon(release: Release, steps: int, delta: float, accountant: str = "rdp",
            pld_discretization: float = PLD_DISCRETIZATION) -> Epsilon:
    """Epsilon at ``delta`` after ``steps`` compositions of ``release``."""
    _check(delta)
    acc = create_accountant(accountant)
    require(isinstance(steps, (int, np.integer)) and not isinstance(steps, bool) and steps >= 0, "steps", steps,
            "must be a whole number of compositions >= 0", "count compositions (rounds, local steps) as integers")
    if release.stream is not None:
        return stream_epsilon(release, int(steps), delta, acc.name, pld_discretization)
    if release.relation == "zero_out" or any(isinstance(e, DiscreteNoiseDpEvent) for e in release.events):
        # integer noise, or shares that leave with their client: their own RDP curves
        eps, note = release_epsilon(release.events, release.sampling, release.effective_rate, int(steps), delta,
                                    release.relation)
        return Epsilon(eps, "rdp", note or ("" if acc.name == "rdp" else
                                            f"{acc.name} does not account integer noise: RDP upper bound"))
    if release.noise_multiplier == 0 and steps > 0 and release.effective_rate > 0:
        return Epsilon(math.inf, acc.name, "no noise")
    if release.exact and release.gaussian and release.effective_rate == 1 and release.relation == "add_remove":
        z = release.noise_multiplier / math.sqrt(steps) if steps else math.inf
        return Epsilon(gaussian_epsilon(z, delta), EXACT, EXACT_NOTE)
    note = _unamplified(release)[1]
    pure = release.pure_epsilon
    if pure is not None:  # basic composition of pure DP is valid too, and tighter for few steps
        res = _epsilon(acc, release, steps, delta, pld_discretization, note)
        if steps * pure < res.epsilon:
            return Epsilon(steps * pure, "basic composition", "pure DP, composed linearly")
        return res
    return _epsilon(acc, release, steps, delta, pld_discretization, note)


def _epsilon(acc: Accountant, release: Release, steps: int, delta: float, pld_discretization: float,
             note: str) -> Epsilon:
    """``acc``'s epsilon, or RDP's upper bound (with the reason) for a release it cannot account."""
    unsupported = acc.unsupported(release)
    if unsupported is not None:
        return Epsilon(_rdp_epsilon(release, steps, delta), "rdp", unsupported)
    return acc.epsilon(release, steps, delta, pld_discretization, note)


def stream_events(release: Release, rounds: int) -> list[tuple[dp_accounting.DpEvent, NeighboringRelation]]:
    """The ``dp_accounting`` events of ``rounds`` rounds of a correlated-noise release: the stream's,
    and the other mechanisms of the guarantee once per participation (``ceil(rounds / min_sep)``: a
    client's data enters them in its group's rounds only), each with the relation it is defined in
    (a tree's event is ``REPLACE_SPECIAL``: one client's updates replaced by zeros, sensitivity ``C``,
    which is add/remove for a sum). Per-participation streams merge the others into each participation's
    Gaussian, so that amplification (Poisson inside the group) covers them too. A stream restarted on a
    secure resume composes the events of each segment over its own rounds (``Stream.segments``)."""
    others = _effective_gaussian(release.events) if release.events else None
    if release.events and others is None:
        raise ValueError("a correlated-noise stream composes with Gaussian mechanisms only")
    return [e for seg, n in release.stream.segments(rounds) for e in _segment_events(seg, others, n)]


def _segment_events(s: Any, others: float | None,
                    rounds: int) -> list[tuple[dp_accounting.DpEvent, NeighboringRelation]]:
    add = NeighboringRelation.ADD_OR_REMOVE_ONE
    k = s.participations(rounds)
    if rounds == 0 or k == 0:
        return []
    if s.kind == "participations":
        z = s.noise_multiplier if others is None else _effective_gaussian(
            (dp_accounting.GaussianDpEvent(s.noise_multiplier), dp_accounting.GaussianDpEvent(others)))
        one = dp_accounting.GaussianDpEvent(z)
        if s.rate < 1:
            one = dp_accounting.PoissonSampledDpEvent(s.rate, one)
        return [(dp_accounting.SelfComposedDpEvent(one, k), add)]
    out = [(s.event(rounds), NeighboringRelation.REPLACE_SPECIAL if s.kind == "tree" else add)]
    if others is not None:
        out.append((dp_accounting.GaussianDpEvent(others / math.sqrt(k)), add))
    return out


def stream_epsilon(release: Release, rounds: int, delta: float, accountant: str = "rdp",
                   pld_discretization: float = PLD_DISCRETIZATION) -> Epsilon:
    """Epsilon after ``rounds`` rounds of a correlated-noise release (:func:`stream_events`): the
    exact Gaussian where the events are one Gaussian mechanism (:func:`one_gaussian`: no amplification,
    no tree event), whichever accountant was asked for; otherwise RDP curves summed over the events
    (``dp_accounting.rdp``), or ``dp_accounting.pld`` where every event is Gaussian or Poisson-sampled
    Gaussian; a tree's event and the ``prv`` accountant are given RDP's bound, with the reason."""
    events = stream_events(release, rounds)
    if not events:
        return Epsilon(0.0, accountant)
    z = one_gaussian(events)
    if z is not None:  # no amplification, no tree event: the exact Gaussian
        return Epsilon(gaussian_epsilon(z, delta), EXACT, EXACT_NOTE)
    tree = any(rel == NeighboringRelation.REPLACE_SPECIAL for _, rel in events)
    if accountant == "pld" and not tree:
        acc = dp_pld.PLDAccountant(value_discretization_interval=pld_discretization)
        for event, _ in events:
            acc.compose(event)
        return Epsilon(float(acc.get_epsilon(delta)), "pld")
    note = "" if accountant == "rdp" else (
        f"{accountant} does not account a tree aggregation event: RDP upper bound" if tree else
        f"{accountant} does not account correlated-noise streams: RDP upper bound")
    total = np.zeros(len(DEFAULT_RDP_ORDERS))
    for event, relation in events:
        acc = dp_rdp.RdpAccountant(neighboring_relation=relation)
        acc.compose(event)
        total = total + np.array(acc._rdp, dtype=np.float64)  # noqa: SLF001 - the curve, to sum across relations
    eps, _ = compute_epsilon(DEFAULT_RDP_ORDERS, total, delta)
    return Epsilon(float(eps), "rdp", note)


# ---------------------------------------------------------------------------------------------
# A vectorised copy of dp_accounting's RDP of the Poisson-subsampled Gaussian, used only to
# bracket roots quickly during calibration (results are then checked with dp_accounting itself).
# Same formulas (Mironov, Talwar, Zhang 2019, Sec. 3.3) and the same series truncation rule.
# ---------------------------------------------------------------------------------------------
_ORDERS = np.array(DEFAULT_RDP_ORDERS, dtype=np.float64)
_INT = _ORDERS == np.floor(_ORDERS)
_FRAC_TERMS = 1000


def _log_comb(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    from scipy import special

    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def fast_rdp_poisson_gaussian(q: float, z: float) -> np.ndarray:
    """RDP at ``DEFAULT_RDP_ORDERS`` of one Poisson(q)-subsampled Gaussian with multiplier ``z``."""
    from scipy import special

    if q == 0:
        return np.zeros_like(_ORDERS)
    if z == 0:
        return np.full_like(_ORDERS, np.inf)
    if q == 1:
        return _ORDERS / (2 * z**2)
    out = np.empty_like(_ORDERS)
    lq, l1q = math.log(q), math.log1p(-q)
    # integer orders: log A = logsumexp_i [log C(a, i) + i log q + (a - i) log(1 - q) + (i^2 - i) / (2 z^2)]
    a = _ORDERS[_INT][:, None]
    i = np.arange(int(a.max()) + 1, dtype=np.float64)[None, :]
    terms = np.where(i <= a, _log_comb(a, np.minimum(i, a)) + i * lq + (a - i) * l1q + (i * i - i) / (2 * z * z), -np.inf)
    out[_INT] = special.logsumexp(terms, axis=1) / (a[:, 0] - 1)
    # fractional orders: the two-sided series, truncated where dp_accounting stops summing
    a = _ORDERS[~_INT][:, None]
    i = np.arange(_FRAC_TERMS, dtype=np.float64)[None, :]
    j = a - i
    z0 = z * z * math.log(1 / q - 1) + 0.5
    log_coef = _log_comb(a, i)
    log_e0 = math.log(0.5) + math.log(2) + special.log_ndtr(-((i - z0) / (math.sqrt(2) * z)) * 2**0.5)
    log_e1 = math.log(0.5) + math.log(2) + special.log_ndtr(-((z0 - j) / (math.sqrt(2) * z)) * 2**0.5)
    s0 = log_coef + i * lq + j * l1q + (i * i - i) / (2 * z * z) + log_e0
    s1 = log_coef + j * lq + i * l1q + (j * j - j) / (2 * z * z) + log_e1
    total = np.logaddexp(np.logaddexp.accumulate(s0, axis=1), np.logaddexp.accumulate(s1, axis=1))
    done = np.zeros_like(s0, dtype=bool)
    done[:, 1:] = (s0[:, 1:] < s0[:, :-1]) & (s1[:, 1:] < s1[:, :-1]) & (np.maximum(s0, s1)[:, 1:] < total[:, 1:] - 30)
    first = np.argmax(done, axis=1)
    log_a = np.where(done.any(axis=1), total[np.arange(len(first)), first], np.inf)
    out[~_INT] = log_a / (a[:, 0] - 1)
    return out


def fast_rdp_epsilon(release: Release, steps: int, delta: float) -> float:
    """Like the ``rdp`` accountant, for Poisson / no sampling under add/remove; for bracketing."""
    if release.sampling == "without_replacement" or release.relation != "add_remove" or not release.gaussian:
        return _rdp_epsilon(release, steps, delta)
    curve = fast_rdp_poisson_gaussian(release.effective_rate, release.noise_multiplier)
    eps, _ = compute_epsilon(DEFAULT_RDP_ORDERS, steps * curve, delta)
    return float(eps)
