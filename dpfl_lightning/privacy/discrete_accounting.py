"""Privacy of integer noise summed under secure aggregation, and the grid that keeps the sum in range.

Threat model (audience ``client_distributed``): a server that sees only the modular sum of the
cohort's rows; every client in the sum added its noise share; the unit is one client's whole
update, its curves in the units of add/remove (distance ``C``; replace-one doubles it). Towards model
observers the ledger states them under zero-out neighbours, whose distance is the same
(:data:`~dpfl_lightning.privacy.accountants.RELATIONS`; Poisson sampling: :func:`revealed_coin_rdp`).

Everything is in *grid units*: a client's update ``x`` (L2 norm <= ``clip``) is rotated, divided by
the granularity ``gamma`` and rounded; its integer vector has L2 norm at most
:func:`rounded_l2_bound` (conditional rounding enforces it, see
:mod:`dpfl_lightning.privacy.quantization`) and L1 norm at most :func:`rounded_l1_bound`.

- **Distributed discrete Gaussian** (Kairouz, Liu, Steinke, ICML 2021, Theorem 1 and its RDP form,
  Proposition 14 / eq. (17) of arXiv:2102.06387): ``n`` clients each add ``N_Z(0, sigma^2)^d``
  (``sigma`` in grid units, ``>= 1/2``); with ``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2
  k/(k+1))``, the sum is (alpha, eps(alpha))-RDP with ``eps(alpha)`` the least of
  ``alpha D2^2/(2 n sigma^2) + tau d``,
  ``alpha/2 (D2^2/(n sigma^2) + 2 D1 tau/(sqrt(n) sigma) + tau^2 d)`` and
  ``alpha/2 (D2/(sqrt(n) sigma) + tau sqrt(d))^2``.
- **Skellam** (Agarwal, Kairouz, Liu, NeurIPS 2021, Theorem 3.5 with the sum's parameter): noise
  ``Sk(mu, mu)^d`` in total (variance ``2 mu`` a coordinate) is RDP with ``eps(alpha) = alpha
  D2^2/(4 mu) + min(((2 alpha - 1) D2^2 + 6 D1)/(16 mu^2), 3 D1/(4 mu))``.

Each bound is a minimum of (xi, rho)-zCDP curves (``xi + rho alpha``), so ``dp_accounting`` can
hold each candidate as a ``ZCDpEvent`` (:meth:`DiscreteRdp.zcdp_events`), but neither a minimum of
events nor a ``PoissonSampledDpEvent`` around a ``ZCDpEvent`` is something its ``RdpAccountant``
composes. What is provided, and what the ledger should compose: :meth:`DiscreteRdp.rdp` (the
per-order minimum, at integer orders), :func:`poisson_subsampled_rdp` (Zhu & Wang, ICML 2019,
Theorem 9: the general upper bound for a Poisson-sampled mechanism at integer orders ``alpha >=
2``), summed over rounds order by order, and converted with ``dp_accounting``'s
``rdp.compute_epsilon`` (:func:`epsilon_from_rdp`). Without sampling, the ``ZCDpEvent`` of the
best candidate (:meth:`DiscreteRdp.best_zcdp_event`) composes in ``dp_accounting.rdp.RdpAccountant``.

The modulus: :func:`wraparound_probability` bounds (Chernoff, from the settings alone) the chance
that a coordinate of the sum leaves ``[-2^(b-1), 2^(b-1))``, and :func:`choose_gamma` picks the
finest grid that keeps it below a target, refusing a bit width that cannot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import dp_accounting
import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
from scipy import optimize, special

from dpfl_lightning.errors import ConfigError, require

#: integer RDP orders (the sampled bound needs integers); dp_accounting's defaults up to 256 are a superset's integers
ORDERS = tuple(range(2, 129)) + (160, 192, 256)
MECHANISMS = ("discrete_gaussian", "skellam")


# ------------------------------------------------------------------------------ sensitivity
def rounded_l2_bound(scaled_clip: float, dim: int, beta: float) -> float:
    """The L2 bound that conditional randomized rounding enforces on a vector of norm at most
    ``scaled_clip`` (grid units) in ``dim`` coordinates (Kairouz et al., Theorem 1's rounding
    bound): ``min(c + sqrt(d), sqrt(c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2)))``; ``beta``
    bounds the chance that one rounding exceeds it (``beta = 0``: ``c + sqrt(d)``, never exceeded)."""
    require(scaled_clip > 0 and math.isfinite(scaled_clip), "scaled_clip", scaled_clip, "must be > 0", "clip > 0")
    require(int(dim) == dim and dim >= 1, "dim", dim, "must be a positive integer", "give the padded dimension")
    require(0 <= beta < 1, "beta", beta, "must be in [0, 1)", "use e.g. beta = exp(-0.5)")
    c, d = float(scaled_clip), float(dim)
    always = c + math.sqrt(d)
    if beta == 0:
        return always
    likely = math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(d) / 2))
    return min(always, likely)


def rounded_l1_bound(l2_bound: float, dim: int) -> float:
    """L1 bound of an integer vector of L2 norm <= ``l2_bound``: ``sqrt(d) l2`` (Cauchy-Schwarz)
    and ``l2^2`` (``|v_i| <= v_i^2`` for integers)."""
    return l2_bound * min(math.sqrt(dim), l2_bound)


# ------------------------------------------------------------------------------ RDP curves
def ddg_tau(sigma: float, n: int) -> float:
    """Kairouz et al.'s ``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))``."""
    k = np.arange(1, n, dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * sigma**2 * k / (k + 1.0))))


