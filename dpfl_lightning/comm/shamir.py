"""Shamir's t-of-n secret sharing of short byte strings (the keys of secure aggregation).

A secret of ``L`` bytes is cut into chunks of :data:`CHUNK_BYTES` = 15 bytes (120 bits), each an
element of the prime field ``GF(p)``, ``p = 2^127 - 1`` (a Mersenne prime, so every chunk fits with
room to spare). Each chunk ``s`` gets its own random polynomial ``f(z) = s + a_1 z + ... +
a_{t-1} z^{t-1}`` with ``a_i`` uniform in ``GF(p)``; the share of holder ``x`` (``1 <= x < p``) is
``(x, f(x))`` for every chunk. A 32-byte key is three field elements.

Properties (Shamir 1979):

- any ``t`` shares determine ``f`` and so the secret (Lagrange interpolation at 0);
- any ``t - 1`` shares are uniform and independent of the secret: for every candidate secret there
  is exactly one polynomial through them, so they carry no information about it. Reconstruction
  from fewer than ``t`` shares is refused (:class:`NotEnoughSharesError`) rather than returning a
  meaningless value.

The coefficients' randomness is a callable ``coins(n) -> n bytes``: ``os.urandom`` in secure mode,
a keyed PRG in a simulation (so shares are reproducible from the run's seed, and so is the secret).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

PRIME = 2**127 - 1  #: the field's modulus (a Mersenne prime)
CHUNK_BYTES = 15  #: bytes of secret per field element (120 bits < 127)
_ELEMENT_BYTES = 16  # coin bytes per random field element (127 bits used, rejection if == PRIME)

Coins = Callable[[int], bytes]


class NotEnoughSharesError(ValueError):
    """Fewer shares than the threshold: the secret is information-theoretically hidden."""


@dataclass(frozen=True)
class Share:
    """Holder ``x``'s share of one secret: ``f_i(x)`` for every chunk ``i``; ``length``: the secret's bytes."""

    x: int
    values: tuple[int, ...]
    length: int


def _chunks(secret: bytes) -> list[int]:
    return [int.from_bytes(secret[i : i + CHUNK_BYTES], "little") for i in range(0, len(secret), CHUNK_BYTES)]


def _field_elements(count: int, coins: Coins) -> list[int]:
    """``count`` uniform elements of ``GF(p)``: 127-bit words, the one word equal to ``p`` rejected."""
    out: list[int] = []
    while len(out) < count:
        raw = coins(_ELEMENT_BYTES * (count - len(out)))
        for i in range(0, len(raw), _ELEMENT_BYTES):
            word = int.from_bytes(raw[i : i + _ELEMENT_BYTES], "little") & PRIME  # PRIME = 2^127 - 1: a mask
            if word != PRIME:
                out.append(word)
    return out


def _check_threshold(threshold: int, n_holders: int) -> None:
    if not 1 <= threshold <= n_holders:
        raise ValueError(f"shamir: threshold={threshold} with {n_holders} holders; the threshold must be "
                         f"between 1 and the number of holders")


def split(secret: bytes, holders: Sequence[int], threshold: int, coins: Coins = os.urandom) -> dict[int, Share]:
    """Shares of ``secret`` for each ``x`` in ``holders`` (distinct, in ``1 .. p-1``), any ``threshold``
    of which reconstruct it. ``coins``: the randomness of the polynomials (default ``os.urandom``)."""
    xs = list(holders)
    _check_threshold(threshold, len(xs))
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("shamir: holders must be distinct integers in 1 .. 2^127 - 2 (0 is the secret's point)")
    if not secret:
        raise ValueError("shamir: cannot share an empty secret")
    chunks = _chunks(secret)
    randoms = _field_elements(len(chunks) * (threshold - 1), coins)
    polys = [[s] + randoms[i * (threshold - 1) : (i + 1) * (threshold - 1)] for i, s in enumerate(chunks)]
    return {x: Share(x, tuple(_evaluate(poly, x) for poly in polys), len(secret)) for x in xs}


def _evaluate(poly: list[int], x: int) -> int:
    """``poly[0] + poly[1] x + ...`` mod p (Horner)."""
    acc = 0
    for coefficient in reversed(poly):
        acc = (acc * x + coefficient) % PRIME
    return acc


@functools.lru_cache(maxsize=1024)
def lagrange_weights(xs: tuple[int, ...]) -> tuple[int, ...]:
    """``w_i = prod_{j != i} x_j / (x_j - x_i)`` mod p: ``f(0) = sum_i w_i f(x_i)`` for ``deg f < len(xs)``.
    Cached: the server reconstructs many secrets from the same holders."""
    weights = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        weights.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(weights)


def reconstruct(shares: Iterable[Share], threshold: int) -> bytes:
    """The secret from at least ``threshold`` shares (the ``threshold`` with the smallest ``x`` are used).

    Raises :class:`NotEnoughSharesError` with fewer than ``threshold`` distinct shares, and
    ``ValueError`` for shares of different secrets' lengths or shares that do not decode to a
    secret of their declared length (shares of different secrets, or corrupted ones)."""
    by_x = {s.x: s for s in shares}
    if len(by_x) < threshold:
        raise NotEnoughSharesError(f"shamir: {len(by_x)} distinct share(s) for a threshold of {threshold}; "
                                   f"fewer than the threshold reveal nothing about the secret")
    chosen = [by_x[x] for x in sorted(by_x)[:threshold]]
    lengths = {s.length for s in chosen}
    if len(lengths) != 1 or len({len(s.values) for s in chosen}) != 1:
        raise ValueError("shamir: the shares belong to different secrets (lengths differ)")
    length = lengths.pop()
    weights = lagrange_weights(tuple(s.x for s in chosen))
    out = bytearray()
    for i in range(len(chosen[0].values)):
        value = sum(w * s.values[i] for w, s in zip(weights, chosen)) % PRIME
        width = min(CHUNK_BYTES, length - i * CHUNK_BYTES)
        if value >= 1 << (8 * width):
            raise ValueError("shamir: the shares do not decode to a secret (shares of different secrets, or corrupted)")
        out += value.to_bytes(width, "little")
    return bytes(out)
