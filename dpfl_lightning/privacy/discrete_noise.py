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
   discrete Gaussian's interval comes from IEEE-754 arithmetic (+, -, x, / correctly rounded) with
   a margin 32 times the worst-case rounding error; the Poisson sampler's from ``log``/``log1p``/
   ``exp`` with a margin of ``2^-36`` (relative), ~10^5 times these functions' error in any libm.
3. Bernoulli(``exp(-gamma)``) for rational ``gamma``: Canonne, Kamath, Steinke (NeurIPS 2020),
   Algorithm 1: ``floor(gamma)`` Bernoulli(``exp(-1)``) trials, then the series loop
   ``A ~ Bernoulli(g / K)`` for the fractional part ``g``, drawn as Bernoulli(``g``) and
   Bernoulli(``1/K``) (independent, so their product is Bernoulli(``g/K``)).
4. Bernoulli(``a``) for a real ``a`` such as ``exp(-gamma) 2^b`` (:func:`bernoulli_enclosed`): the
   lazy comparison of kind 2 with a float interval from ``numpy.exp`` (margin ``2^-40``
   relative, the libm assumption of the Poisson sampler below); undecided (probability ~1e-11),
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

The Poisson sampler is rejection from a proposal with rational weights: a block
``b`` of ``w = ceil(sqrt(lam))`` integers around the mode with probability ``2^-(|b|+2)``, uniform
inside it; the acceptance ``p(k) 2^|b| / (p(mode) M)`` is rational because ``p(k)/p(mode) =
lam^(k - mode) mode!/k!``, and ``M`` (its maximum) is found exactly from the log-concavity of the
Poisson pmf. Skellam(``lam``) is Poisson(``lam``) - Poisson(``lam``): variance ``2 lam``; a sum of
independent Skellams is Skellam with the summed parameter.
"""

from __future__ import annotations

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
        return torch.randint(0, _TWO53, (n,), generator=gen, dtype=torch.int64).numpy().astype(np.uint64)

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
    out = (w % np.uint64(m)).astype(np.int64)
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
MAX_POISSON = 2**26  # lam above this: the exact envelope and rare exact comparisons take seconds
_STIRLING_FROM = 16  # ln k! by Stirling's series from here, by gammaln below
_MARGIN = 2.0**-36


def _stirling_tail(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``s(x) = ln x! - ((x + 1/2) ln x - x + ln(2 pi)/2)`` by its series to ``x^-5`` and the bound
    on the error (the first omitted term: the series alternates, x > 0)."""
    x = x.astype(np.float64)
    s = 1.0 / (12.0 * x) - 1.0 / (360.0 * x**3) + 1.0 / (1260.0 * x**5)
    return s, 1.0 / (1680.0 * x**7)


def _log_ratio(k: np.ndarray, m: int, lam: Fraction) -> tuple[np.ndarray, np.ndarray]:
    """``ln(p(k) / p(m)) = (k - m) ln lam - ln(k!/m!)`` for the Poisson(``lam``) pmf, in float64,
    and a bound on its error (the ``_MARGIN`` assumption on log/log1p, see module docstring)."""
    from scipy.special import gammaln

    j = (k - m).astype(np.float64)
    out = np.empty(k.shape)
    err = np.empty(k.shape)
    big = (k >= _STIRLING_FROM) & (m >= _STIRLING_FROM)
    if big.any():  # the stable form: no cancellation between ln k! and ln m!
        kb, jb = k[big].astype(np.float64), j[big]
        l1 = math.log1p(float((lam - m) / m))
        lk = np.log1p(jb / m)
        sk, ek = _stirling_tail(kb)
        sm, em = _stirling_tail(np.array([float(m)]))
        out[big] = jb * l1 - (kb + 0.5) * lk + jb - sk + sm
        err[big] = _MARGIN * (np.abs(jb) * abs(l1) + (kb + 0.5) * np.abs(lk) + np.abs(jb) + 1.0) + ek + em
    small = ~big
    if small.any():
        lnk, lnm = gammaln(k[small] + 1.0), float(gammaln(m + 1.0))
        jl = j[small] * math.log(float(lam))
        out[small] = jl - (lnk - lnm)
        err[small] = _MARGIN * (np.abs(jl) + lnk + lnm + 1.0)
    return out, err


class Ratio(NamedTuple):
    """A positive rational as an unreduced pair (exact; no gcd on huge integers)."""

    numerator: int
    denominator: int

    def times(self, num: int, den: int = 1) -> Ratio:
        return Ratio(self.numerator * num, self.denominator * den)

    def __lt__(self, other: object) -> bool:  # type: ignore[override]
        assert isinstance(other, Ratio)
        return self.numerator * other.denominator < other.numerator * self.denominator


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


def _block_peak(b: int, m: int, w: int) -> int:
    """The ``k`` of block ``b`` where ``p(k)`` is largest: the end nearest the mode ``m``."""
    return m + b * w if b >= 0 else m + (b + 1) * w - 1


