"""PrivUnit + ScalarDP: the pure-DP local randomizer of paper 002's Appendix D, as plain math.

Paper 002 (DP-FedEXP), Appendix D, randomizes a client's update ``x`` (``||x|| <= C``) as

    c = ScalarDP(||x||; eps2, C) * PrivUnit(x / ||x||; eps0, eps1)

(Alg. 3 PrivUnit, Alg. 4 ScalarDP, both from Bhowmick, Duchi, Freudiger, Kapoor, Rogers 2018,
"Protection against reconstruction and its applications in private federated learning", where
they are PrivUnit2 and ScalarDP), and lets the server estimate ``||x||^2`` from ``c`` alone
(Alg. 5, Lemma D.3) for its extrapolated step size. This module holds the math only: constants,
samplers, the norm estimator. No plugin code.

**Privacy claim.** For a fixed ``(d, eps0, eps1, eps2, C)`` each call of :func:`privatize` on one
client's ``x`` releases ``c``, which is pure ``(eps0 + eps1 + eps2)``-DP (Lemma D.1; Bhowmick et
al. Lemma 4.1 and Prop. 3) towards whoever sees ``c`` -- in federated learning the server -- for
any two inputs of norm at most ``C`` (local DP: the neighbouring relation is "any other update").
Per client and per use; repeated rounds compose (``T`` uses: ``T (eps0 + eps1 + eps2)`` by basic
composition). The direction part is ``eps0 + log((1 - P) / P)``-DP exactly, ``P`` the uniform
measure of the cap ``{<v, u> >= gamma}``: the density of ``V`` is ``p / P`` on the cap and
``(1 - p) / (1 - P)`` off it, so the worst ratio between two inputs is ``p/(1-p) * (1-P)/P``;
:attr:`PrivUnitConstants.direction_epsilon` records it, and gamma is chosen so it is ``<= eps0 +
eps1``. ScalarDP's randomized response keeps ``J`` w.p. ``e^eps2 / (e^eps2 + k)`` and moves to each
other level w.p. ``1 / (e^eps2 + k)``: ratio exactly ``e^eps2``. ``c = r_hat * Z`` is a
post-processing of the two independent releases.

**Sensitivity assumption.** ``||x|| <= C``: the caller clips. :func:`privatize` refuses (raises
``ValueError``) an ``x`` whose norm exceeds ``C`` by more than float rounding, and clamps a norm in
``(C, C (1 + rtol)]`` to ``C``. A zero ``x`` has no direction; it gets a uniformly random one (any
fixed direction would be as private, since PrivUnit is private for every unit input and
``E[c] = E[r_hat] E[Z] = 0`` for r = 0 whatever the direction; a random one keeps the output
free of a preferred axis).

**Choices and errata.**

- Alg. 3 prints "uniform on the cap w.p. gamma"; it must read "w.p. p", ``p = e^eps0 / (1 +
  e^eps0)`` (as in Bhowmick et al. and as ``m`` assumes). We draw the cap w.p. ``p``.
- gamma (``gamma_rule="paper"``): the largest gamma that Alg. 3 admits: the max of condition 1's
  bound ``gamma1 = tanh(eps1/2) sqrt(pi / (2(d-1)))`` (kept only if ``< 1``) and condition 2's
  largest solution ``gamma2`` (its left side ``1/2 log d + log 6 - (d-1)/2 log(1-gamma^2) + log
  gamma`` is increasing in gamma, so ``gamma2`` is found by bisection on that log-space expression,
  keeping the end that satisfies it; condition 2 applies only if it holds at ``gamma =
  sqrt(2/d)``). The conditions are sufficient conditions from Bhowmick et al. that assume a
  large enough ``d``; we check the exact criterion ``log((1-P)/P) <= eps1`` afterwards. It holds
  for every ``d >= 3`` we scanned (``eps1`` in ``(0, 30]``), but not for ``d = 2``, where condition
  1 admits e.g. gamma = 0.954 at eps1 = 2 (exact loss 2.24) and for ``eps1 >~ 2.2`` admits no
  gamma below 1 at all. Whenever the check fails, or no gamma < 1 is admitted, we use the exact
  rule instead. ``gamma_rule="exact"`` always uses the largest gamma with ``log((1-P)/P) <=
  eps1``, ``gamma = 1 - 2 I^{-1}_{1/(1+e^eps1)}(alpha, alpha)``: never smaller than the paper's
  choice, hence a smaller ``1/m`` and variance, at the same privacy.
- k: Alg. 4 prints ``k = e^{ceil(eps2/3)}``, not an integer; we use Bhowmick et al.'s
  ``k = ceil(e^{eps2/3})`` (also what the paper's own Lemma D.4 substitutes): ``J`` and ``J_hat``
  range over ``{0, ..., k}``, which needs an integer ``k``. Unbiasedness (``E[J] = kr/C``,
  ``E[J_hat | J] = J (e^eps2 - 1)/(e^eps2 + k) + b``) and the ``e^eps2`` ratio of the randomized
  response hold for every integer ``k >= 1``. ``e^{eps2/3}`` within ``1e-9`` (relative) of an
  integer counts as that integer, so ``eps2 = 3 log 2`` gives ``k = 2``, not 3.
- Norm estimation (Alg. 5): the paper tests "``J~ in Z``" on a float. We compute both candidates
  ``J+ = m||c||/a + b`` and ``J- = -m||c||/a + b``, take the one closer to an integer of
  ``{0..k}`` (ties: ``+``, as the paper) and return ``r_hat = a (J - b)`` from that integer, so the
  result is exactly the released ``r_hat`` whenever the float error of ``m||c||/a`` is below
  ``sign_margin / 2``, ``sign_margin = dist(2b, Z)`` (the wrong candidate is ``2b - J_hat``).
  ``sign_margin = 0`` is Lemma D.3's excluded case ``k(k+1)/(e^eps2 + k) in Z`` (e.g. ``eps2 =
  log 4``): the sign is then genuinely ambiguous and ``E[s_hat] <= r^2`` can fail; the constants
  warn when ``sign_margin < 1e-4``.
- Alg. 5's ``c1, c2, c3``: with ``f = frac(kr/C)`` the exact variance of ScalarDP is
  ``Var r_hat = c1 r^2 + c2 r + c3 - a^2 lambda (1/4 - f(1-f))``, ``lambda = (e^eps2 - 1) /
  (e^eps2 + k)``: the paper's bound is exact when ``f = 1/2`` and loose by at most
  ``C^2 (e^eps2 + k) / (4 k^2 (e^eps2 - 1))`` otherwise (f = 0), so, since ``1 + c1 = 1/lambda``,
  ``E[s_hat] = r^2 - (C/k)^2 (1/4 - f(1-f))``: at most ``r^2``, equal iff ``f = 1/2``, and never
  below ``r^2 - C^2 / (4k^2)``.

**Numerics.** Everything that involves ``B(alpha, alpha)``, ``2^(d-2)`` and ``(1-gamma^2)^alpha``
is done in log space, using ``2^(d-2) B(alpha, alpha) = B(1/2, alpha)`` (Legendre duplication)
and the regularized incomplete beta for the cap mass ``P = I_{(1-gamma)/2}(alpha, alpha)`` and
``1 - P = I_{(1+gamma)/2}(alpha, alpha)`` (each computed directly, no ``1 - x`` cancellation), so
``m`` is finite and accurate to ~1e-12 for ``d`` up to 1e7 and beyond. ``t = <V, u>`` is drawn
exactly: ``(1 + t)/2 ~ Beta(alpha, alpha)`` truncated to the cap or its complement, by inverse
CDF (``betaincinv``, float64), inverting whichever tail mass is smaller so the tails keep their
relative precision; ``1 - t^2`` is formed as ``4 X (1 - X)``. The uniforms come from the caller's
``torch.Generator`` or :class:`~dpfl_lightning.rng.Stream` (float64; a stream is the CSPRNG in
secure mode); the vector part (a Gaussian projected orthogonally to ``u``) is
drawn on the generator's device and computed on the input's device, in float64 for float64
input and float32 otherwise; ``V`` is renormalized so ``||Z|| = 1/m`` to float rounding.

**Floating-point caveats.** The privacy proof is for real-valued sampling. Floating-point
samplers (inverse CDF in float64, Gaussian directions, float32 outputs) are not exactly the ideal
distributions, and the low-order bits of a float release can in principle leak more than the
ideal mechanism (Mironov 2012's attack on the floating-point Laplace mechanism); we make no claim
beyond the idealized mechanism. The norm estimator relies on ``||c||`` being ``|r_hat| / m`` to
float precision: any post-processing of ``c`` before the server reads it (compression,
aggregation) breaks it, and :func:`recover_r_hat` raises when ``m||c||`` is not near the lattice.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
from scipy import special

from dpfl_lightning.errors import NonFiniteUpdateError, require
from dpfl_lightning.rng import Stream

GAMMA_RULES = ("paper", "exact")
SIGN_MARGIN_WARN = 1e-4  # warn when the sign of r_hat cannot be recovered robustly
MAX_LEVELS = 10**9  # k above this (eps2 > ~62) is refused: levels must fit comfortably in int64


# ----------------------------------------------------------------------------- constants


def cap_mass(d: int, gamma: float) -> tuple[float, float]:
    """``(P, 1 - P)``: uniform measure of ``{<v, u> >= gamma}`` on ``S^{d-1}`` and of its
    complement. ``(1+t)/2 ~ Beta(alpha, alpha)``, ``alpha = (d-1)/2``, so ``P = I_{(1-gamma)/2}``
    by symmetry; both masses are computed directly."""
    alpha = (d - 1) / 2.0
    return (
        float(special.betainc(alpha, alpha, (1.0 - gamma) / 2.0)),
        float(special.betainc(alpha, alpha, (1.0 + gamma) / 2.0)),
    )


def direction_loss(d: int, gamma: float) -> float:
    """The exact ``log((1 - P) / P)`` of PrivUnit's cap: its privacy loss beyond ``eps0``."""
    p_cap, p_rest = cap_mass(d, gamma)
    if p_cap <= 0.0:
        return math.inf
    return math.log(p_rest) - math.log(p_cap)


