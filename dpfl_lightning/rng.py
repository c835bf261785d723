"""Randomness keyed by (seed, round, client, purpose), never by rank.

Every random draw of a run -- which clients a round samples, how a client shuffles or samples its
records, the dropout masks of its steps, the noise it adds, the server's noise -- comes from a
stream keyed by ``(seed, round, client, purpose)``. Ranks therefore draw the same numbers for the
same client whoever trains it, and a run resumed at round ``r`` draws what the uninterrupted run drew.

Keys are 128 bits (BLAKE2b of the four parts) and the generators really use all of them:

- **simulation** (the default): a CPU stream is torch's Mersenne Twister with its whole 19,968-bit
  state expanded from the key (SHAKE-256), so ``torch.randn`` & co. run at full speed on it. torch's
  own ``manual_seed`` would keep only 32 bits of a seed, making two streams in ~2^16 collide. A
  CUDA stream is torch's Philox with a 64-bit key and a 64-bit counter offset, both from the key.
  Everything is reproducible from the seed -- so anyone who knows the seed (it is in the config and
  the logs) knows every cohort and can subtract every noise draw: the privacy guarantee of a
  simulation holds only towards someone who does not know the seed.
- **secure** (``FederatedTrainer(secure=True)``): a 256-bit secret from :mod:`secrets`, drawn on
  rank 0 and sent to the other ranks, never logged or checkpointed, keys BLAKE2b (keyed mode) and
  the streams that matter for privacy (noise, cohorts, DP-SGD batches, coins) are SHAKE-256 in
  counter mode: a CSPRNG. Gaussian noise is then drawn in float64 from 53-bit uniforms (Box-Muller)
  as the sum of four Gaussians of half the standard deviation, the mitigation of floating-point
  attacks on Gaussian samplers that Opacus's secure mode uses (Holohan & Braghin 2021,
  arXiv:2107.10138; the attacks: Mironov 2012, Jin et al. 2022, arXiv:2112.05307). It is a
  mitigation, not a proof. The exact remedy is integer noise: ``DiscreteDistributedNoise`` draws the
  discrete Gaussian or Skellam with exact samplers on these streams' uniform words
  (:mod:`dpfl_lightning.privacy.discrete_noise`), where no floating-point attack applies.
  Secure streams cost ~20x torch's ``randn`` per normal on a CPU core (``benchmarks/rng_cost.py``).
"""

from __future__ import annotations

import hashlib
import math
import secrets
import struct
from dataclasses import dataclass

import numpy as np
import torch

# Purposes: distinct streams for distinct uses of the same (seed, round, client).
SAMPLING = 1  # the round's cohort (client = SERVER)
CLIENT_TRAIN = 2  # torch's global generators during a client's local training (dropout ...)
CLIENT_NOISE = 3  # local noise / distributed noise shares
CENTRAL_NOISE = 4  # noise on the aggregate (client = SERVER)
SERVER = 5  # other server-side draws
DATA = 6  # a client's shuffling of its records (not a privacy mechanism)
RECORD_SAMPLING = 7  # DP-SGD's batches (part of the accounted mechanism)
RECORD_NOISE = 8  # DP-SGD's noise
COIN = 9  # shared coins that change the round plan (ScaffNew)
PLUGIN = 100  # plugin purposes are numbered from here: see PLUGIN_PURPOSES and register_purpose()

SERVER_CLIENT = -1  # the "client" of draws that belong to the server

# Purposes whose draws a DP guarantee relies on: secure mode draws them from the CSPRNG. So does
# every plugin purpose (>= PLUGIN) not registered with private=False: a plugin's stream is presumed
# to be part of a mechanism.
PRIVATE_PURPOSES = frozenset({SAMPLING, CLIENT_NOISE, CENTRAL_NOISE, RECORD_SAMPLING, RECORD_NOISE, COIN})


@dataclass(frozen=True)
class Purpose:
    """A plugin's named stream: ``number`` is part of the keys of its draws; ``private``: secure mode
    draws it from the CSPRNG (a stream a DP guarantee relies on)."""

    name: str
    number: int
    private: bool


#: every plugin stream purpose by name, built-in or registered by a plugin with :func:`register_purpose`.
PLUGIN_PURPOSES: dict[str, Purpose] = {}
_BY_NUMBER: dict[int, Purpose] = {}
_SECURE_SHIFT = 10_000  # a secure stream also keys torch's generator with purpose + 10_000
_DERIVED_BASE = PLUGIN + 1000  # numbers of purposes registered without one are derived from the name