@dataclass(frozen=True)
class DiscreteRdp:
    """One round's privacy of the summed integer noise, before sampling, as a minimum of
    ``xi + rho alpha`` curves (``candidates``: ``(rho, xi)`` pairs; Skellam's ``xi`` can be
    negative, the paper's curve is then below a zCDP event's)."""

    mechanism: str
    candidates: tuple[tuple[float, float], ...]
    l2: float
    l1: float
    description: str

    def rdp(self, orders=ORDERS) -> np.ndarray:
        """``eps(alpha)`` at ``orders`` (the least candidate at each order)."""
        a = np.asarray(orders, dtype=np.float64)
        return np.min([xi + rho * a for rho, xi in self.candidates], axis=0)

    def zcdp_events(self) -> tuple[dp_accounting.ZCDpEvent, ...]:
        """Each candidate as a ``dp_accounting.ZCDpEvent`` (each alone is a valid bound; a negative
        ``xi``, which the event refuses, is raised to 0: a weaker but valid bound)."""
        return tuple(dp_accounting.ZCDpEvent(rho=rho, xi=max(0.0, xi)) for rho, xi in self.candidates)

    def best_zcdp_event(self, delta: float, steps: int = 1) -> dp_accounting.ZCDpEvent:
        """The candidate giving the least epsilon after ``steps`` unsampled rounds."""
        return min(self.zcdp_events(), key=lambda e: epsilon_from_rdp(steps * (e.xi + e.rho * np.asarray(ORDERS)), delta))


