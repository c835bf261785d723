"""A client's update as an integer row for secure aggregation modulo ``2^bits``, and back.

Client side (:func:`encode`), each stage a pure function on torch tensors:

1. :func:`clip_l2` to ``clip`` (the sensitivity's starting point);
2. :func:`rotate`: pad to a power of two ``D``, random signs, normalised Walsh-Hadamard transform
   (``H D x / sqrt(D)``: orthogonal, so norms are kept). The signs come from a *public* per-round
   key (:func:`rotation_signs`): every client and the server use the same rotation;
3. divide by the granularity ``gamma`` (a grid step of ``gamma`` in the original units);
4. :func:`conditional_round`: unbiased randomized rounding (``floor(v) + Bernoulli(v - floor(v))``)
   redone until the integer vector's L2 norm is at most the bound of
   :func:`dpfl_lightning.privacy.discrete_accounting.rounded_l2_bound` (Kairouz et al. 2021); that
   bound is the sensitivity the accounting uses. A try fails with probability at most ``beta``;
   after ``max_tries`` failures (probability ``beta^max_tries``) the vector is rounded towards zero,
   whose norm is at most the input's: the bound holds on every path;
5. integer noise (:mod:`dpfl_lightning.privacy.discrete_noise`), then :func:`to_modular`: the
   residue in ``[0, 2^bits)``.

Server side: :func:`modular_sum` (exact, the same whatever the order or grouping of rows), then
:func:`decode`: :func:`to_signed` in ``[-2^(bits-1), 2^(bits-1))``, times ``gamma``, the inverse
rotation, the padding dropped. Without noise and wrap-around the result is the sum of the rotated
inputs' roundings: the sum of the clipped inputs plus an unbiased error of variance at most
``n gamma^2 / 4`` a coordinate (before the rotation is undone, which keeps variances' sum).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpfl_lightning.errors import require
from dpfl_lightning.privacy.discrete_accounting import rounded_l2_bound
from dpfl_lightning.privacy.discrete_noise import WordSource, hash_words

MAX_BITS = 62  # residues and the sum of two stay inside int64


def padded_dim(dim: int) -> int:
    """The power of two the rotation pads ``dim`` coordinates to."""
    require(int(dim) == dim and dim >= 1, "dim", dim, "must be a positive integer", "give the update's size")
    return 1 << (int(dim) - 1).bit_length()


def clip_l2(x: torch.Tensor, clip: float) -> torch.Tensor:
    """``x`` scaled down to L2 norm at most ``clip`` (float64)."""
    x = x.to(torch.float64)
    norm = float(torch.linalg.vector_norm(x))
    return x * (clip / norm) if norm > clip else x.clone()


def rotation_signs(key: bytes, dim: int) -> torch.Tensor:
    """The ``padded_dim(dim)`` random signs (float64 +-1) of the rotation keyed by ``key`` (public:
    e.g. ``RandomSource.key(round, rng.SERVER_CLIENT, purpose)`` in simulation mode)."""
    bits = hash_words(key, padded_dim(dim)) & np.uint64(1)
    return torch.from_numpy(1.0 - 2.0 * bits.astype(np.float64))


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """The normalised Walsh-Hadamard transform of the last dimension (a power of two): orthogonal
    and its own inverse."""
    n = x.shape[-1]
    require(n & (n - 1) == 0, "walsh_hadamard size", n, "must be a power of two", "pad with padded_dim")
    lead = x.shape[:-1]
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(*lead, n) / math.sqrt(n))


def rotate(x: torch.Tensor, key: bytes) -> torch.Tensor:
    """``H D pad(x) / sqrt(D)`` for a 1-D ``x`` (float64)."""
    d = x.shape[-1]
    padded = torch.zeros(padded_dim(d), dtype=torch.float64)
    padded[:d] = x
    return walsh_hadamard(padded * rotation_signs(key, d))


def unrotate(y: torch.Tensor, key: bytes, dim: int) -> torch.Tensor:
    """The inverse of :func:`rotate`: ``D H y / sqrt(D)``, then the first ``dim`` coordinates."""
    return (walsh_hadamard(y.to(torch.float64)) * rotation_signs(key, dim))[:dim]


def _uniforms(source: WordSource, n: int) -> torch.Tensor:
    return torch.from_numpy(source.words(n).astype(np.float64) * 2.0**-53)


def conditional_round(v: torch.Tensor, bound: float, stream: object, max_tries: int = 1000) -> torch.Tensor:
    """Unbiased randomized rounding of ``v`` (float64) to int64, redone until the L2 norm is at
    most ``bound`` (``bound >= ||v||``, e.g. :func:`rounded_l2_bound`); after ``max_tries`` failed
    tries, rounding towards zero (norm <= ``||v||``). ``stream``: a :mod:`dpfl_lightning.rng`
    stream (the client's; rounding's coins need not be secret for the guarantee)."""
    require(bound >= float(torch.linalg.vector_norm(v)) * (1 - 1e-12), "rounding bound", bound,
            "is below the vector's norm", "use rounded_l2_bound of the scaled clip")
    src = stream if isinstance(stream, WordSource) else WordSource(stream)
    low = torch.floor(v)
    frac = v - low
    low = low.to(torch.int64)
    for _ in range(max_tries):
        r = low + (_uniforms(src, v.numel()) < frac).to(torch.int64)
        if int((r * r).sum()) <= bound * bound:  # exact: an int against a float
            return r
    return torch.trunc(v).to(torch.int64)


def to_modular(r: torch.Tensor, bits: int) -> torch.Tensor:
    """``r mod 2^bits`` in ``[0, 2^bits)`` (int64)."""
    require(1 <= bits <= MAX_BITS, "bits", bits, f"must be in [1, {MAX_BITS}]", "use e.g. 16 or 32")
    return torch.remainder(r.to(torch.int64), 1 << bits)


def modular_sum(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """The sum of the rows of ``rows`` (``[clients, D]``, residues in ``[0, 2^bits)``) modulo
    ``2^bits``: exact integer arithmetic, so any order or grouping of the rows gives the same bits."""
    require(1 <= bits <= MAX_BITS, "bits", bits, f"must be in [1, {MAX_BITS}]", "use e.g. 16 or 32")
    m = 1 << bits
    per_chunk = max(1, (1 << 62) // m)  # rows summed before a reduction cannot overflow int64
    total = torch.zeros(rows.shape[1:], dtype=torch.int64)
    for lo in range(0, rows.shape[0], per_chunk):
        total = torch.remainder(total + rows[lo : lo + per_chunk].sum(0), m)
    return total


def to_signed(s: torch.Tensor, bits: int) -> torch.Tensor:
    """Residues modulo ``2^bits`` as integers in ``[-2^(bits-1), 2^(bits-1))``."""
    half = 1 << (bits - 1)
    return torch.remainder(s + half, 1 << bits) - half


def encode(x: torch.Tensor, clip: float, gamma: float, bits: int, key: bytes, stream: object, beta: float,
           noise: torch.Tensor | None = None, max_tries: int = 1000) -> torch.Tensor:
    """A client's row: clip, rotate (``key``), divide by ``gamma``, round conditionally (``beta``),
    add the integer ``noise`` (``padded_dim`` entries, or none), reduce modulo ``2^bits``."""
    require(gamma > 0 and math.isfinite(gamma), "gamma", gamma, "must be a finite number > 0", "use choose_gamma")
    v = rotate(clip_l2(x.reshape(-1), clip), key) / gamma
    bound = rounded_l2_bound(clip / gamma, v.numel(), beta)
    r = conditional_round(v, bound, stream, max_tries)
    if noise is not None:
        require(noise.shape == r.shape, "noise shape", tuple(noise.shape), f"must be {tuple(r.shape)}",
                "draw padded_dim(dim) noise values")
        r = r + noise.to(torch.int64)
    return to_modular(r, bits)


def decode(total: torch.Tensor, gamma: float, bits: int, key: bytes, dim: int) -> torch.Tensor:
    """The server's estimate of the sum of the clipped updates from the modular sum ``total``."""
    return unrotate(to_signed(total, bits).to(torch.float64) * gamma, key, dim)