def _envelope(lam: Fraction, m: int, w: int) -> Ratio:
    """``M = max_k p(k)/p(m) 2^|b(k)|``, exactly: ``ln p`` is concave and ``p`` peaks at the mode
    ``m = floor(lam)``, so along each side the block peaks' values are log-concave in ``b``: climb
    while the next is no smaller."""
    def value(b: int) -> Ratio:
        return _ratio_exact(_block_peak(b, m, w), m, lam).times(1 << abs(b))

    best = value(0)
    for step in (1, -1):
        b = step
        if _block_peak(b, m, w) < 0:
            continue
        here = value(b)
        while _block_peak(b + step, m, w) >= 0:
            nxt = value(b + step)
            if nxt < here:
                break
            b, here = b + step, nxt
        best = here if best < here else best
    return best


def _two_sided_geometric(src: WordSource, size: int) -> np.ndarray:
    """Block indices ``b`` with ``P(b) = 2^-(|b| + 2)``: a sign bit and a geometric count of
    trailing zero bits, (minus, 0) redrawn as rejected."""
    g = np.zeros(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        w = src.words(todo.size)
        low = w & (~w + np.uint64(1))
        zero = w == 0
        g[todo[~zero]] += np.log2(low[~zero].astype(np.float64)).astype(np.int64)
        g[todo[zero]] += WORD_BITS
        todo = todo[zero]
    neg = (src.words(size) & np.uint64(1)).astype(bool)
    b = np.where(neg, -g, g)
    b[neg & (g == 0)] = np.iinfo(np.int64).min  # rejected
    return b


def poisson(source: object, lam: float | Fraction, n: int) -> np.ndarray:
    """``n`` exact draws of Poisson(``lam``), ``lam`` a positive rational (a float is the rational
    it stores), int64 (rejection from rational-weight blocks, see module docstring)."""
    src = _as_source(source)
    lamf = as_fraction(lam, "poisson.lam")
    require(lamf <= MAX_POISSON, "poisson.lam", float(lamf), f"is above {MAX_POISSON:.3g}, where the exact sampler's "
            "set-up and rare exact comparisons cost seconds", "use a coarser grid (a larger gamma): noise of std "
            "2^12 grid steps already makes rounding's share of the variance negligible")
    m = math.floor(lamf)
    w = max(1, math.isqrt(math.ceil(lamf) - 1) + 1)  # ceil(sqrt(lam))
    envelope = _envelope(lamf, m, w)
    ln_env = math.log(envelope.numerator) - math.log(envelope.denominator)
    parts, have = [], 0
    while have < n:
        size = int((n - have) * 2.5) + 16
        b = _two_sided_geometric(src, size)
        u = randint(src, np.full(size, w, dtype=np.int64))
        ok = b != np.iinfo(np.int64).min
        k = m + b * w + u
        ok &= k >= 0
        k, b = k[ok], b[ok]
        log_r, err = _log_ratio(k, m, lamf)
        log_a = log_r + np.abs(b) * _LN2 - ln_env
        err = err + 2.0**-40 * (np.abs(b) * _LN2 + abs(ln_env) + 1.0)
        lo = np.exp(log_a - err) * (1 - 2.0**-40)
        hi = np.minimum(np.exp(log_a + err) * (1 + 2.0**-40), 1.0)

        def accept_p(i: int, k=k, b=b) -> Ratio:
            r = _ratio_exact(int(k[i]), m, lamf).times(1 << abs(int(b[i])))
            return r.times(envelope.denominator, envelope.numerator)

        keep = bernoulli_interval(src, lo, hi, accept_p)
        parts.append(k[keep])
        have += int(keep.sum())
    return np.concatenate(parts)[:n]


def skellam(source: object, lam: float | Fraction, n: int) -> np.ndarray:
    """``n`` exact draws of Skellam(``lam``) = Poisson(``lam``) - Poisson(``lam``): mean 0,
    variance ``2 lam``; ``n`` clients' Skellam(``lam``) sum to Skellam(``n lam``). int64."""
    x = poisson(source, lam, 2 * n)
    return x[:n] - x[n:]


NOISES = ("discrete_gaussian", "skellam")


def integer_noise(stream: object, kind: str, parameter: float | Fraction, shape: tuple[int, ...]) -> torch.Tensor:
    """Integer noise of ``shape`` as a torch int64 tensor: ``kind`` ``"discrete_gaussian"``
    (``parameter`` = sigma^2, in grid units) or ``"skellam"`` (``parameter`` = lam; variance 2 lam)."""
    require(kind in NOISES, "integer_noise.kind", kind, "unknown noise", f"use one of {NOISES}")
    n = math.prod(shape)
    draw = discrete_gaussian if kind == "discrete_gaussian" else skellam
    return torch.from_numpy(draw(stream, parameter, n)).view(tuple(shape))