def ddg_rdp(l2: float, l1: float, sigma: float, n: int, dim: int) -> DiscreteRdp:
    """The distributed discrete Gaussian: ``n`` clients each adding ``N_Z(0, sigma^2)^dim``
    (``sigma`` in grid units) to integer vectors of L2/L1 sensitivity ``l2``/``l1`` (grid units)."""
    require(sigma >= 0.5, "discrete_gaussian sigma (grid units)", sigma, "must be >= 1/2 for Kairouz et al.'s bound",
            "use a finer grid (smaller gamma) or more noise")
    require(int(n) == n and n >= 1, "n", n, "must be a positive integer", "give the number of clients whose noise is summed")
    tau = ddg_tau(sigma, n)
    s2 = n * sigma**2
    e2 = l2**2 / s2
    cands = ((e2 / 2, tau * dim),
             ((e2 + 2 * l1 * tau / math.sqrt(s2) + tau**2 * dim) / 2, 0.0),
             ((l2 / math.sqrt(s2) + tau * math.sqrt(dim)) ** 2 / 2, 0.0))
    return DiscreteRdp("discrete_gaussian", cands, l2, l1,
                       f"distributed discrete Gaussian: {n} x N_Z(0, {sigma:.4g}^2) in {dim} coordinates, "
                       f"sensitivity L2 {l2:.4g} / L1 {l1:.4g} grid units, tau {tau:.3g}")


def skellam_rdp(l2: float, l1: float, mu: float) -> DiscreteRdp:
    """Skellam noise ``Sk(mu, mu)`` a coordinate in the sum (variance ``2 mu``; ``n`` clients with
    ``Sk(mu/n, mu/n)`` each), on integer vectors of sensitivity ``l2``/``l1`` (grid units)."""
    require(mu > 0, "skellam mu", mu, "must be > 0", "add noise")
    rho = l2**2 / (4 * mu)
    cands = ((rho + 2 * l2**2 / (16 * mu**2), (6 * l1 - l2**2) / (16 * mu**2)),
             (rho, 3 * l1 / (4 * mu)))
    return DiscreteRdp("skellam", cands, l2, l1,
                       f"Skellam Sk({mu:.4g}, {mu:.4g}) summed, sensitivity L2 {l2:.4g} / L1 {l1:.4g} grid units")


def poisson_subsampled_rdp(rdp: np.ndarray, q: float, orders=ORDERS) -> np.ndarray:
    """RDP at integer ``orders >= 2`` of a mechanism with RDP ``rdp`` (at those orders, which must
    include 2 and every order below each one used) run on a Poisson sample of rate ``q`` (Zhu &
    Wang 2019, Theorem 9, add/remove neighbours); never more than the unsampled ``rdp``."""
    orders = [int(a) for a in orders]
    require(all(a >= 2 for a in orders), "orders", orders, "must be integers >= 2", "use discrete_accounting.ORDERS")
    rdp = np.asarray(rdp, dtype=np.float64)
    if q >= 1:
        return rdp.copy()
    eps = dict(zip(orders, rdp))
    out = np.empty(len(orders))
    for i, a in enumerate(orders):
        need = [l for l in range(2, a + 1) if l not in eps]
        if need:
            out[i] = rdp[i]
            continue
        terms = [(a - 1) * math.log1p(-q) + math.log(a * q - q + 1),
                 math.log(special.comb(a, 2)) + 2 * math.log(q) + (a - 2) * math.log1p(-q) + eps[2]]
        for l in range(3, a + 1):
            terms.append(math.log(3.0) + special.gammaln(a + 1) - special.gammaln(l + 1) - special.gammaln(a - l + 1)
                         + l * math.log(q) + (a - l) * math.log1p(-q) + (l - 1) * eps[l])
        out[i] = min(rdp[i], special.logsumexp(terms) / (a - 1))
    return out


