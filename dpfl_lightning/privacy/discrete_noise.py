"""Exact samplers of integer noise: the discrete Gaussian and the Skellam distribution.

Threat model: the noise a client adds before secure aggregation (Kairouz, Liu, Steinke, ICML 2021;
Agarwal, Kairouz, Liu, NeurIPS 2021). Continuous samplers in floating point leak through their low
bits (Mironov 2012); these samplers output integers whose distribution is *exactly* the target
for the parameter given as a rational number (a float is the rational it stores), driven only by
uniform random integers.

Sources of randomness: :class:`WordSource` wraps a :mod:`dpfl_lightning.rng` stream. A
``HashStream`` (keyed, reproducible from the seed) and a ``SecureStream`` (the CSPRNG of secure
mode) give their 53-bit ``words``; a ``TorchStream`` (simulation noise streams) gives
``torch.randint(0, 2**53)``, uniform because 2^53 divides 2^64. Draws are reproducible from the
stream's key, whatever the batch split, because every round of the vectorised rejection loops reads
the stream in a fixed order.

Exactness argument (every random decision is one of four kinds):

1. ``randint(m)``: a 53-bit word ``w`` is kept when ``w < floor(2^53 / m) m`` and then ``w mod m``
   is uniform on ``{0, ..., m-1}``; other words are redrawn. Bernoulli(``a/m``) is
   ``randint(m) < a``. Integer arithmetic only.
2. Bernoulli(``f``) for a rational ``f`` in [0, 1] known to lie in a float interval
   ``[lo, hi]`` (*lazy comparison*): the uniform real ``U = 0.w1 w2 ...`` (53 bits a word) is
   compared with ``f``: with the first word, ``U < f`` is certain when ``(w1 + 1) 2^-53 <= lo`` and
   ``U >= f`` when ``w1 2^-53 >= hi`` (both comparisons exact in float64). Otherwise (probability
   ``hi - lo + 2^-53``, ~1e-12) ``f`` is computed as a :class:`fractions.Fraction` and compared
   with ``U``'s prefix in integer arithmetic, word after word, until decided. The interval only
   decides *when* the exact computation runs, never the outcome, provided it contains ``f``: the
   CKS reference's and the Poisson sampler's intervals come from IEEE-754 arithmetic (+, -, x, /
   and int-to-float conversion, correctly rounded) with margins of at least 16 times the worst-case
   rounding error, and from nothing else.
3. Bernoulli(``exp(-gamma)``) for rational ``gamma``: Canonne, Kamath, Steinke (NeurIPS 2020),
   Algorithm 1: ``floor(gamma)`` Bernoulli(``exp(-1)``) trials, then the series loop
   ``A ~ Bernoulli(g / K)`` for the fractional part ``g``, drawn as Bernoulli(``g``) and
   Bernoulli(``1/K``) (independent, so their product is Bernoulli(``g/K``)).
4. Bernoulli(``a``) for a real ``a`` such as ``exp(-gamma) 2^b`` (:func:`bernoulli_enclosed`): the
   lazy comparison of kind 2 with a float interval from ``numpy.exp`` (margin ``2^-40``
   relative: the assumption that ``exp`` is within ``2^-41`` relative, ~2^11 times its error in
   any libm, the one assumption beyond IEEE-754 in this module); undecided (probability ~1e-11),
   ``a`` is enclosed between rationals by :func:`exp_neg_fixed` (alternating Taylor series and
   repeated squaring, every bound rounded outward), refined until it separates from ``U``'s
   prefix, read word after word.

The discrete Gaussian (:func:`discrete_gaussian`) is a rejection sampler in one vector pass a
batch: ``|x|`` from blocks of width ``w`` (:func:`block_width`: ``w^2 >= 1.4 sigma^2``), block
``b`` with probability ``2^-(b+1)`` (trailing zero bits), uniform inside it, a fair sign
((minus, 0) rejected), accepted with Bernoulli(``exp(-x^2 / (2 sigma^2)) 2^b``) (kind 4; at most
1 by the choice of ``w``). Accepted ``x`` has probability proportional to ``2^-(b+1) / w *
exp(-x^2 / (2 sigma^2)) 2^b``, i.e. to ``exp(-x^2 / (2 sigma^2))``; about half the candidates
are kept, at three words each. :func:`discrete_gaussian_cks` is CKS Algorithm 3 (discrete
Laplace proposal of integer scale ``t = floor(sigma) + 1``, Algorithm 2, accepted with
Bernoulli(``exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2))``)), kinds 1-3 only, the slower reference.

The Poisson sampler (:func:`poisson`) is rejection from a proposal with integer weights, built
once a ``lam`` (:func:`poisson_table`, cached) and decided in one vector pass a batch at about two
words a draw. Around the mode ``m = floor(lam)`` (``+- 8 sqrt(lam) + 16``), exact integer bounds
``u_k <= 2^160 R_k <= u_k + |k - m|`` of ``R_k = p(k)/p(m) = lam^(k-m) m!/k!`` come from the
recurrence ``R_(k+1) = R_k lam/(k+1)`` run outward in integers, rounded down
(:func:`pmf_ratio_bounds`); blocks of ``B = floor(sqrt(lam)/32)`` integers get the integer weight
``W_b >= 2^K R_k`` for each of their ``k`` (``K`` makes the weights sum to ~2^45); beyond the table,
two geometric tails (block ``j`` of width ``v`` with weight ``H 2^-j``, ``H`` the table end's weight,
``v`` such that ``R_k`` halves over ``v`` steps, checked in integers) cover every ``k >= 0``. A
candidate is one word uniform on the total weight (kind 1), mapped to a block and an offset by an
alias table in integers (:func:`integer_alias`: a bijection, so ``P(k) = W_b / total`` exactly), and
is kept with Bernoulli(``2^K R_k / W_b``) (kind 2: float bounds from ``u_k`` within ~2^-48; the
exact ``Ratio`` when undecided, probability ~1e-14). About 1.2% of the candidates are rejected
(the blocks' flat tops). No ``log``/``exp`` is involved: the Poisson draws are exact given correctly
rounded IEEE-754 arithmetic alone. Skellam(``lam``) is Poisson(``lam``) - Poisson(``lam``): variance
``2 lam``; a sum of independent Skellams is Skellam with the summed parameter.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Callable, NamedTuple

import numpy as np
import torch

from dpfl_lightning.errors import require

WORD_BITS = 53
_TWO53 = 1 << WORD_BITS
_ULP = 2.0**-WORD_BITS
_LN2 = math.log(2.0)


class WordSource:
    """Uniform 53-bit integers from a :mod:`dpfl_lightning.rng` stream (see module docstring).

    Words are read from the stream in blocks of at least ``BLOCK`` and handed out in order, so the
    stream is left further on than the words used: give a sampler a stream of its own."""

    BLOCK = 1 << 14

    def __init__(self, stream: object) -> None:
        self.stream = stream
        if not hasattr(stream, "words") and getattr(stream, "generator", None) is None:
            raise TypeError(f"{type(stream).__name__} gives neither words() nor a torch generator")
        self._buf = np.zeros(0, dtype=np.uint64)
        self._pos = 0

    def _read(self, n: int) -> np.ndarray:
        if hasattr(self.stream, "words"):
            return np.asarray(self.stream.words(n), dtype=np.uint64)
        gen = getattr(self.stream, "cpu_generator", None) or self.stream.generator
        return torch.randint(0, _TWO53, (n,), generator=gen, dtype=torch.int64).numpy().view(np.uint64)

    def words(self, n: int) -> np.ndarray:
        """``n`` independent uniform integers in ``[0, 2^53)`` (uint64)."""
        if n <= 0:
            return np.zeros(0, dtype=np.uint64)
        left = self._buf.size - self._pos
        if left < n:
            fresh = self._read(max(n - left, self.BLOCK))
            self._buf = np.concatenate([self._buf[self._pos :], fresh])
            self._pos = 0
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def word(self) -> int:
        return int(self.words(1)[0])


def hash_words(key: bytes, n: int) -> np.ndarray:
    """The first ``n`` words of the keyed SHAKE-256 stream of ``key`` (``rng.HashStream``)."""
    try:
        from dpfl_lightning.federated.rng import HashStream
    except ImportError:
        from dpfl_lightning.rng import HashStream
    return HashStream(key).words(n)


def _as_source(source: object) -> WordSource:
    return source if isinstance(source, WordSource) else WordSource(source)


# ------------------------------------------------------------------------------ exact primitives
def randint(src: WordSource, m: np.ndarray) -> np.ndarray:
    """Uniform integers in ``[0, m_i)`` for each ``m_i`` in ``[1, 2^53]`` (int64), by rejection."""
    m = np.asarray(m, dtype=np.uint64)
    out = np.empty(m.shape, dtype=np.uint64)
    pending = np.arange(m.size)
    while pending.size:
        w = src.words(pending.size)
        mm = m[pending]
        ok = w < (np.uint64(_TWO53) // mm) * mm
        out[pending[ok]] = w[ok] % mm[ok]
        pending = pending[~ok]
    return out.astype(np.int64)


def _exact_less(src: WordSource, first_word: int, f: Fraction | Ratio) -> bool:
    """Whether ``U < f`` for the uniform real ``U`` whose first 53 bits are ``first_word`` and whose
    further bits are read from ``src`` as needed (exact integer comparison)."""
    prefix, bits = first_word, WORD_BITS
    while True:
        scaled = f.numerator << bits  # f 2^bits = scaled / denominator
        if (prefix + 1) * f.denominator <= scaled:
            return True
        if prefix * f.denominator >= scaled:
            return False
        prefix, bits = (prefix << WORD_BITS) | src.word(), bits + WORD_BITS


def bernoulli_interval(src: WordSource, lo: np.ndarray, hi: np.ndarray,
                       exact: Callable[[int], Fraction | Ratio]) -> np.ndarray:
    """Bernoulli(``f_i``) where ``lo_i <= f_i <= hi_i`` and ``exact(i)`` is ``f_i`` as a Fraction
    (lazy comparison, see module docstring). Returns a bool array."""
    w = src.words(lo.size)
    wf = w.astype(np.float64) * _ULP  # exact: w < 2^53
    yes = wf + _ULP <= lo
    no = wf >= hi
    out = yes.copy()
    for i in np.flatnonzero(~(yes | no)):  # rare: decided in exact arithmetic
        out[i] = _exact_less(src, int(w[i]), exact(int(i)))
    return out


def randint_below(src: WordSource, m: int, size: int) -> np.ndarray:
    """``size`` uniform integers in ``[0, m)`` for one ``m`` in ``[1, 2^53]`` (int64): the same
    rejection as :func:`randint` (a rejected word is redrawn, in order), without its per-element
    bookkeeping."""
    limit = np.uint64((_TWO53 // m) * m)
    w = src.words(size)
    out = (w % np.uint64(m)).view(np.int64)  # below 2^53
    bad = np.flatnonzero(w >= limit)
    if bad.size:  # probability below m / 2^53 a word
        out[bad] = randint(src, np.full(bad.size, m, dtype=np.int64))
    return out


def bernoulli_ratio(src: WordSource, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(``num_i / den_i``) for integers ``0 <= num_i <= den_i < 2^53``: the float quotient is
    within a relative ``2^-53`` of the ratio (one correctly rounded division of exact operands), so
    the lazy comparison is exact."""
    num = np.asarray(num, dtype=np.int64)
    den = np.asarray(den, dtype=np.int64)
    p = num.astype(np.float64) / den.astype(np.float64)
    return bernoulli_interval(src, p * (1 - 2.0**-52), p * (1 + 2.0**-52), lambda i: Fraction(int(num[i]), int(den[i])))