def _derived_number(name: str) -> int:
    """A number from the name alone, so it does not depend on which plugins were imported first."""
    return _DERIVED_BASE + int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


def _holder(number: int) -> str | None:
    """The name of a purpose whose keys ``number`` would repeat (itself, or shifted by a secure stream)."""
    for shift in (-_SECURE_SHIFT, 0, _SECURE_SHIFT):
        if number + shift in _BY_NUMBER:
            return _BY_NUMBER[number + shift].name
        if number + shift in _CORE_PURPOSES:
            return f"rng.{_CORE_PURPOSES[number + shift]}"
    return None


def register_purpose(name: str, private: bool = True, number: int | None = None) -> int:
    """The stream purpose of ``name`` (``"<Plugin>.<use>"``), registered on first use.

    Registering the same name again returns the same number. Without ``number``, the number is
    derived from the name; a name whose number (or a secure stream's shifted number) another purpose
    holds is refused. ``private=False`` only for a stream no DP guarantee relies on."""
    known = PLUGIN_PURPOSES.get(name)
    if known is not None:
        if private != known.private or number not in (None, known.number):
            raise ValueError(f"rng.register_purpose: {name!r} is registered as number {known.number}, "
                             f"private={known.private}; register it with the same settings or rename it")
        return known.number
    number = _derived_number(name) if number is None else number
    if number < PLUGIN:
        raise ValueError(f"rng.register_purpose: {name!r} asks for number {number}, below rng.PLUGIN={PLUGIN} "
                         "(the core's purposes); leave the number out or use rng.PLUGIN + k")
    holder = _holder(number)
    if holder is not None:
        raise ValueError(f"rng.register_purpose: {name!r} and {holder!r} would share the stream purpose "
                         f"{number}; rename one of them")
    PLUGIN_PURPOSES[name] = _BY_NUMBER[number] = Purpose(name, number, private)
    return number


_CORE_PURPOSES = {number: name for name, number in (
    ("SAMPLING", SAMPLING), ("CLIENT_TRAIN", CLIENT_TRAIN), ("CLIENT_NOISE", CLIENT_NOISE),
    ("CENTRAL_NOISE", CENTRAL_NOISE), ("SERVER", SERVER), ("DATA", DATA), ("RECORD_SAMPLING", RECORD_SAMPLING),
    ("RECORD_NOISE", RECORD_NOISE), ("COIN", COIN))}
# The built-in plugins' purposes, with the numbers their draws have always been keyed by.
register_purpose("FedEXP.xi_noise", number=PLUGIN + 20)  # CDP-FedEXP's noise on the sum of squared norms
register_purpose("PrivUnitRandomizer.privunit", number=PLUGIN + 30)  # PrivUnit's and ScalarDP's randomness
register_purpose("AdaptiveClip.count_noise", number=PLUGIN + 40)  # the noise on the count of unclipped clients
register_purpose("SCAFFOLD.warm_cohorts", number=PLUGIN + 50)  # the warm start's permutation of the population
register_purpose("CanaryClients.canary", number=PLUGIN + 70)  # the audit's canary slots, coins and directions


def is_private(purpose: int) -> bool:
    """Whether secure mode draws ``purpose``'s stream from the CSPRNG: a core purpose a DP guarantee
    relies on, or a plugin purpose (>= PLUGIN) unless it was registered with ``private=False``."""
    if purpose < PLUGIN:
        return purpose in PRIVATE_PURPOSES
    registered = _BY_NUMBER.get(purpose)
    return registered is None or registered.private


NOISE_BLOCK = 1 << 22  # normals drawn per block when noise is added in place
_MT_WORDS = 624
_STATE_BYTES = 5056  # sizeof(CPUGeneratorImplState) since torch 1.x


_FIXED = struct.Struct("<4q")