def _condition2_lhs(d: int, gamma: float) -> float:
    return 0.5 * math.log(d) + math.log(6.0) - (d - 1) / 2.0 * math.log1p(-gamma * gamma) + math.log(gamma)


def gamma_condition1(d: int, eps1: float) -> float:
    """Alg. 3's first bound ``(e^eps1 - 1)/(e^eps1 + 1) sqrt(pi / (2(d-1)))`` (may be >= 1)."""
    return math.tanh(eps1 / 2.0) * math.sqrt(math.pi / (2.0 * (d - 1)))


def gamma_condition2(d: int, eps1: float) -> float | None:
    """The largest gamma in ``[sqrt(2/d), 1)`` satisfying Alg. 3's second condition, or None.

    The condition's left side is increasing in gamma, so bisection keeps the satisfying end."""
    lo = math.sqrt(2.0 / d)
    if lo >= 1.0 or _condition2_lhs(d, lo) > eps1:
        return None
    hi = 1.0
    for _ in range(2000):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if _condition2_lhs(d, mid) <= eps1:
            lo = mid
        else:
            hi = mid
    return lo


def gamma_exact(d: int, eps1: float) -> float:
    """The largest gamma with ``log((1-P)/P) <= eps1`` (``P`` the cap mass), to float precision."""
    alpha = (d - 1) / 2.0
    y = float(special.betaincinv(alpha, alpha, float(special.expit(-eps1))))
    gamma = 1.0 - 2.0 * y
    step = 1e-15
    while gamma > 0.0 and direction_loss(d, gamma) > eps1:  # undo inversion rounding, if any
        gamma -= max(step, 1e-15 * gamma)
        step *= 2.0
    require(gamma > 0.0, "eps1", eps1, f"no positive cap threshold gamma for d={d}", "use a larger eps1")
    return gamma


