"""Sums of integer rows modulo ``2^bits`` through a float all-reduce, exact for any number of ranks.

Secure aggregation sums residues modulo ``m = 2^bits`` (``bits <= 62``). The communicator's
all-reduce and the trainer's payload carry floats; a residue is carried exactly as ``L =
ceil(bits / 16)`` *limbs* of 16 bits (``r = sum_k limb_k 2^(16 k)``), each an integer below
``2^16``, exact in float32 and float64. The limbs of ``n`` rows sum to integers below ``n 2^16``:
exact in float64 for ``n < 2^37``, in any order and grouping of the rows over ranks. The modular
sum is then rebuilt in integer arithmetic: ``sum_k (S_k mod 2^(bits - 16 k)) 2^(16 k) mod 2^bits``
(:func:`from_limb_sums`). No float grid, no rounding: one rank or many give the same bits.

:func:`allreduce_mod_` does this with the communicator's own ``allreduce_sum_`` (float64); the
trainer's payload carries the limbs in a segment (:func:`to_limbs`) and the server rebuilds the sum
from the segment's sum.
"""

from __future__ import annotations

import torch

from dpfl_lightning.errors import ConfigError

LIMB_BITS = 16
LIMB = 1 << LIMB_BITS
MAX_BITS = 62
MAX_ROWS = 1 << 37  #: limb sums of more rows could leave float64's exact integers (2^53)


def check_bits(bits: int) -> int:
    """``bits`` if it is an integer in ``1 .. 62``, else a :class:`ConfigError`."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ConfigError("bits", bits, f"a modulus 2^bits needs bits in 1..{MAX_BITS} (int64 residues)",
                          "use e.g. 16, 20 or 32")
    return bits


def limb_count(bits: int) -> int:
    """How many 16-bit limbs hold a residue modulo ``2^bits``."""
    return -(-check_bits(bits) // LIMB_BITS)


def to_limbs(rows: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Residues ``rows`` (int64 in ``[0, 2^bits)``, shape ``[..., D]``) as ``[..., L * D]`` floats:
    limb ``k`` of every coordinate in block ``k`` (values in ``[0, 2^16)``, exact)."""
    count = limb_count(bits)
    rows = rows.to(torch.int64)
    if bool(((rows < 0) | (rows >= (1 << bits))).any()):
        raise ValueError(f"modular_sum.to_limbs: residues must lie in [0, 2^{bits})")
    parts = [torch.bitwise_and(torch.bitwise_right_shift(rows, LIMB_BITS * k), LIMB - 1) for k in range(count)]
    return torch.cat(parts, dim=-1).to(dtype)


def from_limb_sums(sums: torch.Tensor, bits: int) -> torch.Tensor:
    """The sum modulo ``2^bits`` (int64 in ``[0, 2^bits)``, ``D`` values) of the rows whose limbs
    (:func:`to_limbs`) summed to ``sums`` (``L * D`` floats, integers below ``2^53``)."""
    count = limb_count(bits)
    if sums.numel() % count:
        raise ValueError(f"modular_sum.from_limb_sums: {sums.numel()} values are not {count} limb blocks")
    s = sums.to(torch.float64)
    if not bool(torch.all((s >= 0) & (s < 2.0**53) & (s == torch.round(s)))):
        raise ValueError("modular_sum.from_limb_sums: limb sums must be non-negative integers below 2^53 "
                         "(a row was not limbs of residues, or too many rows were summed)")
    limbs = s.to(torch.int64).reshape(count, -1)
    m = 1 << bits
    total = torch.zeros(limbs.shape[1], dtype=torch.int64)
    for k in range(count):
        shift = LIMB_BITS * k
        term = torch.remainder(limbs[k], 1 << (bits - shift)) * (1 << shift)  # < 2^bits <= 2^62
        total = torch.remainder(total + term, m)  # both < 2^62: no int64 overflow
    return total


def local_mod_sum(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """The column sums of int64 residues ``rows`` (``[k, D]``) modulo ``2^bits``, in one process."""
    check_bits(bits)
    rows = rows.reshape(-1, rows.shape[-1]).to(torch.int64)
    return from_limb_sums(to_limbs(rows, bits, torch.float64).sum(0), bits)


def allreduce_mod_(comm, residues: torch.Tensor, bits: int) -> torch.Tensor:
    """Every rank's int64 residues (``D`` values in ``[0, 2^bits)``; one rank may hold the sum of
    many rows already reduced) summed modulo ``2^bits`` over the ranks with ``comm.allreduce_sum_``
    on their float64 limbs: the same bits on every rank, for any number of ranks. Returns a new tensor."""
    limbs = to_limbs(residues.reshape(-1), bits, torch.float64).contiguous()
    if comm is not None and getattr(comm, "size", 1) > 1:
        comm.allreduce_sum_(limbs)
    return from_limb_sums(limbs, bits)
