"""Secure aggregation by pairwise masking, with dropouts: SecAgg (Bonawitz et al., "Practical Secure
Aggregation for Privacy-Preserving Machine Learning", CCS 2017) and its sparse-graph variant SecAgg+
(Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020), simulated.

The protocol, for the clients ``u`` of a round's cohort, integer rows ``x_u`` in ``Z_{2^b}^d``:

1. **Keys.** Each client draws an X25519 key pair ``(sk_u, pk_u)`` and a 32-byte self-mask seed
   ``b_u``; the public keys are broadcast.
2. **Shares.** Each client Shamir-shares ``sk_u`` and ``b_u`` (``t``-of-``k+1``, see
   :mod:`dpfl_lightning.comm.shamir`) among its *holders*: itself and its ``k`` neighbours.
3. **Masked rows.** For each neighbour ``v``, ``s_uv = HKDF-SHA256(X25519(sk_u, pk_v), info =
   (round, min(u,v), max(u,v)))`` -- the same for ``u`` and ``v`` -- is expanded by AES-256-CTR into
   ``d`` words uniform modulo ``2^b`` (64-bit words masked to ``b`` bits: exact, ``2^b`` divides
   ``2^64``). Client ``u`` sends ``y_u = x_u + PRG(b_u) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv)
   mod 2^b``. Alone, ``y_u`` is uniform (``PRG(b_u)`` is), whatever ``x_u``.
4. **Unmasking.** The server sums the rows it received (the *survivors*' rows; a modular
   all-reduce, :func:`mod_sum`). The pairwise masks between survivors cancel. For a *dropped*
   client (keys shared, row never arrived) the survivors reveal their shares of ``sk_u``: the server
   recomputes and removes ``u``'s pairwise masks with its surviving neighbours. For a survivor they
   reveal shares of ``b_u`` and the server removes ``PRG(b_u)``. No client's ``sk`` and ``b`` are both
   revealed (the double masking that keeps a late row secret). The result is the survivors' sum
   modulo ``2^b``, bit for bit; with fewer than ``t`` survivors (or fewer than ``t`` surviving holders
   of a secret the server needs) the round is refused (:class:`TooFewSurvivorsError`).

**Neighbour graph (SecAgg+).** With ``neighbours=k < n-1`` the clients are placed on a ring in the
order of a public permutation keyed by the round, and each is the neighbour of the ``k/2`` nearest
on either side (the Harary graph ``H_{k,n}``, randomly labelled, as in Bell et al.): per-client cost
``O(k d + k^2)`` instead of ``O(n d + n^2)``. Bell et al. show that ``k = O(log n)`` suffices against
a server colluding with a ``gamma`` fraction of clients with a ``delta`` fraction of dropouts, the
constant growing with ``gamma``, ``delta`` and the statistical security parameter; their concrete
example: with ``n = 10^4``, 5% corrupt clients and 5% dropouts, each client talks to ~3% of the cohort
(``k`` ~ 300). A small ``k`` (e.g. ``2 ceil(log2 n)``) is a cost point, not a security claim; pick ``k``
from the paper's tables for the corruption and dropout rates you assume. ``k >= n - 1`` (or
``None``) is SecAgg's complete graph.

**Threshold.** ``t`` of a client's ``k+1`` holders reconstruct its secrets. The default,
:func:`default_threshold`, is a strict majority ``floor((k+1)/2) + 1``: two disjoint sets of ``t``
holders cannot exist, so the server cannot obtain both ``sk_u`` (from holders told ``u`` dropped) and
``b_u`` (from others told it survived). Bonawitz et al. analyse ``t > n/2``-type thresholds against an
honest-but-curious server and larger ones (``t > 2n/3``) against an active one. ``t - 1`` colluding
holders learn nothing of a secret.

**Modes.** The key source is a :class:`dpfl_lightning.rng.RandomSource` (anything with ``key(round,
client, purpose, tag)`` and ``secure``):

- *simulation* (``secure`` false): ``sk_u``, ``b_u`` and the Shamir coefficients come from the key
  ``key(round, u, SECAGG, "secagg/client")`` (128 bits; SHAKE-256 to 32 bytes for each, domain-separated),
  so a run is reproducible from its seed -- and anyone who knows the seed can recompute every mask:
  the masking then protects nothing towards them, it only reproduces the protocol's arithmetic,
  failure modes and cost;
- *secure* (``secure`` true): ``sk_u`` is ``X25519PrivateKey.generate()`` and ``b_u`` and the Shamir
  coefficients are ``os.urandom`` (the OS CSPRNG), drawn on the rank that trains ``u``; they are in
  no seed, log or checkpoint.

The public graph permutation and the simulated dropouts come from the key source in both modes
(keyed by round, and by client for dropouts; never by rank).

**One unmasking request per round.** Each client answers the server's unmasking request once per
round, and for each peer reveals either its share of ``sk`` (the peer dropped) or of ``b`` (it
survived), never both: Bonawitz et al.'s Round 4 (Unmasking), which a client enters after the
consistency check of Round 3 and answers once, for the one set of survivors it was shown. A
:class:`SecAggRound` keeps what its clients answered: a second :meth:`~SecAggRound.reveal` in the round
that a client already answered, or one that lists as surviving a client that an earlier answer
treated as dropped (or the reverse), is refused (:class:`UnmaskingRefusedError`). Without this a
server could ask twice -- ``u`` dropped, then ``u`` alive -- get both ``sk_u`` and ``b_u``, and strip
all of ``u``'s masks from a row of ``u`` that arrives late.

**Threat model of the simulation.** It computes what SecAgg's honest-but-curious variant computes.
It does not simulate the transport's confidentiality: shares travel between ranks in the clear, to
the holder's rank only (the real protocol encrypts them to the holder with a second key agreement
and authenticated encryption, relayed by the server), and there are no signatures: the rule above is
kept by each rank for the clients it trains (all of them in one process), and
:meth:`~SecAggRound.gather_reveals` first checks that every rank was shown the same survivors (the
consistency round; unsigned: the ranks trust each other's word, as processes of one run), so a server
cannot show holders on different ranks different survivor sets through it; a transport that calls
:meth:`~SecAggRound.reveal` directly must run its own consistency check (or keep a strict-majority
threshold: no two disjoint sets of ``t`` holders). Masking changes no sensitivity: the server sees exactly the survivors' sum
modulo ``2^b``; a DP guarantee on that sum is the noise's.

Ranks: a :class:`SecAggRound` holds the secrets of *its* clients only (``local_clients``: the
clients the rank trains) and every client's public key. :meth:`SecAggRound.exchange` runs the set-up
between ranks: the public keys are all-gathered, and each share message goes to the rank of its
holder only (an all-to-all): a rank receives the shares its clients hold, as those clients would,
so a rank learns a client's secret only when ``t`` of its holders train there (a coalition of ``t``
clients, which the threshold is chosen against). :meth:`SecAggRound.gather_reveals` all-gathers
the surviving holders' reveals (they go to the server, and every rank plays the server: each
unmasks the same sum, bit for bit). Simulation keys are keyed by (seed, round, client), so a run is
the same on any number of ranks; secure keys are drawn on the rank that trains the client and leave
it only as public keys and Shamir shares. The primitives (:meth:`~SecAggRound.public_keys`,
:meth:`~SecAggRound.add_public_keys`, :meth:`~SecAggRound.shares_to_send`,
:meth:`~SecAggRound.receive_shares`, :meth:`~SecAggRound.reveal`) are public for other transports.
With ``local_clients=None`` (one process holding every client) the exchanges happen inside.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dpfl_lightning.comm import shamir
from dpfl_lightning.errors import ConfigError

# The stream purpose of every key of this module (``comm`` imports nothing but ``errors``, so the number
# is fixed here: 10 is unused by :mod:`dpfl_lightning.rng`'s core purposes 1..9, and every key taken
# under it also carries a ``secagg/...`` tag, so it never equals a key of another use).
SECAGG = 10
SERVER_CLIENT = -1  # the "client" of the round's public keys (as rng.SERVER_CLIENT)
MAX_BITS = 62  #: largest modulus exponent: sums of two reduced values stay below 2^63 (int64)
SEED_BYTES = 32


class KeySource(Protocol):
    """What :class:`SecAggRound` needs of :class:`dpfl_lightning.rng.RandomSource`."""

    secure: bool

    def key(self, round_idx: int, client: int, purpose: int, tag: str = "") -> bytes: ...


class TooFewSurvivorsError(RuntimeError):
    """Fewer surviving clients than the threshold: the round's sum cannot (and must not) be unmasked."""