def choose_gamma(d: int, eps1: float, rule: str = "paper") -> tuple[float, str]:
    """``(gamma, which)``; ``which`` names the condition that set it (see the module docstring)."""
    require(rule in GAMMA_RULES, "gamma_rule", rule, "unknown rule", f"use one of {GAMMA_RULES}")
    if rule == "paper":
        candidates = []
        g1 = gamma_condition1(d, eps1)
        if g1 < 1.0:
            candidates.append((g1, "condition 1"))
        g2 = gamma_condition2(d, eps1)
        if g2 is not None:
            candidates.append((g2, "condition 2"))
        if candidates:
            gamma, which = max(candidates)
            if direction_loss(d, gamma) <= eps1:
                return gamma, which
        return gamma_exact(d, eps1), "exact (the paper's conditions fail at this d)"
    return gamma_exact(d, eps1), "exact"


def log_privunit_m(d: int, gamma: float, p: float) -> float:
    """``log m`` of Alg. 3, in log space.

    ``m = (1-gamma^2)^alpha / (2^(d-2) (d-1)) [p / (B(alpha,alpha) - B(tau;alpha,alpha)) - (1-p) /
    B(tau;alpha,alpha)]`` with unregularized (incomplete) betas. Writing ``B(tau;.) = B I_tau``,
    ``2^(d-2) B(alpha, alpha) = B(1/2, alpha)`` and ``P = 1 - I_tau``:
    ``m = (1-gamma^2)^alpha (p - P) / ((d-1) B(1/2, alpha) P (1-P))``."""
    alpha = (d - 1) / 2.0
    p_cap, p_rest = cap_mass(d, gamma)
    require(p > p_cap, "gamma", gamma, "the cap is drawn less often than its mass: m <= 0", "use gamma > 0")
    return (
        alpha * math.log1p(-gamma * gamma)
        - math.log(d - 1)
        - float(special.betaln(0.5, alpha))
        + math.log(p - p_cap)
        - math.log(p_cap)
        - math.log(p_rest)
    )


