"""One round of the integer pipeline of distributed DP with secure aggregation (the stages of
:class:`~dpfl_lightning.plugins.DiscreteDistributedNoise`), between the privacy primitives
(:mod:`dpfl_lightning.privacy.quantization`, :mod:`dpfl_lightning.privacy.discrete_noise`) and the
communication ones (:mod:`dpfl_lightning.comm.secagg`, :mod:`dpfl_lightning.comm.modular_sum`).

Client side (:meth:`IntegerSumRound.client_row`): clip, rotate with the round's public key, divide
by ``gamma``, round conditionally, add the client's integer noise share, reduce modulo ``2^bits``,
mask (SecAgg / SecAgg+); the row travels as 16-bit limbs in a payload segment. A *dropped* client's
row never reaches the sum. Server side (:meth:`IntegerSumRound.decode_sum`): the limbs' sum back to
residues, the dropped clients' masks removed with the survivors' Shamir shares, to signed integers,
times ``gamma``, the inverse rotation.

Ranks: each rank holds the SecAgg secrets of the cohort's clients it trains only
(``local_clients``), in both modes: simulation keys are keyed by (seed, round, client), so the run is
the same on any number of ranks; secure keys come from the OS on the rank that trains the client.
Given the ranks' ``allgather`` and ``alltoall``, the round runs the protocol's exchanges between ranks
(:meth:`~dpfl_lightning.comm.secagg.SecAggRound.exchange` at construction: public keys to all, each
share to its holder's rank; :meth:`~dpfl_lightning.comm.secagg.SecAggRound.gather_reveals` when
unmasking), so both are collective: every rank builds the round and decodes its sum. Every rank
then unmasks the same sum with every rank's reveals, bit for bit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from dpfl_lightning.comm import modular_sum
from dpfl_lightning.comm.secagg import SecAggRound, simulate_dropouts
from dpfl_lightning.privacy import quantization as q
from dpfl_lightning.privacy.discrete_noise import WordSource, integer_noise


def row_length(bits: int, padded: int) -> int:
    """Payload values of a row of ``padded`` residues modulo ``2^bits``: their 16-bit limbs."""
    return modular_sum.limb_count(bits) * padded


@dataclass(frozen=True)
class IntegerSumSettings:
    """What every client and the server of a round agree on (all public)."""

    mechanism: str  # discrete_gaussian or skellam
    bits: int
    gamma: float
    beta: float
    clip: float
    noise_parameter: float  # a client's share, grid units: sigma^2 (discrete Gaussian) or lam (Skellam)
    secagg: bool = True
    neighbours: int | None = None
    threshold: int | None = None
    dropout: float = 0.0


@dataclass
class StageTimes:
    """Seconds spent in each stage on this rank during a round."""

    noise: float = 0.0
    rounding: float = 0.0  # clip, rotation, scaling, conditional rounding, modular reduction
    masks: float = 0.0  # SecAgg keys, shares, their exchange between ranks, masking of the rank's clients
    exchange: float = 0.0  # of ``masks``: the set-up's all-gather and all-to-all (waits for the other ranks)
    unmask: float = 0.0  # the server: limbs back to residues, masks removed, decoding
    per_client: dict = field(default_factory=dict)


class IntegerSumRound:
    """One round: the cohort, who drops, the rotation key and (with ``secagg``) the masking protocol.

    Args:
        settings: the round's :class:`IntegerSumSettings`.
        round_idx: the round.
        cohort: the round's clients (all ranks).
        dim: the length of a client's update vector (its trainable entries).
        key_source: the run's :class:`dpfl_lightning.rng.RandomSource`.
        rotation_key: the public per-round key of the rotation.
        local_clients: the cohort's clients this rank trains (default: all, one process).
        allgather, alltoall: the ranks' collectives (see :meth:`~dpfl_lightning.comm.secagg.SecAggRound.exchange`);
            needed with ``local_clients``.
    """

    def __init__(self, settings: IntegerSumSettings, round_idx: int, cohort: tuple[int, ...], dim: int,
                 key_source, rotation_key: bytes, local_clients: Iterable[int] | None = None,
                 allgather: Callable[[Any], list[Any]] | None = None,
                 alltoall: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.settings, self.round_idx, self.cohort, self.dim = settings, round_idx, tuple(cohort), dim
        self.padded = q.padded_dim(dim)
        self.key = rotation_key
        self.times = StageTimes()
        if settings.dropout > 0:
            self.survivors, self.dropped = simulate_dropouts(self.cohort, settings.dropout, round_idx, key_source)
        else:
            self.survivors, self.dropped = list(self.cohort), []
        self.secagg = None
        self._allgather = allgather
        if local_clients is not None and (allgather is None or alltoall is None):
            raise ValueError("IntegerSumRound: local_clients needs the ranks' allgather and alltoall")
        if settings.secagg and len(self.cohort) >= 2:
            t0 = time.perf_counter()
            self.secagg = SecAggRound(self.cohort, settings.bits, self.padded, round_idx, key_source,
                                      neighbours=settings.neighbours, threshold=settings.threshold,
                                      local_clients=local_clients)
            if local_clients is not None:
                t1 = time.perf_counter()
                self.secagg.exchange(allgather, alltoall)
                self.times.exchange += time.perf_counter() - t1
            self.times.masks += time.perf_counter() - t0

    @property
    def row_length(self) -> int:
        """Payload values of a row: the limbs of ``padded`` residues."""
        return row_length(self.settings.bits, self.padded)

    def residues(self, x: torch.Tensor, noise_stream, rounding_stream) -> torch.Tensor:
        """A client's un-masked row: its encoded update plus its noise share, modulo ``2^bits``."""
        s = self.settings
        t0 = time.perf_counter()
        noise = integer_noise(WordSource(noise_stream), s.mechanism, s.noise_parameter, (self.padded,))
        t1 = time.perf_counter()
        row = q.encode(x.reshape(-1).to(torch.float64), s.clip, s.gamma, s.bits, self.key, WordSource(rounding_stream),
                       s.beta, noise)
        self.times.noise += t1 - t0
        self.times.rounding += time.perf_counter() - t1
        return row

    def client_row(self, client: int, x: torch.Tensor, noise_stream, rounding_stream) -> torch.Tensor | None:
        """The limbs (float32) of ``client``'s masked row, or ``None`` when the client drops (its row
        never reaches the sum)."""
        if client in self.dropped:
            return None
        row = self.residues(x, noise_stream, rounding_stream)
        if self.secagg is not None:
            if client not in self.secagg.local_clients:
                raise RuntimeError(f"secure sum: client {client} trains on this rank but its SecAgg keys were made "
                                   "on another; the round's plan changed after the keys were exchanged (a plugin "
                                   "after DiscreteDistributedNoise edited the cohort or the local work in "
                                   "before_round): order that plugin before it")
            t0 = time.perf_counter()
            row = self.secagg.mask(client, row)
            self.times.masks += time.perf_counter() - t0
        return modular_sum.to_limbs(row, self.settings.bits)

    def modular_total(self, limb_sums: torch.Tensor) -> torch.Tensor:
        """The survivors' sum of un-masked rows modulo ``2^bits`` from the sum of their limbs (collective
        with the ranks' ``allgather``: every rank calls it)."""
        total = modular_sum.from_limb_sums(limb_sums[: self.row_length], self.settings.bits)
        if self.secagg is not None:
            reveals = None  # one process: its own reveals
            if self._allgather is not None:
                reveals = self.secagg.gather_reveals(self.survivors, self.dropped, self._allgather)
            total = self.secagg.unmask(total, self.survivors, self.dropped, reveals)
        return total

    def decode_sum(self, limb_sums: torch.Tensor) -> torch.Tensor:
        """The server's estimate (float64, ``dim`` values) of the survivors' sum of clipped updates
        plus the summed noise, from the sum of the limbs."""
        t0 = time.perf_counter()
        total = self.modular_total(limb_sums)
        out = q.decode(total, self.settings.gamma, self.settings.bits, self.key, self.dim)
        self.times.unmask += time.perf_counter() - t0
        return out
