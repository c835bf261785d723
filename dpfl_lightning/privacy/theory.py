"""Paper 000's theory for DP-ScaffNew: the utility bound (Theorem 1) and its optimum (Corollary 1).

Paper 000: "Balancing Privacy and Performance for Private Federated Learning Algorithms".
Setting (Alg. 2, DP-ScaffNew): ``N`` clients, parameters in ``R^d``; every iteration each client
takes a local step ``x_hat = x - eta (grad f_i(x) - h_i)``; with probability ``p`` (a shared coin)
the clients send ``clip_C(x_hat - x_t) + N(0, sigma^2 I_d)``, the server averages, and the control
variates ``h_i`` are updated. ``T`` counts local iterations, so a client expects ``1/p`` local
steps per round and the run expects ``p T`` communication rounds. Each ``f_i`` is mu-strongly
convex and L-smooth; the analysis assumes full local gradients and that clipping never acts.

Formulas, as implemented (``ln`` is the natural logarithm)::

    Lemma 1 (privacy calibration, used by Theorem 1's proof with equality):
        sigma^2 = v C^2 p T ln(1/delta) / epsilon^2
    Theorem 1, eq. (2), for 0 < eta <= 1/L, 0 < p <= 1:
        E[psi_T] <= theta^T psi0 + p^2 N d / (1 - theta) * v C^2 T ln(1/delta) / epsilon^2
                  = theta^T psi0 + p N d sigma^2 / (1 - theta)
        theta    = max(1 - mu eta, 1 - p^2)
        psi_t    = ||x_t - x*||^2 + (eta^2 / p^2) ||h_t - h*||^2     (stacked over the N clients)
    Corollary 1 (proof in App. B.2):
        eta* = 1/L,  p* = sqrt(mu/L),
        T*   = ln( psi0 epsilon^2 ln(1/(1 - mu/L)) / (v C^2 N d ln(1/delta)) ) / ln(1/(1 - mu/L))
        expected local steps 1/p*, expected communication rounds p* T*.
    At (eta*, p*) the bound is  B(T) = (1 - mu/L)^T psi0 + K T,  K = v C^2 N d ln(1/delta) / epsilon^2,
    and for T* > 0 stationarity gives  B(T*) = K (T* + 1 / ln(1/(1 - mu/L))).

The noise reported is the standard deviation ``sigma`` of Lemma 1 (per coordinate of each client's
message), which is what Theorem 1's proof substitutes: ``sigma = C sqrt(v p T ln(1/delta)) / epsilon``.
``v`` (and the ``u`` of Lemma 1's condition ``epsilon <= u p T``) are constants the paper leaves
unspecified (they come from Abadi et al. 2016, Thm. 1); ``v = 1`` here is a normalisation, not a
privacy guarantee. ``T*``, ``p*`` and ``eta*`` are what the paper claims; ``sigma`` is only as
valid as the ``v`` passed in. For orientation only (not from the paper): composing ``k`` Gaussian
releases of L2 sensitivity ``Delta`` via zCDP (Bun and Steinke 2016, Props. 1.3 and 1.6) gives
``(epsilon, delta)``-DP with ``sigma^2 = v k Delta^2 ln(1/delta) / epsilon^2`` for
``v = (1 + sqrt(1 + epsilon / ln(1/delta)))^2 / 2`` (about 2 when ``epsilon << ln(1/delta)``); a
client's clipped update has ``Delta = 2C`` under replace-one, i.e. four times that ``v`` in
Lemma 1's units.

Typos and ambiguities in the paper, and how they are resolved here:

- Theorem 1's condition on ``p`` is garbled in the text ("0 , <math>"); read as ``0 < p <= 1``
  (Alg. 2 line 1 and App. B.1, "If p in (0, 1]").
- ``theta`` means three things: Alg. 2's coin ``theta_t``, Theorem 1's contraction factor
  ``max(1 - mu eta, 1 - p^2)`` (called ``rho`` in App. B.1), and in App. B.2 the complement
  ``min(mu/L, p^2)``. Here ``theta`` is Theorem 1's contraction factor.
- App. B.1 has ``2 p sigma^2`` in one line where the next has ``p N d sigma^2`` (the latter is
  right), ``eta / n`` for ``eta / p`` in ``y_t``, and a stray ``B > 0`` next to ``delta``; Theorem
  1's definition of the stacked ``x*`` reads ``[(x_t^*)^T, ..., (x_t^N)^T]`` for
  ``[(x*)^T, ..., (x*)^T]``. None changes eq. (2).
- Lemma 1 requires ``epsilon <= u p T`` but App. B.1 quotes ``epsilon <= u T``; neither ``u`` nor
  ``v`` is given, so the condition is not checked here.
- Lemma 1 calibrates to the *expected* number of rounds ``p T``; the realised number is
  Binomial(T, p) and can exceed it. We implement the paper's calibration as stated.
- Corollary 1 treats ``T`` as a real number and ignores Theorem 1's ``T >= 1``. When the
  logarithm's argument is ``<= 1`` the formula gives ``T* <= 0``: since ``B`` is convex with
  ``B'(0) = K - psi0 ln(1/(1 - mu/L)) >= 0`` there, the minimiser over ``T >= 0`` is ``T* = 0`` (no
  training; the bound is ``psi0``), which is what we return. We also return the integer optimum
  (the better of ``floor(T*)`` and ``ceil(T*)``; ``B`` is convex), since Alg. 2 runs whole
  iterations.
- ``ln(1/(1 - mu/L))`` is infinite at ``mu = L``, where the formula is undefined: we require
  ``L > mu``.
- ``psi0`` depends on ``eta / p`` through its control-variate part (see :func:`initial_lyapunov`);
  the corollary's minimisation over ``(eta, p)`` holds ``psi0`` fixed, and so do we. With ``psi0``
  fixed the claim is right for every ``T > 0``: ``theta >= 1 - mu/L`` with equality only at
  ``eta = 1/L, p^2 >= mu/L``, and ``p^2 / (1 - theta) >= 1`` with equality iff ``p^2 <= mu eta``,
  so ``(1/L, sqrt(mu/L))`` is the unique minimiser over ``0 < eta <= 1/L, 0 < p <= 1``.
- Dependence of ``T*`` on the inputs (from the formula): non-decreasing in ``epsilon``, ``delta``
  and ``psi0``; non-increasing in ``N``, ``d``, ``C`` and ``v``. More clients *shorten* the run
  for a fixed ``psi0`` (the noise on the stacked ``N d`` coordinates grows with ``N``); but ``psi0``
  is a sum over clients too, and where it grows in proportion to ``N`` (e.g. a common start and
  ``h_0 = h*``: ``psi0 = N ||x_0 - x*||^2``) the two cancel and ``T*`` does not depend on ``N``.
  ``T*`` is not monotone in ``mu/L``: writing ``lam = ln(1/(1 - mu/L))``,
  ``A = psi0 epsilon^2 / (v C^2 N d ln(1/delta))`` and ``T* = ln(A lam) / lam``,
  ``dT*/dlam = (1 - ln(A lam)) / lam^2`` changes sign at ``A lam = e``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from dpfl_lightning.errors import require

__all__ = ["ScaffNewOptimum", "initial_lyapunov", "privacy_sigma", "scaffnew_bound", "scaffnew_optimal"]


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------
def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _is_count(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1


def _positive(name: str, value: object, fix: str) -> None:
    require(_is_real(value) and value > 0, name, value, "must be a finite number > 0", fix)


def _check_privacy(epsilon: float, delta: float, C: float, v: float) -> None:
    _positive("epsilon", epsilon, "set the privacy budget, e.g. 1.0")
    require(_is_real(delta) and 0 < delta < 1, "delta", delta, "must be in (0, 1)",
            "set delta well below 1/N, e.g. 1e-5")
    _positive("C", C, "set the clipping threshold of the client updates, e.g. 1.0")
    _positive("v", v, "pass Lemma 1's privacy constant v (the paper leaves it unspecified), e.g. 1.0")


def _check_problem(mu: float, L: float, N: int, d: int, psi0: float) -> None:
    _positive("mu", mu, "give the strong-convexity constant of the f_i, e.g. 0.1")
    _positive("L", L, "give the smoothness constant of the f_i, e.g. 1.0")
    require(L > mu, "L", L, f"must be > mu = {mu!r} (Corollary 1 divides by ln(1/(1 - mu/L)), "
            "undefined at mu = L)", "use L > mu; L < mu is impossible for an L-smooth mu-strongly convex f")
    require(_is_count(N), "N", N, "must be an integer >= 1", "give the number of clients")
    require(_is_count(d), "d", d, "must be an integer >= 1", "give the number of model parameters")
    _positive("psi0", psi0, "give the initial Lyapunov value ||x_0 - x*||^2 + (eta/p)^2 ||h_0 - h*||^2 "
              "(see initial_lyapunov)")


# ---------------------------------------------------------------------------------------------
# Lemma 1, Theorem 1
# ---------------------------------------------------------------------------------------------
def privacy_sigma(p: float, T: float, epsilon: float, delta: float, C: float, v: float = 1.0) -> float:
    """Lemma 1's noise standard deviation, ``sigma = C sqrt(v p T ln(1/delta)) / epsilon``.

    The Gaussian noise each client adds per coordinate when it communicates, for an expected
    ``p T`` communication rounds. 0 when ``T = 0`` (nothing is released).
    """
    _check_privacy(epsilon, delta, C, v)
    require(_is_real(p) and 0 < p <= 1, "p", p, "must be in (0, 1]", "give the communication probability")
    require(_is_real(T) and T >= 0, "T", T, "must be a finite number >= 0", "give the number of local iterations")
    return C * math.sqrt(v * p * T * math.log(1.0 / delta)) / epsilon


def initial_lyapunov(eta: float, p: float, x_gap_sq: float, h_gap_sq: float) -> float:
    """``psi0 = ||x_0 - x*||^2 + (eta^2 / p^2) ||h_0 - h*||^2`` (Theorem 1), on the stacked vectors.

    ``x_gap_sq = sum_i ||x_0^(i) - x*||^2``, i.e. ``N ||x_0 - x*||^2`` for Alg. 2's common start;
    ``h_gap_sq = sum_i ||h_0^(i) - grad f_i(x*)||^2``, i.e. ``sum_i ||grad f_i(x*)||^2`` for
    ``h_0 = 0``. At Corollary 1's ``eta* = 1/L, p* = sqrt(mu/L)`` the weight is ``1 / (mu L)``.
    """
    _positive("eta", eta, "give the local step size, at most 1/L")
    require(_is_real(p) and 0 < p <= 1, "p", p, "must be in (0, 1]", "give the communication probability")
    require(_is_real(x_gap_sq) and x_gap_sq >= 0, "x_gap_sq", x_gap_sq, "must be a finite number >= 0",
            "give sum_i ||x_0^(i) - x*||^2")
    require(_is_real(h_gap_sq) and h_gap_sq >= 0, "h_gap_sq", h_gap_sq, "must be a finite number >= 0",
            "give sum_i ||h_0^(i) - grad f_i(x*)||^2")
    return float(x_gap_sq + (eta / p) ** 2 * h_gap_sq)


def scaffnew_bound(eta: float, p: float, T: float, *, mu: float, L: float, epsilon: float, delta: float,
                   C: float, N: int, d: int, psi0: float, v: float = 1.0) -> float:
    """Theorem 1's right-hand side, eq. (2), with Lemma 1's sigma:

    ``theta^T psi0 + p^2 N d / (1 - theta) * v C^2 T ln(1/delta) / epsilon^2``,
    ``theta = max(1 - mu eta, 1 - p^2)``. ``T`` may be real (as in Corollary 1); at ``T = 0`` the
    value is ``psi0``.
    """
    _check_problem(mu, L, N, d, psi0)
    _check_privacy(epsilon, delta, C, v)
    require(_is_real(eta) and 0 < eta <= 1.0 / L, "eta", eta, f"must be in (0, 1/L] = (0, {1.0 / L!r}]",
            "Theorem 1 needs eta <= 1/L")
    require(_is_real(p) and 0 < p <= 1, "p", p, "must be in (0, 1]", "give the communication probability")
    require(_is_real(T) and T >= 0, "T", T, "must be a finite number >= 0", "give the number of local iterations")
    gap = min(mu * eta, p * p)  # 1 - theta, computed without cancellation
    contraction = math.exp(T * math.log1p(-gap)) * psi0
    noise = p * p * N * d / gap * v * C * C * T * math.log(1.0 / delta) / (epsilon * epsilon)
    return contraction + noise


# ---------------------------------------------------------------------------------------------
# Corollary 1
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScaffNewOptimum:
    """Corollary 1's optimum for DP-ScaffNew, with the inputs it was computed from.

    ``T`` is the real-valued ``T*`` (0 when the log argument is <= 1), ``T_integer`` the best whole
    number of iterations; ``bound`` / ``sigma`` are Theorem 1's bound and Lemma 1's noise std at
    ``T``, ``bound_integer`` / ``sigma_integer`` the same at ``T_integer``.
    """

    mu: float
    L: float
    epsilon: float
    delta: float
    C: float
    N: int
    d: int
    psi0: float
    v: float
    eta: float
    p: float
    T: float
    T_integer: int
    expected_local_steps: float
    expected_rounds: float
    log_argument: float
    bound: float
    sigma: float
    bound_integer: float
    sigma_integer: float

    @property
    def noise_multiplier(self) -> float:
        """``sigma / C`` at ``T``."""
        return self.sigma / self.C

    def describe(self) -> str:
        """The inputs and the optimum, one readable block."""
        arg = self.log_argument
        verdict = "> 1: training helps" if arg > 1 else "<= 1: no training helps, T* = 0"
        rows = [
            ("step size eta* = 1/L", f"{self.eta:.6g}"),
            ("communication probability p* = sqrt(mu/L)", f"{self.p:.6g}"),
            ("expected local steps per round 1/p*", f"{self.expected_local_steps:.6g}"),
            ("total local iterations T*", f"{self.T:.6g} (best integer: {self.T_integer})"),
            ("expected communication rounds p* T*",
             f"{self.expected_rounds:.6g} (at the integer: {self.p * self.T_integer:.6g})"),
            ("Corollary 1 log argument", f"{arg:.6g} ({verdict})"),
            ("bound on E[psi_T] at T*",
             f"{self.bound:.6g} (at the integer: {self.bound_integer:.6g}; psi0 = {self.psi0:g})"),
            ("noise std sigma at T*",
             f"{self.sigma:.6g} (at the integer: {self.sigma_integer:.6g}; sigma/C = {self.noise_multiplier:.6g})"),
        ]
        width = max(len(label) for label, _ in rows)
        lines = [
            "DP-ScaffNew optimum (paper 000, Corollary 1; bound = Theorem 1 eq. (2), sigma = Lemma 1)",
            f"  inputs: mu={self.mu:g} L={self.L:g} epsilon={self.epsilon:g} delta={self.delta:g} C={self.C:g} "
            f"N={self.N} d={self.d} psi0={self.psi0:g} v={self.v:g}",
        ] + [f"  {label:<{width}}  {value}" for label, value in rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def scaffnew_optimal(mu: float, L: float, epsilon: float, delta: float, C: float, N: int, d: int, psi0: float,
                     v: float = 1.0) -> ScaffNewOptimum:
    """Corollary 1 of paper 000: ``eta* = 1/L``, ``p* = sqrt(mu/L)`` and

    ``T* = ln(psi0 epsilon^2 ln(1/(1 - mu/L)) / (v C^2 N d ln(1/delta))) / ln(1/(1 - mu/L))``,

    clamped at 0 when the logarithm's argument is <= 1. See the module docstring for the formulas,
    the privacy calibration and the reading of the paper's typos.
    """
    _check_problem(mu, L, N, d, psi0)
    _check_privacy(epsilon, delta, C, v)
    eta = 1.0 / L
    p = math.sqrt(mu / L)
    lam = -math.log1p(-mu / L)  # ln(1/(1 - mu/L)) > 0
    # ln of Corollary 1's argument, summed in log space so large d or small epsilon cannot overflow.
    log_arg = (math.log(psi0) + 2.0 * math.log(epsilon) + math.log(lam)
               - math.log(v) - 2.0 * math.log(C) - math.log(N) - math.log(d) - math.log(math.log(1.0 / delta)))
    T = max(0.0, log_arg) / lam
    kw = dict(mu=mu, L=L, epsilon=epsilon, delta=delta, C=C, N=N, d=d, psi0=psi0, v=v)

    def bound(t: float) -> float:
        return scaffnew_bound(eta, p, t, **kw)

    lo, hi = math.floor(T), math.ceil(T)
    T_int = lo if bound(lo) <= bound(hi) else hi
    return ScaffNewOptimum(
        mu=mu, L=L, epsilon=epsilon, delta=delta, C=C, N=N, d=d, psi0=psi0, v=v,
        eta=eta, p=p, T=T, T_integer=int(T_int),
        expected_local_steps=1.0 / p, expected_rounds=p * T,
        log_argument=math.exp(log_arg) if log_arg < 700 else math.inf,
        bound=bound(T), sigma=privacy_sigma(p, T, epsilon, delta, C, v),
        bound_integer=bound(T_int), sigma_integer=privacy_sigma(p, T_int, epsilon, delta, C, v),
    )