def _levels(eps2: float) -> int:
    """``k = ceil(e^{eps2/3})``, taking values within 1e-9 (relative) of an integer as it."""
    v = math.exp(eps2 / 3.0)
    r = round(v)
    k = int(r) if abs(v - r) <= 1e-9 * v else math.ceil(v)
    return max(k, 1)


@dataclass(frozen=True)
class PrivUnitConstants:
    """Everything PrivUnit, ScalarDP and the norm estimator need, computed once per
    ``(d, eps0, eps1, eps2, C, gamma_rule)`` by :func:`privunit_constants`."""

    d: int
    eps0: float
    eps1: float
    eps2: float
    C: float
    gamma_rule: str
    gamma: float  # cap threshold on <V, u>
    gamma_source: str  # which condition set gamma
    p: float  # probability of drawing V in the cap, e^eps0 / (1 + e^eps0)
    alpha: float  # (d - 1) / 2
    tau: float  # (1 + gamma) / 2
    cap_mass: float  # P: uniform measure of the cap
    rest_mass: float  # 1 - P, computed directly
    direction_epsilon: float  # exact eps0 + log((1-P)/P) <= eps0 + eps1
    log_m: float
    m: float  # E[V] = m u, ||Z|| = 1/m
    k: int  # ScalarDP levels {0..k}
    keep_prob: float  # e^eps2 / (e^eps2 + k)
    a: float  # r_hat = a (J_hat - b)
    b: float
    c1: float  # Alg. 5: Var r_hat <= c1 r^2 + c2 r + c3
    c2: float
    c3: float
    sign_margin: float  # dist(k(k+1)/(e^eps2 + k), Z): 0 means the sign of r_hat is ambiguous

    @property
    def epsilon(self) -> float:
        """Pure-DP epsilon of one release ``c`` (Lemma D.1): ``eps0 + eps1 + eps2``."""
        return self.eps0 + self.eps1 + self.eps2

    @property
    def z_norm(self) -> float:
        """``||PrivUnit(u)|| = 1/m``."""
        return math.exp(-self.log_m)