class UnmaskingRefusedError(RuntimeError):
    """An unmasking request the clients must not answer: a second one in the round, or one whose
    survivors contradict an earlier answer (module docstring: one unmasking request per round)."""


# ---------------------------------------------------------------------------------- modular rows
def check_bits(bits: int) -> int:
    """``bits`` if it is an integer in ``1 .. MAX_BITS``, else a :class:`ConfigError`."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ConfigError("secagg.bits", bits, f"the modulus 2^bits needs bits in 1..{MAX_BITS} (int64 rows)",
                          f"choose an integer bit-width between 1 and {MAX_BITS}")
    return bits


def _as_words(row: torch.Tensor | np.ndarray) -> np.ndarray:
    """An int64 row (any values; negative ones are their two's complement) as a fresh uint64 array."""
    array = row.detach().cpu().numpy() if isinstance(row, torch.Tensor) else np.asarray(row)
    if array.dtype != np.int64:
        raise TypeError(f"secagg: rows must be int64, got {array.dtype}")
    return array.view(np.uint64).copy()


def _to_tensor(words: np.ndarray, bits: int) -> torch.Tensor:
    """uint64 words reduced modulo ``2^bits``, as an int64 tensor with values in ``[0, 2^bits)``."""
    np.bitwise_and(words, np.uint64((1 << bits) - 1), out=words)
    return torch.from_numpy(words.view(np.int64))


def mod_sum(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """The column sums of the int64 ``rows`` (``[k, d]`` or ``[d]``) modulo ``2^bits``, in ``[0, 2^bits)``.

    Exact for any values and any number of rows: uint64 addition wraps modulo ``2^64``, a multiple of
    ``2^bits``. To sum across ranks, all-reduce these results (each below ``2^bits``; with ``R`` ranks
    the int64 sum is exact while ``R * 2^bits < 2^63``) and apply :func:`mod_sum` once more."""
    check_bits(bits)
    words = _as_words(rows)
    total = words.sum(axis=0, dtype=np.uint64) if words.ndim == 2 else words
    return _to_tensor(np.array(total, dtype=np.uint64, copy=True), bits)


# ---------------------------------------------------------------------------------- key material
def prg_words(seed: bytes, d: int) -> np.ndarray:
    """``d`` uniform 64-bit words from the 32-byte ``seed``: AES-256 in counter mode on zeros.

    Every seed is used once (a fresh key pair or ``b_u`` per round, HKDF bound to round and pair),
    so the fixed zero nonce is safe."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"secagg: PRG seeds are {SEED_BYTES} bytes, got {len(seed)}")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(encryptor.update(bytes(8 * d)), dtype="<u8")


def pair_seed(shared_secret: bytes, round_idx: int, u: int, v: int) -> bytes:
    """The seed of the mask between ``u`` and ``v`` in round ``round_idx`` (symmetric in ``u``, ``v``)."""
    info = b"dpfl-secagg/pair" + struct.pack("<qqq", round_idx, min(u, v), max(u, v))
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None, info=info).derive(shared_secret)


def agree(private_key: X25519PrivateKey, peer_public: bytes, round_idx: int, u: int, v: int) -> bytes:
    """:func:`pair_seed` of the X25519 exchange between ``private_key`` and ``peer_public`` (raw, 32 bytes)."""
    shared = private_key.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return pair_seed(shared, round_idx, u, v)


class AesCoins:
    """A keyed byte stream (AES-256-CTR) for Shamir's coefficients in a simulation."""

    def __init__(self, seed: bytes) -> None:
        self._encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()

    def __call__(self, n: int) -> bytes:
        return self._encryptor.update(bytes(n))


def _expand_key(key: bytes, label: bytes) -> bytes:
    return hashlib.shake_256(b"dpfl-secagg/" + label + key).digest(SEED_BYTES)


# ---------------------------------------------------------------------------------- the graph
def default_threshold(n_holders: int) -> int:
    """A strict majority of a secret's holders (see the module docstring)."""
    return n_holders // 2 + 1


class NeighbourGraph:
    """Who masks with whom: the complete graph (SecAgg) or a randomly labelled Harary graph (SecAgg+).

    Public: the permutation is keyed by the round only, so every rank and the server build the same."""

    def __init__(self, cohort: Sequence[int], neighbours: int | None, round_idx: int, key_source: KeySource) -> None:
        n = len(cohort)
        self.complete = neighbours is None or neighbours >= n - 1
        if not self.complete and (isinstance(neighbours, bool) or neighbours < 2 or neighbours % 2):
            raise ConfigError("secagg.neighbours", neighbours, "the SecAgg+ ring graph needs an even number "
                              "of neighbours, at least 2", "use an even k (or None for the complete graph)")
        self.degree = n - 1 if self.complete else int(neighbours)
        self.members = frozenset(cohort)
        if self.complete:
            self._order, self._position = list(cohort), {}
            return
        key = key_source.key(round_idx, SERVER_CLIENT, SECAGG, tag="secagg/graph")
        words = np.frombuffer(hashlib.shake_256(key).digest(8 * n), dtype="<u8")
        self._order = [cohort[i] for i in np.argsort(words, kind="stable")]
        self._position = {c: i for i, c in enumerate(self._order)}

    def neighbours(self, client: int) -> tuple[int, ...]:
        """``client``'s neighbours, sorted."""
        if client not in self.members:
            raise KeyError(f"secagg: client {client} is not in the round's cohort")
        if self.complete:
            return tuple(sorted(c for c in self._order if c != client))
        n, i = len(self._order), self._position[client]
        half = self.degree // 2
        return tuple(sorted(self._order[(i + s) % n] for s in range(-half, half + 1) if s != 0))

    def holders(self, client: int) -> tuple[int, ...]:
        """Who holds shares of ``client``'s secrets: itself and its neighbours, sorted."""
        return tuple(sorted(self.neighbours(client) + (client,)))


# ---------------------------------------------------------------------------------- one client
@dataclass(frozen=True)
class ShareMessage:
    """``owner``'s shares for ``holder``: of its private key and of its self-mask seed."""

    owner: int
    holder: int
    private_key: shamir.Share
    self_mask: shamir.Share


@dataclass(frozen=True)
class Reveal:
    """A surviving ``holder``'s share of ``owner``'s ``private_key`` (owner dropped) or ``self_mask``
    (owner survived)."""

    owner: int
    holder: int
    kind: str
    share: shamir.Share


def _x(holder: int) -> int:
    """A client's Shamir abscissa (0 is the secret's point)."""
    return holder + 1


class ClientSecrets:
    """One client's secrets of one round, on the rank that trains it (see the module docstring's modes)."""

    def __init__(self, client: int, round_idx: int, key_source: KeySource) -> None:
        self.client, self.round_idx = client, round_idx
        if key_source.secure:
            private = X25519PrivateKey.generate()
            self.self_mask_seed = os.urandom(SEED_BYTES)
            self._coins = os.urandom
        else:
            key = key_source.key(round_idx, client, SECAGG, tag="secagg/client")
            private = X25519PrivateKey.from_private_bytes(_expand_key(key, b"x25519"))
            self.self_mask_seed = _expand_key(key, b"self-mask")
            self._coins = AesCoins(_expand_key(key, b"shamir"))
        self._private = private
        self.private_key = private.private_bytes_raw()
        self.public_key = private.public_key().public_bytes_raw()
        self._seeds: dict[int, bytes] = {}

    def shares(self, holders: Sequence[int], threshold: int) -> list[ShareMessage]:
        """The shares of this client's private key and self-mask seed for ``holders``."""
        xs = [_x(h) for h in holders]
        sk = shamir.split(self.private_key, xs, threshold, self._coins)
        b = shamir.split(self.self_mask_seed, xs, threshold, self._coins)
        return [ShareMessage(self.client, h, sk[_x(h)], b[_x(h)]) for h in holders]

    def agree(self, publics: dict[int, bytes]) -> dict[int, bytes]:
        """The pair seeds with the clients of ``publics`` (``{client: public key}``), kept for :meth:`mask`."""
        for v, pk in publics.items():
            if v not in self._seeds:
                self._seeds[v] = agree(self._private, pk, self.round_idx, self.client, v)
        return {v: self._seeds[v] for v in publics}

    def mask(self, row: torch.Tensor, neighbours: Sequence[int], bits: int) -> torch.Tensor:
        """``row + PRG(b_u) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv)`` modulo ``2^bits``."""
        words = _as_words(row)
        words += prg_words(self.self_mask_seed, words.size)
        for v in neighbours:
            if v > self.client:
                words += prg_words(self._seeds[v], words.size)
            else:
                words -= prg_words(self._seeds[v], words.size)
        return _to_tensor(words, bits)


# ---------------------------------------------------------------------------------- one round
class SecAggRound:
    """One round of secure aggregation over ``cohort`` (see the module docstring for the flow).

    Args:
        cohort: the round's clients (distinct non-negative ints).
        bits: the modulus ``2^bits`` (1..62).
        d: the length of a row.
        round_idx: the round (binds every key and mask to it).
        key_source: the run's :class:`dpfl_lightning.rng.RandomSource` (simulation or secure mode).
        neighbours: ``k`` for SecAgg+ (even); ``None`` or ``>= n-1``: the complete graph.
        threshold: ``t``, the shares that reconstruct a secret (default :func:`default_threshold`).
        local_clients: the clients this rank trains (default: all, and the exchanges are done here).
    """

    def __init__(self, cohort: Sequence[int], bits: int, d: int, round_idx: int, key_source: KeySource,
                 neighbours: int | None = None, threshold: int | None = None,
                 local_clients: Iterable[int] | None = None) -> None:
        self.cohort = tuple(int(c) for c in cohort)
        if len(set(self.cohort)) != len(self.cohort) or len(self.cohort) < 2 or min(self.cohort) < 0:
            raise ConfigError("secagg.cohort", list(cohort), "secure aggregation needs at least 2 distinct "
                              "non-negative client ids", "pass the round's cohort of client indices")
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ConfigError("secagg.d", d, "a row needs at least one coordinate", "pass the row length")
        self.bits, self.d, self.round_idx = check_bits(bits), d, round_idx
        self.graph = NeighbourGraph(self.cohort, neighbours, round_idx, key_source)
        n_holders = self.graph.degree + 1
        self.threshold = default_threshold(n_holders) if threshold is None else threshold
        if isinstance(self.threshold, bool) or not 2 <= self.threshold <= n_holders:
            raise ConfigError("secagg.threshold", threshold, f"each secret has {n_holders} holders (the client "
                              f"and its {self.graph.degree} neighbours); t must be in 2..{n_holders}",
                              f"use e.g. {default_threshold(n_holders)} (a strict majority)")
        local = self.cohort if local_clients is None else tuple(local_clients)
        if not set(local) <= set(self.cohort):
            raise ConfigError("secagg.local_clients", list(local), "not all in the cohort",
                              "pass the cohort's clients this rank trains")
        self._secrets = {c: ClientSecrets(c, round_idx, key_source) for c in local}
        self._publics = {c: s.public_key for c, s in self._secrets.items()}
        self._held: dict[tuple[int, int], ShareMessage] = {}
        #: this rank's clients that answered the round's unmasking request: the survivors they were shown
        self._answered: dict[int, frozenset[int]] = {}
        if local_clients is None:
            self.receive_shares(self.shares_to_send())

    @property
    def local_clients(self) -> tuple[int, ...]:
        """The clients whose secrets this object holds (this rank's clients of the cohort)."""
        return tuple(self._secrets)

    def client_secrets(self, client: int) -> ClientSecrets:
        """``client``'s secrets; a :class:`KeyError` when another rank trains it."""
        if client not in self._secrets:
            raise KeyError(f"secagg: client {client}'s secrets are not on this rank (local_clients)")
        return self._secrets[client]

    # -- what the ranks exchange
    def exchange(self, allgather: Callable[[Any], list[Any]], alltoall: Callable[[list[Any]], list[Any]]) -> None:
        """The set-up between ranks (collective: every rank calls it once per round): all-gather the
        public keys, then send each share message to its holder's rank only and keep what arrives.

        ``allgather(obj)`` returns every rank's ``obj`` by rank; ``alltoall(objs)`` sends ``objs[r]``
        to rank ``r`` and returns what each rank sent this one, by rank. Every client of the cohort
        must be local on exactly one rank."""
        by_rank = allgather(self.public_keys())
        rank_of: dict[int, int] = {}
        for rank, keys in enumerate(by_rank):
            self.add_public_keys(keys)
            twice = set(keys) & set(rank_of)
            if twice:
                raise RuntimeError(f"secagg: clients {sorted(twice)[:5]} are local on two ranks; give each rank "
                                   "the cohort's clients it trains (local_clients)")
            rank_of.update(dict.fromkeys(keys, rank))
        missing = set(self.cohort) - set(rank_of)
        if missing:
            raise RuntimeError(f"secagg: no rank holds the keys of clients {sorted(missing)[:5]}; give each rank "
                               "the cohort's clients it trains (local_clients)")
        outgoing: list[list[ShareMessage]] = [[] for _ in by_rank]
        for m in self.shares_to_send():
            outgoing[rank_of[m.holder]].append(m)
        for messages in alltoall(outgoing):
            self.receive_shares(messages)

    def gather_reveals(self, survivors: Iterable[int], dropped: Iterable[int],
                       allgather: Callable[[Any], list[Any]]) -> list[Reveal]:
        """Every rank's :meth:`reveal`, for :meth:`unmask` (collective: every rank calls it).

        First a consistency round (Bonawitz et al. 2017, Round 3): the ranks all-gather the survivor set
        each was shown, and every rank refuses to reveal unless all were shown the same one, so holders on
        different ranks cannot be told different survivor sets to collect both secrets of one client."""
        alive, _ = self._partition(survivors, dropped)
        shown = allgather(sorted(alive))
        if any(s != shown[0] for s in shown):
            raise UnmaskingRefusedError(f"secagg: round {self.round_idx}: refused to unmask: the ranks were shown "
                                        f"{len({tuple(s) for s in shown})} different survivor sets (a consistency "
                                        "check, Bonawitz et al. 2017, Round 3: every holder must be asked about the "
                                        "same survivors)")
        return [r for part in allgather(self.reveal(survivors, dropped)) for r in part]

    def public_keys(self) -> dict[int, bytes]:
        """This rank's clients' public keys (to all-gather, then :meth:`add_public_keys` everywhere)."""
        return {c: s.public_key for c, s in self._secrets.items()}

    def add_public_keys(self, keys: dict[int, bytes]) -> None:
        """Learn other clients' public keys."""
        for c, pk in keys.items():
            if c not in self.graph.members or len(pk) != 32:
                raise ValueError(f"secagg: public key of client {c}: not in the cohort or not 32 bytes")
            self._publics[c] = pk

    def shares_to_send(self) -> list[ShareMessage]:
        """The shares this rank's clients send their holders (deliver each to its holder's rank)."""
        return [m for c, s in self._secrets.items() for m in s.shares(self.graph.holders(c), self.threshold)]

    def receive_shares(self, messages: Iterable[ShareMessage]) -> None:
        """Keep the shares whose holder this rank trains."""
        for m in messages:
            if m.holder in self._secrets:
                self._held[(m.owner, m.holder)] = m

    # -- clients
    def agree(self, client: int) -> None:
        """``client``'s key agreements with its neighbours (done by :meth:`mask` when not done before)."""
        neighbours = self.graph.neighbours(client)
        missing = [v for v in neighbours if v not in self._publics]
        if missing:
            raise RuntimeError(f"secagg: client {client} lacks the public keys of {missing[:5]}; "
                               "all-gather public_keys() and call add_public_keys() first")
        self.client_secrets(client).agree({v: self._publics[v] for v in neighbours})

    def mask(self, client: int, row: torch.Tensor) -> torch.Tensor:
        """``client``'s masked row (int64 in ``[0, 2^bits)``) for the int64 ``row`` of length ``d``."""
        if tuple(row.shape) != (self.d,):
            raise ValueError(f"secagg: client {client}'s row has shape {tuple(row.shape)}, expected ({self.d},)")
        self.agree(client)
        return self.client_secrets(client).mask(row, self.graph.neighbours(client), self.bits)

    # -- unmasking
    def reveal(self, survivors: Iterable[int], dropped: Iterable[int]) -> list[Reveal]:
        """The shares this rank's surviving clients send the server: ``b`` of survivors, ``sk`` of the dropped.

        Each client answers once per round (Bonawitz et al. 2017, Round 4): a request after this rank's
        clients answered one is refused with :class:`UnmaskingRefusedError` (module docstring)."""
        alive, gone = self._partition(survivors, dropped)
        self._check_request(alive, gone)
        self._answered.update(dict.fromkeys(alive & set(self._secrets), frozenset(alive)))
        out = []
        for (owner, holder), m in sorted(self._held.items()):
            if holder in alive and owner in alive:
                out.append(Reveal(owner, holder, "self_mask", m.self_mask))
            elif holder in alive:
                out.append(Reveal(owner, holder, "private_key", m.private_key))
        return out

    def unmask(self, masked_sum: torch.Tensor, survivors: Iterable[int], dropped: Iterable[int],
               reveals: Iterable[Reveal] | None = None) -> torch.Tensor:
        """The survivors' sum of rows modulo ``2^bits`` from ``masked_sum`` (:func:`mod_sum` of their
        masked rows). ``reveals``: every rank's :meth:`reveal` (default: this rank's, for one process: the
        round's one unmasking request, so a round is unmasked once).
        Raises :class:`TooFewSurvivorsError` when a needed secret has fewer than ``t`` surviving holders."""
        alive, gone = self._partition(survivors, dropped)
        if masked_sum.numel() != self.d:
            raise ValueError(f"secagg: the masked sum has {masked_sum.numel()} values, expected d={self.d}")
        if len(alive) < self.threshold:
            raise TooFewSurvivorsError(
                f"secagg: {len(alive)} of {len(self.cohort)} clients survived, fewer than secagg.threshold="
                f"{self.threshold}; the round cannot be unmasked: skip it, or lower the threshold or the dropout rate")
        secrets = self._reconstruct(list(self.reveal(alive, gone) if reveals is None else reveals), alive, gone)
        words = _as_words(masked_sum.reshape(-1))
        for u in sorted(alive):
            words -= prg_words(secrets[u], self.d)
        for v in sorted(gone):
            private = X25519PrivateKey.from_private_bytes(secrets[v]) if v in secrets else None
            for u in self.graph.neighbours(v):
                if u in alive:  # u added +PRG(s_uv) if v > u, else -PRG(s_uv)
                    mask = prg_words(agree(private, self._publics[u], self.round_idx, v, u), self.d)
                    if v > u:
                        words -= mask
                    else:
                        words += mask
        return _to_tensor(words, self.bits)

    def _check_request(self, alive: set[int], gone: set[int]) -> None:
        """Refuse a request that would make a client answer twice, or contradict an earlier answer."""
        if not self._answered:
            return
        shown = frozenset().union(*self._answered.values())  # survivors in an earlier answer
        answered = sorted(self._answered)
        rule = ("each client answers one unmasking request per round and reveals, for each peer, its share of the "
                "private key (peer dropped) or of the self-mask seed (peer survived), never both (Bonawitz et al. "
                "2017, 'Practical Secure Aggregation for Privacy-Preserving Machine Learning', CCS, Round 4 after "
                "the consistency check); build a new SecAggRound for a new round")
        now_alive = sorted(alive - shown)  # treated as dropped by an earlier answer
        now_gone = sorted(gone & shown)
        flips = ([f"as surviving clients {now_alive[:5]} that clients {answered[:5]} already treated as dropped "
                  "(revealing shares of their private keys)"] if now_alive else []) + \
                ([f"as dropped clients {now_gone[:5]} that clients {answered[:5]} already treated as surviving "
                  "(revealing shares of their self-mask seeds)"] if now_gone else [])
        if flips:
            raise UnmaskingRefusedError(f"secagg: round {self.round_idx}: refused an unmasking request that lists "
                                        f"{', and '.join(flips)}; {rule}")
        again = sorted(alive & set(self._answered))
        if again:
            raise UnmaskingRefusedError(f"secagg: round {self.round_idx}: refused a second unmasking request: clients "
                                        f"{again[:5]} already answered this round's; {rule}")

    def _partition(self, survivors: Iterable[int], dropped: Iterable[int]) -> tuple[set[int], set[int]]:
        alive, gone = set(survivors), set(dropped)
        if alive & gone or alive | gone != set(self.cohort):
            raise ValueError("secagg: survivors and dropped must split the cohort (disjoint, together the cohort); "
                             f"overlap {sorted(alive & gone)[:5]}, "
                             f"missing {sorted(set(self.cohort) - alive - gone)[:5]}, "
                             f"unknown {sorted((alive | gone) - set(self.cohort))[:5]}")
        return alive, gone

    def _reconstruct(self, reveals: list[Reveal], alive: set[int], gone: set[int]) -> dict[int, bytes]:
        """Every survivor's ``b`` and every dropped client's ``sk`` from the surviving holders' shares."""
        by_owner: dict[int, list[shamir.Share]] = {}
        holders = {c: set(self.graph.holders(c)) for c in self.cohort}
        for r in reveals:
            expected = "self_mask" if r.owner in alive else "private_key"
            if r.kind != expected or r.holder not in alive or r.holder not in holders.get(r.owner, ()):
                raise ValueError(f"secagg: refused reveal of client {r.owner}'s {r.kind} by {r.holder}: only "
                                 f"surviving holders reveal, and only a survivor's self_mask or a dropped client's "
                                 f"private_key (never both of one client)")
            by_owner.setdefault(r.owner, []).append(r.share)
        secrets = {}
        for owner in sorted(alive | gone):
            shares = by_owner.get(owner, [])
            if owner in gone and not any(u in alive for u in self.graph.neighbours(owner)):
                continue  # no surviving neighbour: none of its masks is in the sum
            if len(shares) < self.threshold:
                raise TooFewSurvivorsError(
                    f"secagg: client {owner}'s secret has {len(shares)} surviving holder(s), fewer than "
                    f"secagg.threshold={self.threshold}; skip the round, or raise secagg.neighbours or lower the "
                    "threshold or the dropout rate")
            secrets[owner] = shamir.reconstruct(shares, self.threshold)
        return secrets


# ---------------------------------------------------------------------------------- dropouts
def simulate_dropouts(cohort: Sequence[int], rate: float, round_idx: int,
                      key_source: KeySource) -> tuple[list[int], list[int]]:
    """``(survivors, dropped)``: each client of ``cohort`` drops with probability ``rate``, keyed by
    ``(seed, round, client)`` -- the same whichever rank trains it."""
    if not 0.0 <= rate < 1.0:
        raise ConfigError("secagg.dropout", rate, "a dropout rate is a probability below 1", "use 0 <= rate < 1")
    survivors, dropped = [], []
    for c in cohort:
        u = int.from_bytes(key_source.key(round_idx, c, SECAGG, tag="secagg/dropout")[:8], "little") / 2.0**64
        (dropped if u < rate else survivors).append(c)
    return survivors, dropped