def revealed_coin_rdp(rdp: np.ndarray, q: float, orders=ORDERS) -> np.ndarray:
    """RDP at ``orders`` of a mechanism with RDP ``rdp`` run on a Poisson(``q``) sample whose coin the
    output may reveal, under zero-out neighbours: ``(1/(alpha-1)) ln(1 - q + q e^{(alpha-1) rdp})``,
    never above ``rdp``.

    The case: distributed noise whose client adds its share only when sampled. Both zero-out neighbours
    keep the client's coin and share, so given the other clients' coins they are ``(1-q) A + q B_x`` and
    ``(1-q) A + q B_0`` (``A``: the sum without the client's share; ``B_x``, ``B_0``: with its share, and
    its update or zero), not add/remove's ``(1-q) A + q A_x`` vs ``A``: the extra share gives ``B``
    heavier tails, where the coin shows, and add/remove's amplification (Zhu & Wang 2019) does not
    hold (tests/test_zero_out.py finds pairs 20x above it). ``int p^alpha q^(1-alpha)`` is jointly
    convex (the perspective of ``t^alpha``; van Erven & Harremoes, "Renyi Divergence and
    Kullback-Leibler Divergence", IEEE Trans. IT 2014, Thm 13), so ``e^{(alpha-1) D}`` of the mixtures
    is at most ``(1-q) e^0 + q e^{(alpha-1) D(B_x || B_0)}``, in both directions, and ``D(B_x || B_0)
    <= rdp`` (the extra shares beyond the accounted ones are independent noise on both: post-processing);
    the other clients' coins mix identical weights in both neighbours, so the bound holds for the mixture."""
    a = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    if q >= 1:
        return rdp.copy()
    val = np.logaddexp(math.log1p(-q), math.log(q) + (a - 1) * rdp)  # ln(1 - q + q e^t), without overflow
    return np.minimum(rdp, val / (a - 1))


def epsilon_from_rdp(rdp: np.ndarray, delta: float, orders=ORDERS) -> float:
    """Epsilon at ``delta`` of a composed RDP curve (``dp_accounting``'s conversion)."""
    return float(compute_epsilon(np.asarray(orders, dtype=np.float64), np.asarray(rdp), delta)[0])


def round_rdp(mechanism: str, clip: float, gamma: float, dim: int, beta: float, local_std: float, n: int) -> DiscreteRdp:
    """One round's :class:`DiscreteRdp` from the settings: updates clipped to ``clip``, grid
    ``gamma``, ``dim`` (padded) coordinates, rounding's ``beta``, each of ``n`` clients adding noise
    of standard deviation ``local_std`` (original units: ``N_Z(0, (local_std/gamma)^2)`` or
    Skellam of parameter ``(local_std/gamma)^2 / 2``). The sensitivity is the rounded bound."""
    require(mechanism in MECHANISMS, "mechanism", mechanism, "unknown", f"use one of {MECHANISMS}")
    require(gamma > 0 and local_std > 0, "gamma/local_std", (gamma, local_std), "must be > 0", "give positive values")
    l2 = rounded_l2_bound(clip / gamma, dim, beta)
    l1 = rounded_l1_bound(l2, dim)
    s = local_std / gamma
    if mechanism == "discrete_gaussian":
        return ddg_rdp(l2, l1, s, n, dim)
    return skellam_rdp(l2, l1, n * s * s / 2)


# ------------------------------------------------------------------------------ the modulus
def _log_tail(a: float, subgaussian_var: float, skellam_mu: float) -> float:
    """``ln P(S >= a)`` bound (Chernoff) for ``S`` = a ``subgaussian_var``-sub-Gaussian variable plus
    an independent ``Sk(skellam_mu, skellam_mu)`` (log-MGF ``2 mu (cosh t - 1)``)."""
    v, mu = subgaussian_var, skellam_mu

    def f(t: float) -> float:
        return t * t * v / 2 + 2 * mu * (math.cosh(t) - 1) - t * a

    if mu == 0:
        return -a * a / (2 * v)
    hi = min(a / (v + 2 * mu), 700.0)  # f' >= t (v + 2 mu) - a: the minimum lies below; cosh overflows past 710
    best = optimize.minimize_scalar(f, bounds=(0.0, hi), method="bounded", options={"xatol": 1e-12 * max(hi, 1e-300)})
    return min(f(best.x), f(hi), 0.0)