@lru_cache(maxsize=64)
def privunit_constants(
    d: int, eps0: float, eps1: float, eps2: float, C: float, gamma_rule: str = "paper"
) -> PrivUnitConstants:
    """The constants of Alg. 3-5 for dimension ``d``, budgets ``eps0 >= 0``, ``eps1, eps2 > 0``
    and norm bound ``C > 0``. Cached: reuse it every round."""
    require(isinstance(d, (int, np.integer)) and d >= 2, "d", d, "PrivUnit needs d >= 2", "pass d >= 2")
    d = int(d)
    for name, v, low in (("eps0", eps0, 0.0), ("eps1", eps1, 0.0), ("eps2", eps2, 0.0)):
        ok = math.isfinite(v) and (v >= low if name == "eps0" else v > low) and v <= 600.0
        require(ok, name, v, "must be in (0, 600] (eps0 in [0, 600])", "pass a valid privacy budget")
    require(math.isfinite(C) and C > 0.0, "C", C, "the norm bound must be positive and finite", "pass C > 0")
    eps0, eps1, eps2, C = float(eps0), float(eps1), float(eps2), float(C)

    gamma, source = choose_gamma(d, eps1, gamma_rule)
    alpha = (d - 1) / 2.0
    p = float(special.expit(eps0))
    p_cap, p_rest = cap_mass(d, gamma)
    log_m = log_privunit_m(d, gamma, p)

    k = _levels(eps2)
    require(k <= MAX_LEVELS, "eps2", eps2, f"ScalarDP would need k={k} levels", "use eps2 <= 60")
    e2 = math.exp(eps2)
    em1 = math.expm1(eps2)
    keep = 1.0 / (1.0 + k * math.exp(-eps2))
    a = (e2 + k) / em1 * C / k
    b = k * (k + 1) / (2.0 * (e2 + k))
    c1 = (k + 1) / em1
    c2 = -c1 * C
    c3 = (c1 + 1.0) * C * C / (4.0 * k * k) + c1 * C * C * (
        (2 * k + 1) * (e2 + k) / (6.0 * k * em1) - (k + 1) / (4.0 * em1)
    )
    two_b = 2.0 * b
    margin = abs(two_b - round(two_b))
    if margin < SIGN_MARGIN_WARN:
        warnings.warn(
            f"ScalarDP with eps2={eps2} (k={k}): k(k+1)/(e^eps2+k) = {two_b!r} is (nearly) an integer, "
            "so the server cannot tell the sign of r_hat from ||c|| (Lemma D.3's excluded case); "
            "the norm estimate may be biased upwards. Change eps2 slightly.",
            RuntimeWarning,
            stacklevel=2,
        )
    return PrivUnitConstants(
        d=d, eps0=eps0, eps1=eps1, eps2=eps2, C=C, gamma_rule=gamma_rule, gamma=gamma,
        gamma_source=source, p=p, alpha=alpha, tau=(1.0 + gamma) / 2.0, cap_mass=p_cap,
        rest_mass=p_rest, direction_epsilon=eps0 + math.log(p_rest) - math.log(p_cap),
        log_m=log_m, m=math.exp(log_m), k=k, keep_prob=keep, a=a, b=b, c1=c1, c2=c2, c3=c3,
        sign_margin=margin,
    )  # fmt: skip


# ----------------------------------------------------------------------------- sampling


def _uniforms(generator: torch.Generator | Stream, shape: tuple[int, ...]) -> np.ndarray:
    """float64 uniforms in [0, 1) from the caller's generator or stream, as a CPU numpy array."""
    if isinstance(generator, Stream):  # e.g. the CSPRNG of secure mode
        return generator.uniform(math.prod(shape)).numpy().reshape(shape)
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)
    return u.cpu().numpy()


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float64)