def bernoulli_exp_rational(src: WordSource, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(``exp(-num_i/den_i)``) for integers ``0 <= num_i <= den_i`` with ``den_i K`` below
    2^53 for the K reached (CKS Algorithm 1: ``A ~ Bernoulli(gamma / K)`` until ``A = 0``; 1 iff
    the final ``K`` is odd)."""
    num = np.asarray(num, dtype=np.int64)
    den = np.asarray(den, dtype=np.int64)
    k = np.ones(num.shape, dtype=np.int64)
    active = np.flatnonzero(num > 0)
    while active.size:
        a = bernoulli_ratio(src, num[active], den[active] * k[active])
        k[active[a]] += 1
        active = active[a]
    return (k % 2) == 1


def bernoulli_exp_minus_one(src: WordSource, n: int) -> np.ndarray:
    """``n`` Bernoulli(``exp(-1)``) draws (CKS Algorithm 1 with gamma = 1)."""
    one = np.ones(n, dtype=np.int64)
    return bernoulli_exp_rational(src, one, one)


def _survive_exp_minus_one(src: WordSource, counts: np.ndarray) -> np.ndarray:
    """Whether ``counts_i`` independent Bernoulli(``exp(-1)``) draws all come out 1."""
    alive = np.ones(counts.shape, dtype=bool)
    left = counts.astype(np.int64).copy()
    todo = np.flatnonzero(left > 0)
    while todo.size:
        ok = bernoulli_exp_minus_one(src, todo.size)
        alive[todo[~ok]] = False
        left[todo] -= 1
        todo = todo[ok & (left[todo] > 0)]
    return alive


def bernoulli_exp_interval(src: WordSource, g_lo: np.ndarray, g_hi: np.ndarray,
                           exact: Callable[[int], Fraction]) -> np.ndarray:
    """Bernoulli(``exp(-g_i)``) for rational ``g_i >= 0`` with ``g_lo_i <= g_i <= g_hi_i`` and
    ``exact(i) = g_i`` (CKS Algorithm 1; interval-guided exact comparisons)."""
    n = g_lo.size
    whole = np.floor(np.maximum(g_lo, 0.0))
    sure = whole == np.floor(g_hi)
    whole_i = whole.astype(np.int64)
    frac_lo = np.clip(g_lo - whole, 0.0, 1.0)
    frac_hi = np.clip(g_hi - whole, 0.0, 1.0)
    exact_frac: dict[int, Fraction] = {}
    for i in np.flatnonzero(~sure):  # floor undecided by the interval: take it exactly
        g = exact(int(i))
        whole_i[i] = math.floor(g)
        exact_frac[int(i)] = g - whole_i[i]
        frac_lo[i], frac_hi[i] = 0.0, 1.0

    def frac(i: int) -> Fraction:
        return exact_frac[i] if i in exact_frac else exact(i) - int(whole_i[i])

    alive = _survive_exp_minus_one(src, whole_i)
    k = np.ones(n, dtype=np.int64)  # CKS Algorithm 1 on the fractional part
    active = np.flatnonzero(alive)
    while active.size:
        one_in_k = bernoulli_ratio(src, np.ones(active.size, dtype=np.int64), k[active])
        cand = active[one_in_k]
        a = np.zeros(active.size, dtype=bool)
        if cand.size:
            a[one_in_k] = bernoulli_interval(src, frac_lo[cand], frac_hi[cand], lambda j: frac(int(cand[j])))
        k[active[a]] += 1
        active = active[a]
    return alive & ((k % 2) == 1)


# ------------------------------------------------------------------------------ discrete Laplace
def discrete_laplace(source: object, t: int, n: int) -> np.ndarray:
    """``n`` draws of the discrete Laplace ``P(x) ∝ exp(-|x|/t)`` on the integers, integer ``t >= 1``
    (CKS Algorithm 2), int64."""
    src = _as_source(source)
    require(int(t) == t and t >= 1, "discrete_laplace.t", t, "must be an integer >= 1", "give an integer scale")
    t = int(t)
    parts, have = [], 0
    while have < n:
        m = int((n - have) * 1.7) + 16
        u = randint(src, np.full(m, t, dtype=np.int64))
        keep = bernoulli_exp_rational(src, u, np.full(m, t, dtype=np.int64))
        u = u[keep]
        v = np.zeros(u.size, dtype=np.int64)
        active = np.arange(u.size)
        while active.size:  # V: the number of exp(-1) successes before the first failure
            ok = bernoulli_exp_minus_one(src, active.size)
            v[active[ok]] += 1
            active = active[ok]
        x = u + t * v
        neg = (src.words(x.size) & np.uint64(1)).astype(bool)
        good = ~(neg & (x == 0))
        y = np.where(neg, -x, x)[good]
        parts.append(y)
        have += y.size
    return np.concatenate(parts)[:n]


# ------------------------------------------------------------------------------ discrete Gaussian
def as_fraction(value: float | int | Fraction, setting: str) -> Fraction:
    """``value`` as the exact rational it denotes (a float is the dyadic rational it stores)."""
    require(isinstance(value, (int, float, Fraction)) and math.isfinite(float(value)) and value > 0, setting, value,
            "must be a finite number > 0", "give a positive finite number (a float or a fractions.Fraction)")
    return Fraction(value)


def discrete_gaussian_cks(source: object, sigma2: float | Fraction, n: int) -> np.ndarray:
    """``n`` exact draws of the discrete Gaussian ``N_Z(0, sigma2)``, ``P(x) ∝ exp(-x^2 / (2
    sigma2))`` on the integers by CKS Algorithm 3 (discrete Laplace proposal), int64: the
    reference sampler, slower than :func:`discrete_gaussian` (its Bernoulli loops run many short
    vector passes). ``sigma2`` is a rational (a float is taken as the rational it stores);
    ``source`` a :mod:`dpfl_lightning.rng` stream or :class:`WordSource`."""
    src = _as_source(source)
    s2 = as_fraction(sigma2, "discrete_gaussian.sigma2")
    t = math.isqrt(math.floor(s2)) + 1  # floor(sigma) + 1: floor(sqrt(x)) = isqrt(floor(x))
    c = s2 / t
    c_f, two_s2_f = float(c), float(2 * s2)
    parts, have = [], 0
    while have < n:
        m = int((n - have) * 1.5) + 16
        y = discrete_laplace(src, t, m)
        ay = np.abs(y).astype(np.float64)  # exact below 2^53 (larger |y|: see the exact path)
        d = ay - c_f
        g = d * d / two_s2_f
        err = 2.0**-44 * ((ay + c_f) ** 2 / two_s2_f + 1.0)
        big = np.abs(y) >= (1 << 52)
        err[big] = np.inf

        def gamma(i: int, y=y) -> Fraction:
            return (abs(int(y[i])) - c) ** 2 / (2 * s2)

        keep = bernoulli_exp_interval(src, np.maximum(g - err, 0.0), g + err, gamma)
        parts.append(y[keep])
        have += int(keep.sum())
    return np.concatenate(parts)[:n]


_LOW52 = np.uint64((1 << 52) - 1)


def signed_geometric(src: WordSource, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``size`` pairs (``g``, sign): ``P(g) = 2^-(g + 1)`` for ``g >= 0``, the trailing zero bits of a
    word's low 52 bits (all zero: 52 more, and the next word's low 52 bits), and an independent
    fair sign from the first word's bit 52."""
    w = src.words(size)
    neg = (w >> np.uint64(52)).astype(bool)
    g = np.zeros(size, dtype=np.int64)
    todo = np.arange(size)
    low = w & _LOW52
    while True:
        zero = low == 0
        nz = ~zero
        lowest = low[nz] & (~low[nz] + np.uint64(1))
        g[todo[nz]] += np.bitwise_count(lowest - np.uint64(1)).astype(np.int64)
        if not zero.any():
            return g, neg
        todo = todo[zero]
        g[todo] += 52
        low = src.words(todo.size) & _LOW52


LN2_ABOVE = Fraction(7, 10)  # a rational above ln 2 (0.6931...)


def block_width(s2: Fraction) -> int:
    """The smallest integer ``w >= 1`` with ``w^2 >= 2 (7/10) s2``: then for every block ``b >= 1`` and
    ``j >= b w``, ``j^2 / (2 s2) >= b^2 (7/10) >= b ln 2``, so the acceptance ``exp(-j^2 / (2 s2))
    2^b`` of :func:`discrete_gaussian` is at most 1 (exact rational check)."""
    need = 2 * LN2_ABOVE * s2
    w = max(1, math.isqrt(math.ceil(need)))
    while w * w < need:
        w += 1
    return w


def exp_neg_fixed(g: Fraction, bits: int) -> tuple[int, int]:
    """Integers ``(lo, hi)`` with ``lo 2^-bits <= exp(-g) <= hi 2^-bits`` and ``hi - lo <= 1 + ...``
    (width below ``2^-bits`` before the final outward rounding), for a rational ``g >= 0``, exact:
    ``exp(-g) = exp(-y)^(2^s)`` with ``y = g 2^-s < 1/2``; the Taylor series of ``exp(-y)``
    alternates with decreasing terms, so two consecutive partial sums bracket it; each bound is
    rounded outward to the grid ``2^-p`` and squared ``s`` times (monotone on ``[0, 1+]``)."""
    s = max(0, g.numerator.bit_length() - g.denominator.bit_length() + 2)
    y = g / (1 << s)
    p = bits + s + 4
    tiny = Fraction(1, 1 << (p + 2))
    term = prev = total = Fraction(1)
    k = 0
    while True:
        k += 1
        term = term * y / k
        prev, total = total, (total - term if k % 2 else total + term)
        if term <= tiny:
            break
    lo, hi = min(prev, total), max(prev, total)
    lo_i = (lo.numerator << p) // lo.denominator
    hi_i = -((-(hi.numerator << p)) // hi.denominator)
    for _ in range(s):
        lo_i, hi_i = (lo_i * lo_i) >> p, -((-(hi_i * hi_i)) >> p)
    shift = p - bits
    return lo_i >> shift, -((-hi_i) >> shift)


def _enclosed_less(src: WordSource, first_word: int, enclose: Callable[[int], tuple[int, int]]) -> bool:
    """Whether ``U < a`` for the uniform real ``U`` whose first 53 bits are ``first_word`` (further
    bits read from ``src`` as needed), where ``enclose(bits)`` gives integers with ``lo 2^-bits <= a
    <= hi 2^-bits``: refine ``a`` or read ``U`` further until the two intervals separate (``a``
    irrational or ``1``: this ends with probability 1)."""
    prefix, nbits, prec = first_word, WORD_BITS, WORD_BITS + 16
    while True:
        lo, hi = enclose(prec)
        m = max(prec, nbits)
        u_lo, u_hi = prefix << (m - nbits), (prefix + 1) << (m - nbits)
        a_lo, a_hi = lo << (m - prec), hi << (m - prec)
        if u_hi <= a_lo:
            return True
        if u_lo >= a_hi:
            return False
        if a_hi - a_lo >= u_hi - u_lo:
            prec += 64
        else:
            prefix, nbits = (prefix << WORD_BITS) | src.word(), nbits + WORD_BITS


def bernoulli_enclosed(src: WordSource, lo: np.ndarray, hi: np.ndarray,
                       enclose: Callable[[int, int], tuple[int, int]]) -> np.ndarray:
    """Bernoulli(``a_i``) where ``lo_i <= a_i <= hi_i`` (float64) and ``enclose(i, bits)`` encloses
    ``a_i`` exactly to ``bits`` bits (:func:`_enclosed_less`): a real ``a_i`` such as ``exp(-g)``."""
    w = src.words(lo.size)
    wf = w.astype(np.float64) * _ULP
    yes = wf + _ULP <= lo
    no = wf >= hi
    out = yes.copy()
    for i in np.flatnonzero(~(yes | no)):  # rare: decided in exact arithmetic
        out[i] = _enclosed_less(src, int(w[i]), lambda bits, i=int(i): enclose(i, bits))
    return out


def discrete_gaussian(source: object, sigma2: float | Fraction, n: int) -> np.ndarray:
    """``n`` exact draws of the discrete Gaussian ``N_Z(0, sigma2)``, ``P(x) ∝ exp(-x^2 / (2
    sigma2))`` on the integers, int64, in one vector pass a batch (module docstring: block
    proposal, one lazy comparison a candidate). ``sigma2`` is a rational (a float is taken as the
    rational it stores); ``source`` a :mod:`dpfl_lightning.rng` stream or :class:`WordSource`."""
    src = _as_source(source)
    s2 = as_fraction(sigma2, "discrete_gaussian.sigma2")
    w = block_width(s2)
    two_s2, two_s2_f = 2 * s2, float(2 * s2)
    parts, have = [], 0
    while have < n:
        size = int((n - have) * 2.0) + 16  # ~0.53 of the candidates are kept
        b, neg = signed_geometric(src, size)
        j = b * w + randint_below(src, w, size)
        jf = j.astype(np.float64)  # exact below 2^53 (larger: the exact path)
        g = jf * jf / two_s2_f  # within a relative 2^-51 of j^2 / (2 s2)
        bl = b * _LN2
        log_a = bl - g  # ln of the acceptance exp(-g) 2^b, within 2^-50 (g + bl)
        err = 2.0**-48 * (g + bl + 1.0)
        top = np.exp(log_a + err)  # assumed within a relative 2^-41 of exp (module docstring)
        hi = np.minimum(top * (1 + 2.0**-40), 1.0)
        lo = top * (1 - 2.0 * err - 2.0**-39)  # <= exp(log_a + err) exp(-2 err) <= the acceptance
        big = j >= (1 << 52)
        lo[big], hi[big] = 0.0, 1.0

        def enclose(i: int, bits: int, j=j, b=b) -> tuple[int, int]:  # exp(-g) 2^b to `bits` bits
            return exp_neg_fixed(Fraction(int(j[i]) ** 2) / two_s2, bits + int(b[i]))

        keep = bernoulli_enclosed(src, lo, hi, enclose) & ~(neg & (j == 0))
        parts.append(np.where(neg, -j, j)[keep])
        have += int(keep.sum())
    return np.concatenate(parts)[:n]


# ------------------------------------------------------------------------------ Poisson, Skellam
MAX_POISSON = 2**30  # lam above this: the table (16 sqrt(lam) entries) takes ~0.5 s and 12 MB to build
TABLE_SIGMAS = 8  # the table spans the mode +- (8 sqrt(lam) + 16); beyond it, the geometric tails
FIXED_BITS = 160  # fixed-point precision of the exact pmf-ratio bounds
TOTAL_BITS = 45  # the table's weights sum to about 2^45: a randint word is rejected with probability < 2^-8
BLOCKS_PER_SIGMA = 32  # blocks of floor(sqrt(lam) / 32) integers share a weight: ~1% rejected, a small table
POISSON_CHUNK = 1 << 16  # draws a vector pass (arrays that stay in cache)


class Ratio(NamedTuple):
    """A positive rational as an unreduced pair (exact; no gcd on huge integers)."""

    numerator: int
    denominator: int

    def times(self, num: int, den: int = 1) -> Ratio:
        return Ratio(self.numerator * num, self.denominator * den)


def _range_product(lo: int, hi: int) -> int:
    """``lo (lo + 1) ... (hi - 1)`` by binary splitting (fast for long ranges of big factors)."""
    if hi - lo <= 32:
        return math.prod(range(lo, hi))
    mid = (lo + hi) // 2
    return _range_product(lo, mid) * _range_product(mid, hi)


def _ratio_exact(k: int, m: int, lam: Fraction) -> Ratio:
    """``p(k) / p(m) = lam^(k - m) m! / k!`` exactly."""
    if k >= m:
        return Ratio(lam.numerator ** (k - m), lam.denominator ** (k - m) * _range_product(m + 1, k + 1))
    return Ratio(lam.denominator ** (m - k) * _range_product(k + 1, m + 1), lam.numerator ** (m - k))


def pmf_ratio_bounds(lam: Fraction, m: int, k_lo: int, k_hi: int, bits: int = FIXED_BITS) -> list[int]:
    """Integers ``u_k`` for ``k = k_lo .. k_hi`` (``k_lo <= m <= k_hi``) with ``u_k <= R_k 2^bits <= u_k +
    |k - m|``, where ``R_k = p(k) / p(m)`` for the Poisson(``lam``) pmf and ``m = floor(lam)``, in exact
    integer arithmetic: ``u_m = 2^bits`` and outward from the mode ``R_(k+1) = R_k lam / (k + 1)``,
    ``R_(k-1) = R_k k / lam``, each step rounded down. Each factor is at most 1 (``k + 1 > lam`` above
    the mode, ``k <= lam`` below it), so a step adds less than one unit to the error and never enlarges
    it."""
    num, den = lam.numerator, lam.denominator
    up: list[int] = []
    push, x = up.append, 1 << bits
    for d in range(den * (m + 1), den * (k_hi + 1), den):  # d = den (k + 1), k = m .. k_hi - 1
        x = x * num // d
        push(x)
    down: list[int] = []
    push, x = down.append, 1 << bits
    for k in range(m * den, k_lo * den, -den):  # k den, k = m .. k_lo + 1
        x = x * k // num
        push(x)
    return down[::-1] + [1 << bits] + up


class AliasTable(NamedTuple):
    """Walker's alias method on integer masses, exact: the word ``u`` uniform on ``[0, capacity n)`` is
    bucket ``i = u // capacity`` at ``r = u % capacity``; the bucket holds ``cut[i]`` units of entry
    ``i`` (from its offset ``own_base[i]``) and the rest of entry ``alias[i]`` (from ``alias_base[i]``).
    Each entry's pieces tile ``[0, mass)``, so :meth:`locate` maps the ``capacity n`` words one to one onto
    the pairs (entry, offset below its mass); entry ``n - 1`` is padding (see :func:`integer_alias`)."""

    capacity: int
    cut: np.ndarray  # int64 arrays, one element a bucket
    alias: np.ndarray
    own_base: np.ndarray
    alias_base: np.ndarray

    def locate(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The entry and the offset in its mass of each word ``u`` (int64, ``0 <= u < capacity n``)."""
        i = u // self.capacity
        r = u - i * self.capacity
        cut = self.cut[i]
        own = r < cut
        return np.where(own, i, self.alias[i]), np.where(own, self.own_base[i] + r, self.alias_base[i] + r - cut)


def integer_alias(masses: list[int]) -> AliasTable:
    """The alias table (Vose's construction, in integers) of ``masses`` and one more entry, padding of
    mass ``capacity n - sum(masses)`` (below ``n``) where ``capacity = ceil(sum / n)`` and ``n =
    len(masses) + 1``."""
    n = len(masses) + 1
    capacity = -(-sum(masses) // n)
    mass = list(masses) + [capacity * n - sum(masses)]
    used = [0] * n  # units of each entry placed so far, from offset 0 up
    cut, alias, own_base, alias_base = [capacity] * n, list(range(n)), [0] * n, [0] * n
    small = [i for i in range(n) if mass[i] < capacity]
    large = [i for i in range(n) if mass[i] > capacity]
    while small:  # the entries still open hold capacity units each on average: a large one exists
        i, j = small.pop(), large.pop()
        cut[i], own_base[i], used[i] = mass[i] - used[i], used[i], mass[i]  # bucket i: the rest of entry i
        alias[i], alias_base[i] = j, used[j]  # topped up with entry j's next units
        used[j] += capacity - cut[i]
        left = mass[j] - used[j]
        if left < capacity:
            small.append(j)
        elif left > capacity:
            large.append(j)
    for i in range(n):  # the rest: entries with exactly capacity units left, their own bucket whole
        if used[i] < mass[i]:
            assert mass[i] - used[i] == capacity and cut[i] == capacity
            own_base[i] = used[i]
    as64 = [np.array(x, dtype=np.int64) for x in (cut, alias, own_base, alias_base)]
    return AliasTable(capacity, *as64)


class PoissonTail(NamedTuple):
    """A geometric tail of the proposal beyond the table: from ``start`` in direction ``step`` (+1 or
    -1), block ``j`` (``width`` integers, probability ``2^-(j+1)`` within the tail) with weight
    ``height 2^-j`` an integer, in the table's units; the tail's total weight is ``2 width height``."""

    start: int
    step: int
    width: int
    height: int


class PoissonTable(NamedTuple):
    """The exact rejection proposal of :func:`poisson` for one ``lam`` (see :func:`poisson_table`)."""

    lam: Fraction
    mode: int
    k_lo: int  # the table holds k = k_lo .. k_lo + accept_lo.size - 1
    shift: int  # K: a block's weight W_b is at least 2^K R_k for each of its k
    width: int  # B: integers a block (the last one may be shorter)
    block_weights: np.ndarray  # W_b, int64
    blocks: AliasTable  # the blocks' masses W_b |b| (and padding, rejected)
    accept_lo: np.ndarray  # float64 bounds, for each k of the table, of its acceptance 2^K R_k / W_b(k)
    accept_hi: np.ndarray
    tails: tuple[PoissonTail, ...]
    total: int  # the proposal's total weight (table and tails), below 2^53

    def tail_total(self) -> int:
        return sum(2 * t.width * t.height for t in self.tails)

    def table_total(self) -> int:
        return self.blocks.capacity * self.blocks.cut.size


def _tail_width(lam: Fraction, start: int, step: int) -> int:
    """The smallest ``v >= 1`` with ``rho^v <= 1/2`` (exact), ``rho = lam / (start + 1)`` above the table
    and ``start / lam`` below it: ``R_k`` then falls at least by half over every block of ``v``."""
    num, den = (lam.numerator, lam.denominator * (start + 1)) if step > 0 else (start * lam.denominator, lam.numerator)
    if num == 0:
        return 1

    def halves(v: int) -> bool:
        return 2 * num**v <= den**v

    v = max(1, math.ceil(_LN2 / max(math.log(den) - math.log(num), 1e-300)) - 1)  # a guess, then exact
    while not halves(v):
        v += 1
    while v > 1 and halves(v - 1):
        v -= 1
    return v


@functools.lru_cache(maxsize=8)
def poisson_table(lam: Fraction, half_width: int | None = None) -> PoissonTable:
    """The proposal for Poisson(``lam``) (module docstring). Over ``k = mode +- half_width`` (default
    ``8 sqrt(lam) + 16``): the integer bounds ``V_k = floor(u_k 2^(K - bits) (1 + 2^-50)) + 2 >= 2^K R_k``
    (:func:`pmf_ratio_bounds`: ``u_k <= 2^bits R_k <= u_k + |k - m|``; correctly rounded float operations
    whose results are exact or bounded with margins), ``K`` such that they sum to about ``2^45``; blocks
    of ``B = floor(sqrt(lam) / 32)`` integers weigh ``W_b = max V_k`` over the block, each of their
    integers proposed with probability ``W_b / total`` (:func:`integer_alias` over the blocks' masses
    ``W_b |b|``). Beyond, two geometric tails (:class:`PoissonTail`) whose heights are the ``V`` at the
    table's ends and whose block width halves ``R_k`` (:func:`_tail_width`, exact). The acceptance
    ``2^K R_k / W_b`` is enclosed by ``accept_lo`` and ``accept_hi`` (one pair a ``k``), within ~2^-48 of
    each other. Cached: a run passes one ``lam`` to every client."""
    m = math.floor(lam)
    half = math.isqrt(math.ceil(TABLE_SIGMAS**2 * lam)) + 17 if half_width is None else int(half_width)
    k_lo, k_hi = max(0, m - half), m + half
    ext_lo = max(0, k_lo - 1)
    u = pmf_ratio_bounds(lam, m, ext_lo, k_hi + 1)
    uf = np.fromiter(map(float, u), dtype=np.float64, count=len(u))  # each within a relative 2^-53 of u_k
    dist = np.abs(np.arange(ext_lo, k_hi + 2) - m).astype(np.float64)
    K = TOTAL_BITS - math.ceil(math.log2(float(uf.sum()) * 2.0**-FIXED_BITS))
    s = FIXED_BITS - K
    assert s > 24 and dist[0] < 2**24 and dist[-1] < 2**24
    lower = np.ldexp(uf, -s)  # ~ u_k 2^-s <= 2^K R_k <= (u_k + d_k) 2^-s < u_k 2^-s + 1
    # floor(x (1 + 2^-50)) + 2 > u_k 2^-s + 1: an integer weight >= 2^K R_k, by correctly rounded float ops
    bound = np.floor(lower * (1 + 2.0**-50)) + 2.0
    inner = slice(k_lo - ext_lo, len(u) - 1)
    width = max(1, math.isqrt(math.floor(lam)) // BLOCKS_PER_SIGMA)
    starts = np.arange(0, k_hi + 1 - k_lo, width)
    block_w = np.maximum.reduceat(bound[inner], starts)  # exact: integers below 2^53
    wf = np.repeat(block_w, width)[: k_hi + 1 - k_lo]
    # the acceptance 2^K R_k / W_b(k), between these with margins over three or four roundings of 2^-53
    accept_lo = lower[inner] / wf * (1 - 2.0**-49)
    accept_hi = np.minimum((lower[inner] + np.ldexp(dist[inner], -s)) / wf * (1 + 2.0**-49), 1.0)
    tails = [PoissonTail(k_hi + 1, 1, _tail_width(lam, k_hi + 1, 1), int(bound[-1]))]
    if k_lo > 0:
        tails.append(PoissonTail(k_lo - 1, -1, _tail_width(lam, k_lo - 1, -1), int(bound[0])))
    weights = block_w.astype(np.int64)
    lengths = np.diff(np.append(starts, k_hi + 1 - k_lo))
    blocks = integer_alias([int(w) * int(n) for w, n in zip(weights, lengths)])
    table = PoissonTable(lam, m, k_lo, K, width, weights, blocks, accept_lo, accept_hi, tuple(tails), 0)
    table = table._replace(total=table.table_total() + table.tail_total())
    require(table.total < _TWO53, "poisson.lam", float(lam), "gives a proposal too large for one word",
            f"keep lam <= {MAX_POISSON}")
    for a in (weights, accept_lo, accept_hi, *blocks[1:]):
        a.flags.writeable = False
    return table


def _tail_candidates(table: PoissonTable, src: WordSource,
                     offset: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates whose proposal word fell ``offset`` past the table's weight, in a tail: the tail by
    its share of the weight, block ``j`` with probability ``2^-(j+1)`` (:func:`signed_geometric`, sign
    unused), uniform inside it. Returns ``k``, ``j`` and the tail's height (int64 arrays)."""
    right = table.tails[0]
    left = table.tails[-1]
    is_right = offset < 2 * right.width * right.height
    j, _ = signed_geometric(src, offset.size)
    width = np.where(is_right, right.width, left.width)
    inside = randint(src, width)
    k = np.where(is_right, right.start + j * width + inside, left.start - j * width - inside)
    return k, j, np.where(is_right, right.height, left.height)


def _poisson_candidates(table: PoissonTable, src: WordSource, size: int, exact: bool) -> np.ndarray:
    """One vector pass of :func:`poisson`'s rejection sampler: ``size`` proposals from one word each
    (``u`` by :func:`randint_below` on the total weight: below the table's, the block ``b`` and the
    offset ``o < W_b |b|`` that the alias table maps it to, and ``k`` the block's ``o // W_b``-th
    integer, uniform; above, a tail, :func:`_tail_candidates`), each kept with probability ``2^K R_k /
    W_b`` by the lazy comparison (one word; the exact rational when undecided, or always when
    ``exact``). Returns the kept ``k``."""
    u = randint_below(src, table.total, size)
    in_table = table.table_total()
    blk, offset = table.blocks.locate(np.minimum(u, in_table - 1))
    pad = table.block_weights.size  # the alias table's padding entry: rejected
    w = table.block_weights[np.minimum(blk, pad - 1)]
    at = np.minimum(blk * table.width + offset // w, table.accept_lo.size - 1)
    k = table.k_lo + at
    lo, hi = table.accept_lo[at], table.accept_hi[at]
    padded = (blk == pad) & (u < in_table)
    lo[padded], hi[padded] = 0.0, 0.0
    tail = np.flatnonzero(u >= in_table)
    in_tail: dict[int, tuple[int, int]] = {}
    if tail.size:  # probability ~1e-15 with the default table
        kt, j, height = _tail_candidates(table, src, u[tail] - in_table)
        k[tail] = kt
        lo[tail], hi[tail] = 0.0, (kt >= 0).astype(np.float64)  # k < 0: rejected
        in_tail = {int(i): (int(a), int(h)) for i, a, h in zip(tail, j, height)}
    if exact:
        lo, hi = np.zeros(size), np.where((k >= 0) & ~padded, 1.0, 0.0)

    def accept(i: int) -> Ratio:
        ratio = _ratio_exact(int(k[i]), table.mode, table.lam)
        if i in in_tail:
            j_i, height_i = in_tail[i]
            return ratio.times(1 << (table.shift + j_i), height_i)
        return ratio.times(1 << table.shift, int(w[i]))

    return k[bernoulli_interval(src, lo, hi, accept)]


def poisson(source: object, lam: float | Fraction, n: int, exact_reference: bool = False) -> np.ndarray:
    """``n`` exact draws of Poisson(``lam``), ``lam`` a positive rational (a float is the rational
    it stores), int64: rejection from :func:`poisson_table`'s proposal (module docstring), about two
    words a draw. ``exact_reference=True`` decides every acceptance in exact rational arithmetic
    (slow): the float filter only decides *when* that runs, so both give the same draws from the same
    stream."""
    lamf = as_fraction(lam, "poisson.lam")
    require(lamf <= MAX_POISSON, "poisson.lam", float(lamf), f"is above {MAX_POISSON:.3g}, where the exact sampler's "
            "table takes seconds and ~10 MB to build", "use a coarser grid (a larger gamma): noise of std "
            "2^12 grid steps already makes rounding's share of the variance negligible")
    return sample_poisson(poisson_table(lamf), source, n, exact_reference)


def sample_poisson(table: PoissonTable, source: object, n: int, exact_reference: bool = False) -> np.ndarray:
    """``n`` draws of Poisson(``table.lam``) from ``table`` (:func:`poisson`; any ``half_width``)."""
    src = _as_source(source)
    parts, have = [np.zeros(0, dtype=np.int64)], 0
    while have < n:
        need = min(n - have, POISSON_CHUNK)  # ~1.2% of the candidates are rejected
        kept = _poisson_candidates(table, src, need + need // 50 + 16, exact_reference)
        parts.append(kept)
        have += kept.size
    return np.concatenate(parts)[:n]


def skellam(source: object, lam: float | Fraction, n: int, exact_reference: bool = False) -> np.ndarray:
    """``n`` exact draws of Skellam(``lam``) = Poisson(``lam``) - Poisson(``lam``): mean 0,
    variance ``2 lam``; ``n`` clients' Skellam(``lam``) sum to Skellam(``n lam``). int64."""
    x = poisson(source, lam, 2 * n, exact_reference)
    return x[:n] - x[n:]


NOISES = ("discrete_gaussian", "skellam")


def integer_noise(stream: object, kind: str, parameter: float | Fraction, shape: tuple[int, ...]) -> torch.Tensor:
    """Integer noise of ``shape`` as a torch int64 tensor: ``kind`` ``"discrete_gaussian"``
    (``parameter`` = sigma^2, in grid units) or ``"skellam"`` (``parameter`` = lam; variance 2 lam)."""
    require(kind in NOISES, "integer_noise.kind", kind, "unknown noise", f"use one of {NOISES}")
    n = math.prod(shape)
    draw = discrete_gaussian if kind == "discrete_gaussian" else skellam
    return torch.from_numpy(draw(stream, parameter, n)).view(tuple(shape))