def wraparound_probability(bits: int, gamma: float, clip: float, n: int, dim: int, local_std: float,
                           mechanism: str, signal_norm: float | None = None, rho: float = 1.0) -> float:
    """A bound on the probability that one coordinate of the cohort's integer sum leaves
    ``[-2^(bits-1), 2^(bits-1))`` (a wrap-around), from the settings alone (Chernoff):

    - the signal: ``H D (sum x_i) / gamma`` with random signs ``D`` is sub-Gaussian with variance
      proxy ``rho ||sum x_i||^2 / (gamma^2 dim)``, ``||sum x_i|| <= signal_norm`` (default
      ``n clip``; ``rho = 1`` for the randomized Hadamard rotation);
    - rounding: ``n`` independent mean-zero errors of range 1: proxy ``n / 4`` (conditioning on
      the norm bound is ignored, as in the papers);
    - noise: ``n`` discrete Gaussians ``N_Z(0, s^2)`` (``s = local_std / gamma``; proxy ``n s^2``,
      CKS 2020) or Skellam ``Sk(n s^2 / 2, n s^2 / 2)``.

    Multiply by ``dim`` for the chance that any coordinate of a round wraps (union bound)."""
    require(mechanism in MECHANISMS, "mechanism", mechanism, "unknown", f"use one of {MECHANISMS}")
    norm = n * clip if signal_norm is None else signal_norm
    s = local_std / gamma
    var = rho * (norm / gamma) ** 2 / dim + n / 4
    mu = 0.0
    if mechanism == "discrete_gaussian":
        var += n * s * s
    else:
        mu = n * s * s / 2
    return min(1.0, 2 * math.exp(_log_tail(2.0 ** (bits - 1), var, mu)))


@dataclass(frozen=True)
class GridChoice:
    """The granularity :func:`choose_gamma` chose and what it implies (all from the settings)."""

    gamma: float
    bits: int
    noise_std_grid: float  # a client's noise standard deviation in grid units
    wraparound_per_coordinate: float
    wraparound_any_coordinate: float  # in one round, union bound over the coordinates


def choose_gamma(bits: int, clip: float, n: int, dim: int, local_std: float, mechanism: str,
                 target: float = 1e-9, signal_norm: float | None = None, rho: float = 1.0,
                 max_noise_grid_std: float = 2.0**12) -> GridChoice:
    """The finest grid ``gamma`` whose :func:`wraparound_probability` stays below ``target`` (per
    coordinate), as the papers choose it (the sum within the modulus with room for its spread),
    but no finer than ``local_std / max_noise_grid_std`` (rounding then adds < 2^-26 of the
    noise's variance, and the Skellam sampler's parameter stays small). Refuses (ConfigError
    naming ``bits``) a bit width that cannot hold the sum: when the rounding errors alone would
    wrap around, or when the discrete Gaussian would need less than half a grid step of noise."""
    require(1 <= bits <= 62, "bits", bits, "must be in [1, 62]", "use a bit width between 8 and 62")
    require(0 < target < 1, "wraparound target", target, "must be in (0, 1)", "use e.g. 1e-9")

    def wrap(g: float) -> float:
        return wraparound_probability(bits, g, clip, n, dim, local_std, mechanism, signal_norm, rho)

    floor_rate = 2 * math.exp(-(2.0 ** (bits - 1)) ** 2 / (2 * n / 4))
    if floor_rate > target / 2:
        need = math.ceil(1 + math.log2(math.sqrt(2 * (n / 4) * math.log(4 / target))))
        raise ConfigError("bits", bits, f"a sum of {n} clients' rounding errors alone wraps around modulo 2^{bits} "
                          f"with probability {floor_rate:.2g} per coordinate (target {target:.2g})",
                          f"use at least {need + 1} bits, fewer clients per round, or a larger wrap-around target")
    lo, hi = 1e-12 * (local_std + clip), 1.0 * (local_std + clip)
    while wrap(hi) > target:
        hi *= 4
    for _ in range(200):  # bisection in log space for the smallest gamma meeting the target
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if wrap(mid) <= target else (mid, hi)
        if hi / lo < 1 + 1e-9:
            break
    gamma = max(hi, local_std / max_noise_grid_std)
    s = local_std / gamma
    if mechanism == "discrete_gaussian" and s < 0.5:
        raise ConfigError("bits", bits, f"holding the sum needs a grid of {gamma:.3g}, where each client's discrete "
                          f"Gaussian is {s:.3g} grid steps wide (Kairouz et al.'s bound needs >= 1/2)",
                          "use more bits, fewer clients per round or more noise")
    p = wrap(gamma)
    return GridChoice(gamma, bits, s, p, min(1.0, dim * p))