def _sym_beta_quantile(alpha: float, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(X, 1 - X)`` for ``X ~ Beta(alpha, alpha)`` with ``P(X <= x) = lo``, ``P(X >= x) = hi``
    (``lo + hi = 1``, both given accurately): inverts the smaller tail, using the symmetry
    ``1 - X ~ Beta(alpha, alpha)``, so both ``X`` and ``1 - X`` keep their relative precision."""
    use_lo = lo <= hi
    q = special.betaincinv(alpha, alpha, np.where(use_lo, lo, hi))
    x = np.where(use_lo, q, 1.0 - q)
    y = np.where(use_lo, 1.0 - q, q)
    return x, y


def sample_cap_coordinate(
    consts: PrivUnitConstants, generator: torch.Generator, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` draws of ``(t, sqrt(1 - t^2), in_cap)`` for ``t = <V, u>``: the cap w.p. ``p``, then
    ``t`` from the exact truncated law (density ~ ``(1 - t^2)^((d-3)/2)``), by inverse CDF."""
    uu = _uniforms(generator, (2, n))
    in_cap = uu[0] < consts.p
    w = uu[1]  # in [0, 1); 1 - w in (0, 1] exactly
    P, Q = consts.cap_mass, consts.rest_mass
    # cap (X >= tau): mass above X is (1-w) P; complement (X < tau): mass below X is (1-w) Q
    lo = np.where(in_cap, Q + w * P, (1.0 - w) * Q)
    hi = np.where(in_cap, (1.0 - w) * P, P + w * Q)
    x, y = _sym_beta_quantile(consts.alpha, lo, hi)  # x = (1+t)/2, y = (1-t)/2
    t = x - y
    g = consts.gamma
    t = np.where(in_cap, np.clip(t, g, 1.0), np.clip(t, -1.0, np.nextafter(g, -np.inf)))
    s = 2.0 * np.sqrt(x * y)
    return t, s, in_cap


def _unit_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """Rows of ``x`` scaled to unit norm (max-abs scaling first, so tiny norms do not underflow)."""
    scale = x.abs().amax(dim=-1, keepdim=True)
    if not bool(torch.all(scale > 0)):
        raise ValueError(f"{what}: a zero vector has no direction")
    y = x / scale
    return y / _row_norms(y).to(y.dtype)


def _gaussian(generator: torch.Generator | Stream, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Standard normals drawn on the generator's device (a stream's on ``device``), moved to ``device``."""
    if isinstance(generator, Stream):
        return generator.normal(shape, 1.0, device, dtype)
    return torch.randn(shape, generator=generator, dtype=dtype, device=generator.device).to(device)


def _privunit_rows(
    u: torch.Tensor, consts: PrivUnitConstants, generator: torch.Generator
) -> tuple[torch.Tensor, np.ndarray]:
    """Unit rows ``V`` (shape of ``u``, work dtype, ``u``'s device) and the cap indicators."""
    n = u.shape[0]
    t, s, in_cap = sample_cap_coordinate(consts, generator, n)
    g = _gaussian(generator, tuple(u.shape), u.dtype, u.device)
    for _ in range(2):  # Gram-Schmidt twice: orthogonal to u to working precision
        g = g - torch.sum(g * u, dim=-1, keepdim=True, dtype=torch.float64).to(u.dtype) * u
    w = g / _row_norms(g).to(u.dtype)
    tt = torch.as_tensor(t, dtype=u.dtype).to(u.device).unsqueeze(-1)
    ss = torch.as_tensor(s, dtype=u.dtype).to(u.device).unsqueeze(-1)
    v = tt * u + ss * w
    v = v / _row_norms(v).to(v.dtype)
    return v, in_cap


def _check_input(x: torch.Tensor, consts: PrivUnitConstants, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] != consts.d:
        raise ValueError(f"{name} must have last dimension d={consts.d}, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteUpdateError(f"{name} has NaN or infinite entries")
    return x.to(_work_dtype(x.dtype))


def privunit(u: torch.Tensor, consts: PrivUnitConstants, generator: torch.Generator) -> torch.Tensor:
    """Alg. 3: ``Z = V / m`` for a unit ``u`` (shape ``(d,)``, or ``(n, d)`` for ``n`` independent
    draws, one per row). ``u`` is renormalized; ``E[Z] = u``, ``||Z|| = 1/m``. Output: float64 for
    float64 input, float32 otherwise, on ``u``'s device."""
    u = _check_input(u, consts, "u")
    rows = u.reshape(-1, consts.d)
    v, _ = _privunit_rows(_unit_rows(rows, "PrivUnit input u"), consts, generator)
    return (v * (1.0 / consts.m)).reshape(u.shape)


def scalar_dp(r, consts: PrivUnitConstants, generator: torch.Generator) -> np.ndarray:
    """Alg. 4, vectorised: ``r_hat = a (J_hat - b)`` for each ``r`` in ``[0, C]`` (float64 array,
    shape of ``r``). ``E[r_hat] = r``. Draws, in order: one uniform for the stochastic rounding,
    one for keep-or-move, one for the other level, per element."""
    r = np.asarray(r, dtype=np.float64)
    if not np.all(np.isfinite(r)) or np.any(r < 0.0) or np.any(r > consts.C):
        raise ValueError(f"ScalarDP needs 0 <= r <= C={consts.C}, got {r}")
    j_hat = _scalar_dp_levels(r.reshape(-1), consts, generator)
    return (consts.a * (j_hat - consts.b)).reshape(r.shape)


def _scalar_dp_levels(r: np.ndarray, consts: PrivUnitConstants, generator: torch.Generator) -> np.ndarray:
    k = consts.k
    u = _uniforms(generator, (3, r.size))
    x = np.clip(k * (r / consts.C), 0.0, float(k))
    lo = np.floor(x)
    j = np.minimum(lo + (u[0] < x - lo), k).astype(np.int64)  # up w.p. frac(x): E[J] = x
    other = np.minimum(np.floor(u[2] * k), k - 1).astype(np.int64)  # uniform on {0..k-1}
    other = other + (other >= j)  # uniform on {0..k} \ {J}
    return np.where(u[1] < consts.keep_prob, j, other)


def scalar_dp_probabilities(r: float, consts: PrivUnitConstants) -> np.ndarray:
    """The exact distribution of ``J_hat`` (length ``k + 1``) for input ``r`` in ``[0, C]``."""
    k = consts.k
    x = min(max(k * (r / consts.C), 0.0), float(k))
    lo = math.floor(x)
    f = x - lo
    pj = np.zeros(k + 1)
    pj[lo] += 1.0 - f
    if f > 0.0:
        pj[lo + 1] += f
    move = (1.0 - consts.keep_prob) / k  # = 1 / (e^eps2 + k)
    return pj * consts.keep_prob + (1.0 - pj) * move


class Release(NamedTuple):
    c: torch.Tensor  # what the server sees
    epsilon: float  # pure-DP epsilon of this release: eps0 + eps1 + eps2
    r_hat: np.ndarray  # the ScalarDP output inside c (known to the client; the server recovers it)


def privatize(
    x: torch.Tensor, consts: PrivUnitConstants, generator: torch.Generator, rtol: float | None = None
) -> Release:
    """``c = ScalarDP(||x||) * PrivUnit(x / ||x||)`` for ``||x|| <= C`` (Lemma D.1: ``E[c] = x``,
    pure ``consts.epsilon``-DP). ``x``: shape ``(d,)``, or ``(n, d)`` for ``n`` clients (one per
    row). Raises ``ValueError`` if a norm exceeds ``C (1 + rtol)`` (default ``rtol``: 1e-5 for
    float32 and lower, 1e-12 for float64); norms in ``(C, C (1 + rtol)]`` count as ``C``. A zero
    row gets a uniformly random direction. Draws ScalarDP's uniforms first, then PrivUnit's."""
    x = _check_input(x, consts, "x")
    rows = x.reshape(-1, consts.d)
    if rtol is None:
        rtol = 1e-12 if rows.dtype == torch.float64 else 1e-5
    norms = _row_norms(rows).squeeze(-1).cpu().numpy()
    too_big = norms > consts.C * (1.0 + rtol)
    if np.any(too_big):
        raise ValueError(
            f"PrivUnit/ScalarDP need ||x|| <= C={consts.C}; got ||x|| = {norms[too_big].max()!r}. "
            "Clip the update to norm C before privatizing; the privacy guarantee assumes it."
        )
    r = np.minimum(norms, consts.C)
    r_hat = scalar_dp(r, consts, generator)
    zero = norms == 0.0
    if np.any(zero):
        rand = _gaussian(generator, (int(zero.sum()), consts.d), rows.dtype, rows.device)
        rows = rows.clone()
        rows[torch.as_tensor(zero, device=rows.device)] = rand
    v, _ = _privunit_rows(_unit_rows(rows, "x"), consts, generator)
    scale = torch.as_tensor(r_hat / consts.m, dtype=v.dtype).to(v.device).unsqueeze(-1)
    c = (v * scale).reshape(x.shape)
    return Release(c=c, epsilon=consts.epsilon, r_hat=r_hat.reshape(x.shape[:-1]))


# ----------------------------------------------------------------------------- norm estimation


def recover_r_hat(c_norm, consts: PrivUnitConstants, atol: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """Alg. 5's sign recovery, robust and vectorised: ``(r_hat, J_hat)`` from ``||c||`` (a float or
    an array of per-client norms). ``J+- = +-m||c||/a + b``; the one nearer an integer of
    ``{0..k}`` wins (ties: +); ``r_hat = a (J_hat - b)`` from that integer. Raises ``ValueError``
    if the winner is farther than ``atol`` from its integer: ``c`` was not released with these
    constants, or was altered."""
    c_norm = np.asarray(c_norm, dtype=np.float64)
    r_tilde = consts.m * c_norm
    k = consts.k
    cand = np.stack([r_tilde / consts.a + consts.b, -r_tilde / consts.a + consts.b])
    ints = np.clip(np.rint(cand), 0, k)
    dist = np.abs(cand - ints)
    use_minus = dist[1] < dist[0]
    j_hat = np.where(use_minus, ints[1], ints[0]).astype(np.int64)
    residual = np.where(use_minus, dist[1], dist[0])
    if np.any(residual > atol) or not np.all(np.isfinite(c_norm)):
        raise ValueError(
            f"m||c|| is not within {atol} of a ScalarDP level (worst distance {np.max(residual)!r} in units "
            "of J): c was not produced by privatize() with these constants, or was changed afterwards"
        )
    return consts.a * (j_hat - consts.b), j_hat


def s_hat_from_r_hat(r_hat, consts: PrivUnitConstants) -> np.ndarray:
    """``s_hat = (r_hat^2 - c2 r_hat - c3) / (1 + c1)``: ``E[s_hat] <= r^2`` (Lemma D.3)."""
    r_hat = np.asarray(r_hat, dtype=np.float64)
    return (r_hat * r_hat - consts.c2 * r_hat - consts.c3) / (1.0 + consts.c1)


def estimate_sq_norm(c_norm, consts: PrivUnitConstants, atol: float = 1e-3) -> np.ndarray:
    """Alg. 5, vectorised over clients: ``s_hat`` for each ``||c||``. Pass
    ``torch.linalg.vector_norm(c, dim=-1, dtype=torch.float64)`` of the released ``c``: a norm
    accumulated in float32 can be off by ~1e-4 relative at d = 1e7, too much for the lattice."""
    r_hat, _ = recover_r_hat(c_norm, consts, atol)
    return s_hat_from_r_hat(r_hat, consts)


def estimate_sq_norm_of(c: torch.Tensor, consts: PrivUnitConstants, atol: float = 1e-3) -> np.ndarray:
    """:func:`estimate_sq_norm` from released updates ``c`` of shape ``(d,)`` or ``(n, d)``."""
    if c.shape[-1] != consts.d:
        raise ValueError(f"c must have last dimension d={consts.d}, got shape {tuple(c.shape)}")
    norms = torch.linalg.vector_norm(c, dim=-1, dtype=torch.float64).cpu().numpy()
    return estimate_sq_norm(norms, consts, atol)