def _encode(*parts: int) -> bytes:
    try:
        return _FIXED.pack(*parts)  # the common case: every part fits in 64 bits
    except struct.error:
        out = bytearray(b"\xff" * 33)  # longer than any fixed-width encoding: the two never coincide
        for p in parts:
            raw = int(p).to_bytes((int(p).bit_length() + 8) // 8 or 1, "little", signed=True)
            out += struct.pack("<B", len(raw)) + raw
        return bytes(out)


def derive_key(seed: int, round_idx: int, client: int, purpose: int, secret: bytes | None = None,
               tag: str = "") -> bytes:
    """The 128-bit key of one stream: BLAKE2b of the parts, keyed by ``secret`` in secure mode.

    ``tag`` separates streams of one purpose that must be independent (two noise mechanisms on
    different segments); tagged keys use their own BLAKE2b personalisation, so they never equal an
    untagged key, and the empty tag gives the untagged key."""
    data = _encode(seed, round_idx, client, purpose)
    person = b"dpfl-sim" if secret is None else b"dpfl-sec"
    if tag:
        data += tag.encode("utf-8")
        person += b"-tag"
    if secret is None:
        return hashlib.blake2b(data, digest_size=16, person=person).digest()
    return hashlib.blake2b(data, digest_size=16, key=secret, person=person).digest()


_MT_TEMPLATE = np.zeros(_STATE_BYTES, dtype=np.uint8)
_MT_TEMPLATE[8:16].view("<i4")[:] = (1, 1)  # left = 1 (twist before the first draw), seeded = 1


def _mt_state(key: bytes) -> torch.Tensor:
    """torch's CPU generator state (``CPUGeneratorImplState``: initial seed u64, left and seeded
    i32, next u64, 624 state words stored as u64, then the normal caches, all zero here) with the
    Mersenne Twister's 624 words expanded from ``key``."""
    buf = _MT_TEMPLATE.copy()
    buf[24 : 24 + 8 * _MT_WORDS].view("<u4")[0::2] = np.frombuffer(
        hashlib.shake_256(b"dpfl-mt" + key).digest(4 * _MT_WORDS), dtype="<u4")
    buf[:8] = np.frombuffer(key[:8], dtype=np.uint8)
    return torch.from_numpy(buf)


def _check_state_layout() -> None:
    g = torch.Generator()
    if g.get_state().numel() != _STATE_BYTES:  # pragma: no cover - a torch that changed its layout
        raise RuntimeError("torch's CPU generator state has an unexpected layout; dpfl_lightning.rng needs updating")


_check_state_layout()


def torch_generator(key: bytes, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` that uses every bit of the 128-bit ``key``."""
    device = torch.device(device)
    g = torch.Generator(device=device)
    if device.type == "cpu":
        g.set_state(_mt_state(key))
    else:
        # Philox: a 64-bit key (the seed) and a counter whose offset (a multiple of 4) takes the
        # other 64 bits of the key, so streams of distinct keys are disjoint.
        seed = int.from_bytes(key[:8], "little")
        offset = (int.from_bytes(key[8:], "little") >> 3) << 2
        g.manual_seed(seed)
        g.set_offset(offset) if hasattr(g, "set_offset") else None
    return g


class Stream:
    """One stream of random numbers. ``generator`` is a torch generator for code that takes one
    (shuffles, ``torch.randperm``); privacy mechanisms use the methods, which secure streams
    implement with the CSPRNG."""

    generator: torch.Generator | None = None

    def uniform(self, n: int) -> torch.Tensor:
        """``n`` float64 values, uniform on [0, 1), on the CPU."""
        raise NotImplementedError

    def normal(self, shape: tuple[int, ...] | torch.Size, std: float, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``N(0, std^2)`` draws of ``shape``."""
        raise NotImplementedError

    def add_normal_(self, x: torch.Tensor, std: float) -> torch.Tensor:
        """``x += N(0, std^2 I)`` in place (in blocks of :data:`NOISE_BLOCK` values)."""
        flat = x.view(-1)
        for lo in range(0, flat.numel(), NOISE_BLOCK):
            part = flat[lo : lo + NOISE_BLOCK]
            part.add_(self.normal(part.shape, 1.0, x.device, x.dtype), alpha=std)
        return x

    def randperm(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of ``range(n)`` (int64, CPU)."""
        return torch.argsort(self.uniform(n))


def _indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index (``cuda`` is the current CUDA device), so one device has one name."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class TorchStream(Stream):
    """Simulation streams: torch's generators keyed with the full 128-bit key."""

    def __init__(self, key: bytes, device: torch.device | str = "cpu") -> None:
        self.key = key
        self.device = _indexed(device)
        self.generator = torch_generator(key, self.device)
        self._on: dict[torch.device, torch.Generator] = {self.device: self.generator}

    def generator_on(self, device: torch.device | str) -> torch.Generator:
        """This stream's generator on ``device``, keyed on first use and then continued: successive
        draws on one device never repeat each other (a CUDA tensor noised from a CPU stream, say)."""
        device = _indexed(device)
        if device not in self._on:
            self._on[device] = torch_generator(self.key, device)
        return self._on[device]

    @property
    def cpu_generator(self) -> torch.Generator:
        return self.generator_on("cpu")

    def uniform(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.cpu_generator, dtype=torch.float64)

    def normal(self, shape, std, device="cpu", dtype=torch.float32):
        device = torch.device(device)
        out = torch.randn(shape, generator=self.generator_on(device), device=device, dtype=dtype)
        return out.mul_(std) if std != 1.0 else out

    def add_normal_(self, x: torch.Tensor, std: float) -> torch.Tensor:
        g = self.generator_on(x.device)
        flat = x.view(-1)
        dtype = torch.float32 if x.dtype == torch.float64 else x.dtype  # float32 draws: half the work
        for lo in range(0, flat.numel(), NOISE_BLOCK):  # blocks: no temporary the size of a large model
            part = flat[lo : lo + NOISE_BLOCK]
            part.add_(torch.randn(part.shape, generator=g, device=x.device, dtype=dtype), alpha=std)
        return x

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.cpu_generator)


_FIRST_BLOCK, _MAX_BLOCK = 1 << 9, 1 << 20  # bytes of SHAKE-256 output per block (doubling)


class HashStream(Stream):
    """SHAKE-256 of (key, block counter), read block after block; blocks double from 512 B to 1 MiB,
    so a short stream costs little (a client's shuffle: ~2 us, against ~25 us to key a Mersenne
    Twister) and a long one runs at SHAKE's speed. ``randperm`` argsorts its uniforms. A torch
    ``generator`` (for code that takes one, e.g. a DataLoader) is keyed on first use."""

    def __init__(self, key: bytes, torch_key: bytes | None = None) -> None:
        self._key = key
        self._torch_key = torch_key or key
        self._generator: torch.Generator | None = None
        self._block = 0
        self._buf = b""
        self._pos = 0

    @property
    def generator(self) -> torch.Generator:  # type: ignore[override]
        if self._generator is None:
            self._generator = torch_generator(self._torch_key, "cpu")
        return self._generator

    @staticmethod
    def _block_size(block: int) -> int:
        return min(_FIRST_BLOCK << block, _MAX_BLOCK)

    @staticmethod
    def _block_bytes(key: bytes, block: int) -> bytes:
        return hashlib.shake_256(key + block.to_bytes(8, "little")).digest(HashStream._block_size(block))

    def _refill(self) -> None:
        self._buf = self._block_bytes(self._key, self._block)
        self._block += 1
        self._pos = 0

    def words(self, n: int) -> np.ndarray:
        """The next ``n`` 53-bit integers of the stream (64-bit words, top 53 bits)."""
        out = np.empty(n, dtype=np.uint64)
        filled = 0
        while filled < n:
            if self._pos >= len(self._buf):
                self._refill()
            take = min(n - filled, (len(self._buf) - self._pos) // 8)
            words = np.frombuffer(self._buf, dtype="<u8", count=take, offset=self._pos)
            np.right_shift(words, np.uint64(11), out=out[filled : filled + take])
            self._pos += 8 * take
            filled += take
        return out

    @staticmethod
    def first_words(keys: list[bytes], n: int) -> np.ndarray:
        """``[HashStream(k).words(n) for k in keys]`` as one ``[len(keys), n]`` array, computed
        together (the blocks of every key joined, then one conversion): ~4x faster for 50 short
        streams than one stream object each."""
        blocks, total = 0, 0
        while total < 8 * n:  # the blocks a stream reads for its first n words
            total += HashStream._block_size(blocks)
            blocks += 1
        parts = []
        for key in keys:
            left = 8 * n
            for b in range(blocks):
                chunk = HashStream._block_bytes(key, b)
                parts.append(chunk[:left])
                left -= len(chunk)
        words = np.frombuffer(b"".join(parts), dtype="<u8").reshape(len(keys), n)
        return np.right_shift(words, np.uint64(11)).astype(np.uint64, copy=False)

    def uniform(self, n: int) -> torch.Tensor:
        return torch.from_numpy(self.words(n) * 2.0**-53)  # 53-bit uniforms in [0, 1), exact in float64

    def randperm(self, n: int) -> torch.Tensor:
        # the stable argsort of the uniforms, taken on their 53-bit integers (the same order)
        return torch.from_numpy(np.argsort(self.words(n), kind="stable").astype(np.int64, copy=False))


class SecureStream(HashStream):
    """A CSPRNG stream (:class:`HashStream` keyed by the secret). Its torch ``generator``, for
    shuffles that no guarantee relies on, is keyed from the secret as well: unpredictable without
    it, though not a CSPRNG."""

    def _standard_normals(self, n: int) -> torch.Tensor:
        """``n`` N(0, 1) values in float64 (Box-Muller on 53-bit uniforms)."""
        half = (n + 1) // 2
        u = self.uniform(2 * half)
        r = torch.sqrt(-2.0 * torch.log1p(-u[:half]))  # 1 - u in (0, 1]: log is finite
        theta = (2.0 * math.pi) * u[half:]
        return torch.cat([r * torch.cos(theta), r * torch.sin(theta)])[:n]

    def normal(self, shape, std, device="cpu", dtype=torch.float32):
        n = math.prod(shape)
        # Sum of four N(0, std^2 / 4) draws (Holohan & Braghin 2021), in float64.
        z = self._standard_normals(4 * n).view(4, n).sum(0).mul_(0.5 * std)
        return z.view(tuple(shape)).to(device=device, dtype=dtype)


class RandomSource:
    """Every stream of a run: ``stream(round, client, purpose)``.

    Args:
        seed: the run's seed (logged; keys every stream in simulation mode).
        secret: secure mode: a secret of at least 16 bytes shared by the ranks (never logged or
            checkpointed); see :func:`new_secret`.
    """

    def __init__(self, seed: int, secret: bytes | None = None) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("the secret of secure mode must have at least 128 bits")
        self.seed = int(seed)
        self._secret = secret
        self._prepared: dict[int, tuple[bytes, torch.Tensor]] = {}  # see prepare_torch
        self._prepared_round = -1

    @property
    def secure(self) -> bool:
        return self._secret is not None

    def key(self, round_idx: int, client: int, purpose: int, tag: str = "") -> bytes:
        return derive_key(self.seed, round_idx, client, purpose, self._secret, tag)

    def stream(self, round_idx: int, client: int, purpose: int, device: torch.device | str = "cpu",
               tag: str = "") -> Stream:
        """The stream of ``(round, client, purpose)`` (and ``tag``, see :func:`derive_key`)."""
        key = self.key(round_idx, client, purpose, tag)
        if self.secure and is_private(purpose):
            return SecureStream(key, derive_key(self.seed, round_idx, client, purpose + _SECURE_SHIFT, self._secret, tag))
        if purpose == DATA:  # a client's shuffles: small, many, on the CPU
            return HashStream(key)
        return TorchStream(key, device)

    def data_words(self, round_idx: int, clients: list[int], n: int) -> np.ndarray:
        """``[stream(round_idx, c, DATA).words(n) for c in clients]`` as one ``[len(clients), n]``
        array, computed together (the words of the clients' shuffles, see :meth:`HashStream.randperm`)."""
        return HashStream.first_words([self.key(round_idx, c, DATA) for c in clients], n)

    def generator(self, round_idx: int, client: int, purpose: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A torch generator for draws no guarantee relies on (shuffles, dropout)."""
        return torch_generator(self.key(round_idx, client, purpose), device)

    def prepare_torch(self, round_idx: int, clients: list[int]) -> None:
        """Compute the CPU generator states :meth:`seed_torch` sets for ``clients`` in one pass:
        between clients each costs ~35 us (its code and tables are out of cache), together ~12 us."""
        keys = {c: self.key(round_idx, c, CLIENT_TRAIN) for c in clients}
        self._prepared = {c: (key, _mt_state(key)) for c, key in keys.items()}
        self._prepared_round = round_idx

    def seed_torch(self, round_idx: int, client: int, device: torch.device) -> None:
        """Set torch's global generators (CPU, and ``device``'s) for one client's local training
        (dropout masks and the like)."""
        ready = self._prepared.pop(client, None) if self._prepared_round == round_idx else None
        if ready is None:
            key = self.key(round_idx, client, CLIENT_TRAIN)
            ready = key, _mt_state(key)
        key, state = ready
        torch.default_generator.set_state(state)
        if device.type == "cuda":
            g = torch.cuda.default_generators[device.index or 0]
            g.manual_seed(int.from_bytes(key[:8], "little"))
            g.set_offset((int.from_bytes(key[8:], "little") >> 3) << 2) if hasattr(g, "set_offset") else None


def new_secret() -> bytes:
    """A fresh 256-bit secret for secure mode."""
    return secrets.token_bytes(32)