# ------------------------------------------------------------------------------ as a ledger event
@dataclass(frozen=True)
class DiscreteNoiseDpEvent(dp_accounting.DpEvent):
    """One round of integer noise summed under secure aggregation, as a ``dp_accounting`` event
    carrying its RDP curve (:class:`DiscreteRdp`, in the units of the neighbouring relation it was
    built for). ``dp_accounting``'s accountants do not compose it (a minimum of zCDP curves, and
    nothing amplifies a ``ZCDpEvent`` by sampling there): :func:`release_epsilon` does, order by order."""

    curve: DiscreteRdp


def _event_rdp(event: dp_accounting.DpEvent, orders=ORDERS) -> np.ndarray:
    """The unsampled RDP curve of one event at ``orders``: a :class:`DiscreteNoiseDpEvent`'s own,
    any other through ``dp_accounting.rdp.RdpAccountant`` (Gaussian, zCDP, Laplace ...)."""
    if isinstance(event, DiscreteNoiseDpEvent):
        return event.curve.rdp(orders)
    from dp_accounting import rdp as dp_rdp

    acc = dp_rdp.RdpAccountant(orders=[float(a) for a in orders])
    acc.compose(event)
    return np.array(acc._rdp, dtype=np.float64)  # noqa: SLF001 - the curve, to sum with the discrete one


def release_rdp(events, sampling: str, rate: float, orders=ORDERS, relation: str = "add_remove") -> np.ndarray:
    """The RDP at integer ``orders`` of one release of ``events`` (applied to the same sample, so
    their curves add) behind the run's sampling: Poisson at ``rate`` amplifies through Zhu & Wang's
    Theorem 9 (:func:`poisson_subsampled_rdp`, add/remove), or, under ``relation="zero_out"`` (shares
    that come with the participant), by joint convexity (:func:`revealed_coin_rdp`); other samplings are
    not amplified (an upper bound). Cached (the ledger asks for the same release every round, and at
    several deltas)."""
    key = (tuple(events), sampling, float(rate), tuple(orders), relation)
    try:
        hash(key)
    except TypeError:  # an event holding a list (ComposedDpEvent): not cached
        return _release_rdp.__wrapped__(*key)
    return _release_rdp(*key).copy()


@lru_cache(maxsize=64)
def _release_rdp(events: tuple, sampling: str, rate: float, orders: tuple, relation: str) -> np.ndarray:
    total = np.sum([_event_rdp(e, orders) for e in events], axis=0)
    if sampling == "poisson" and rate < 1:
        if relation == "zero_out":
            return revealed_coin_rdp(total, rate, orders)
        return poisson_subsampled_rdp(total, rate, orders)
    return total


def release_epsilon(events, sampling: str, rate: float, steps: int, delta: float,
                    relation: str = "add_remove") -> tuple[float, str]:
    """``(epsilon, note)`` after ``steps`` releases of ``events`` (:func:`release_rdp` summed over the
    steps, converted with ``dp_accounting``'s ``compute_epsilon``)."""
    if steps == 0 or rate == 0:
        return 0.0, ""
    note = "" if sampling in ("poisson", "none") or rate >= 1 else \
        f"no amplification by {sampling} sampling for integer noise: upper bound"
    return epsilon_from_rdp(steps * release_rdp(events, sampling, rate, relation=relation), delta), note
