"""What a plugin declares about a mechanism it runs: a :class:`Mechanism`.

A mechanism is a ``dp_accounting`` event (Gaussian, Laplace, or randomized response for a pure
epsilon-DP local randomizer such as PrivUnit) together with:

- its **sensitivity** (the bound on one unit's contribution the noise is scaled to);
- its **granularity**: ``client`` (a client's whole contribution is the unit) or ``record`` (one
  record inside a client: DP-SGD);
- its **placement**: ``local`` (each client randomizes before anything leaves it), ``distributed``
  (each client adds a share; the sum carries the full noise; needs secure aggregation) or
  ``central`` (noise on the aggregate: a trusted aggregator);
- the **payload segments** it protects (``covers``): every segment that leaves a client in a DP
  run must be covered by some mechanism (see :mod:`dpfl_lightning.federated.payload`).

Events are given for both neighbouring relations: ``add_remove`` (one unit more or less; the
distance between two neighbours' sums of ``C``-bounded contributions is ``C``) and
``replace_one`` (one unit's data replaced: ``2C`` for a vector of norm at most ``C``, but ``B`` for a
value in ``[0, B]``, such as FedEXP's squared norms). A Gaussian's multiplier is its standard
deviation over that distance. A pure epsilon-DP local randomizer is accounted as binary
randomized response with the same epsilon, the dominating pair of every pure epsilon-DP mechanism
(Kairouz, Oh, Viswanath 2015), valid under replace-one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import dp_accounting

from dpfl_lightning.errors import require

GRANULARITIES = ("client", "record")
STREAM_KINDS = ("gaussian", "participations", "tree")
PLACEMENTS = ("local", "central", "distributed")


@dataclass(frozen=True)
class RecordProfile:
    """DP-SGD clients accounted alike: ``records`` each (the run's public records per client), every
    record in a batch with probability ``rate`` (Poisson) or ``batch`` of ``records`` without
    replacement (fixed); ``clients`` ``None`` for every client."""

    records: int
    rate: float
    batch: int
    clients: tuple[int, ...] | None


@dataclass(frozen=True)
class Stream:
    """A correlated-noise (matrix-factorization) mechanism over one planned stream of ``rounds``
    rounds, with participations at least ``min_sep`` rounds apart: what it has released about one
    client after ``r`` rounds (:meth:`event`, unsampled, add/remove neighbours):

    - ``gaussian``: the whole stream is one Gaussian mechanism of multiplier ``noise_multiplier``
      (its sensitivity taken over every allowed participation pattern); a prefix is post-processing
      of the whole release, so the full stream's event is returned from the first round (an upper
      bound until the last);
    - ``participations``: each participation is a Gaussian of multiplier ``noise_multiplier``,
      orthogonal to the others (a ``b``-banded ``C`` with columns of norm <= 1 under min-separation
      ``b``: Choquette-Choo et al., NeurIPS 2023, Thm 2), composed ``ceil(r / min_sep)`` times;
      amplified by Poisson sampling at ``rate`` inside the round's group when ``rate < 1`` (ibid.,
      Thm 4);
    - ``tree``: ``dp_accounting.SingleEpochTreeAggregationDpEvent(noise_multiplier, step_counts)``
      for one participation (Kairouz et al., ICML 2021, App. D), ``step_counts`` the rounds of each
      restart done so far.
    """

    kind: str
    noise_multiplier: float
    rounds: int
    min_sep: int
    rate: float = 1.0
    restart_every: int = 0  # tree: rounds between restarts
    workload: str = "prefix"
    strategy: str = ""
    #: a stream restarted at round ``start`` (a secure-mode resume cannot rebuild the noise state): ``before``
    #: are the earlier segments from round 0 on, each accounted over its own ``rounds`` (this one's are
    #: ``rounds`` from ``start``), ``replaces`` the stream in force when the checkpoint was written
    start: int = 0
    before: tuple = ()
    replaces: Any = None
    #: ``participations`` and ``tree``: the sensitivity of the whole stream's ``C`` that the run's
    #: multiplier ``z`` is scaled by in these events (``noise_multiplier = z sens``: one participation
    #: moves a column of norm <= 1, the noise is ``z sens C``); 1 for ``gaussian``, whose event is ``z``
    sensitivity: float = 1.0

    def __post_init__(self) -> None:
        require(self.kind in STREAM_KINDS, "Stream.kind", self.kind, "unknown stream accounting", f"use {STREAM_KINDS}")
        require(self.kind == "participations" or self.rate >= 1, "Stream.rate", self.rate,
                "amplification by sampling is accounted for per-participation streams only", "use rate=1")

    @property
    def z(self) -> float:
        """The run's noise multiplier ``z`` (noise ``z sens C``), what every privacy line prints."""
        return self.noise_multiplier / self.sensitivity

    def segments(self, r: int) -> list[tuple[Stream, int]]:
        """Each segment with its rounds among the run's first ``r`` (the earlier ones, then this one)."""
        out, at = [], 0
        for seg in self.before:
            out.append((seg, max(0, min(r - at, seg.rounds))))
            at += seg.rounds
        out.append((self, max(0, min(r - self.start, self.rounds))))
        return [(s, n) for s, n in out if n > 0]

    def describe(self) -> tuple[str, str]:
        """The participation and the noise, in words (public settings only)."""
        who = f"cyclic participation, rounds >= {self.min_sep} apart" + (
            f", Poisson sampling q={self.rate:g} inside the group" if self.rate < 1 else ", no amplification")
        per = {"gaussian": "one Gaussian over the stream", "participations": "a Gaussian per participation",
               "tree": "a single-epoch tree aggregation event"}[self.kind]
        noise = f"correlated noise ({self.strategy}, {per}), noise multiplier {self.z:.4g}"
        if self.sensitivity != 1.0:
            noise += f" (x sensitivity {self.sensitivity:.4g} = {self.noise_multiplier:.4g} per " + \
                ("participation)" if self.kind == "participations" else "tree node)")
        if self.before:
            noise += f"; restarted at round {self.start + 1} on a secure resume, {len(self.before) + 1} segments " \
                "composed"
        return who, noise

    def participations(self, r: int) -> int:
        """The most participations of one client in rounds ``0 .. r-1``."""
        return -(-min(r, self.rounds) // self.min_sep)

    def event(self, r: int) -> dp_accounting.DpEvent:
        """What ``r`` rounds of the stream release (a Gaussian's multiplier: std / sensitivity)."""
        if self.kind == "gaussian":
            return dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.kind == "tree":
            r = min(r, self.rounds)
            size = self.restart_every or self.rounds
            counts = [size] * (r // size) + ([r % size] if r % size else [])
            return dp_accounting.SingleEpochTreeAggregationDpEvent(self.noise_multiplier, counts or [0])
        one = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.rate < 1:
            one = dp_accounting.PoissonSampledDpEvent(self.rate, one)
        return dp_accounting.SelfComposedDpEvent(one, self.participations(r))


@dataclass(frozen=True)
class Mechanism:
    """A DP mechanism a plugin runs every round (see module docstring).

    Build one with :meth:`gaussian`, :meth:`laplace`, :meth:`pure` or :meth:`dp_sgd`.
    """

    source: str
    granularity: str
    placement: str
    add_remove: dp_accounting.DpEvent | None
    replace_one: dp_accounting.DpEvent
    sensitivity: float
    covers: tuple[str, ...]
    description: str
    record_profiles: tuple[RecordProfile, ...] = ()
    record_sampling: str = "poisson"
    noise_multiplier: float | None = field(default=None, compare=False)
    #: a correlated-noise mechanism: accounted over its stream of rounds, not round by round
    stream: Stream | None = None
    #: per round, a bound on the probability that the round stops the run observably in a way whose
    #: chance depends on whether a client is in the hidden sample (DiscreteDistributedNoise's short
    #: rounds under Poisson sampling): bounded for the run's population and for its neighbours one client
    #: smaller or larger, from the settings alone. The guarantees towards model observers charge it to delta by
    #: the bad-event argument (:func:`~dpfl_lightning.privacy.guarantees.epsilon_with_stop`).
    stop_probability: float = 0.0
    #: distributed noise whose every participant adds a share of fixed variance (DiscreteDistributedNoise:
    #: shares sized for ``min_survivors``), so the noise in the sum grows with the participants: its
    #: guarantee towards model observers is stated under zero-out neighbours, not add/remove
    #: (:data:`~dpfl_lightning.privacy.accountants.RELATIONS`). GaussianNoise(placement="distributed")
    #: sizes its shares by the cohort, ``sigma^2 / n`` each: ``sigma^2`` in the sum whoever took part.
    share_per_participant: bool = False

    def __post_init__(self) -> None:
        require(self.granularity in GRANULARITIES, "granularity", self.granularity, "unknown", f"use {GRANULARITIES}")
        require(self.placement in PLACEMENTS, "placement", self.placement, "unknown", f"use {PLACEMENTS}")
        require(self.sensitivity > 0, "sensitivity", self.sensitivity, "must be > 0", "bound the contribution first")
        require(0 <= self.stop_probability <= 1, f"{self.source} stop probability", self.stop_probability,
                "must be a probability", "declare a bound in [0, 1] per round")

    def event(self, relation: str) -> dp_accounting.DpEvent:
        """The unsampled event under ``relation`` (``add_remove`` or ``replace_one``)."""
        if relation == "add_remove":
            if self.add_remove is None:
                raise ValueError(f"{self.source}: a local randomizer is accounted under replace-one only")
            return self.add_remove
        return self.replace_one

    @property
    def is_gaussian(self) -> bool:
        return isinstance(self.replace_one, dp_accounting.GaussianDpEvent)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def gaussian(cls, source: str, std: float, sensitivity: float, placement: str, covers: tuple[str, ...],
                 granularity: str = "client", replace_sensitivity: float | None = None) -> Mechanism:
        """``N(0, std^2 I)`` on a sum of contributions of L2 norm at most ``sensitivity``: adding or
        removing one moves the sum by ``sensitivity``, replacing one by ``replace_sensitivity``
        (default ``2 sensitivity``; a sum of values in ``[0, B]`` moves by ``B`` either way)."""
        require(math.isfinite(std) and std >= 0, f"{source} noise std", std, "must be a finite number >= 0",
                "give a finite, non-negative noise scale")
        z = std / sensitivity
        replace = 2 * sensitivity if replace_sensitivity is None else replace_sensitivity
        require(math.isfinite(z), f"{source} noise multiplier", z, "std / sensitivity must be finite",
                "give a noise scale and bound whose ratio is a finite number")
        return cls(source, granularity, placement, dp_accounting.GaussianDpEvent(z),
                   dp_accounting.GaussianDpEvent(std / replace), sensitivity, tuple(covers),
                   f"Gaussian noise std {std:.4g} on contributions of L2 norm <= {sensitivity:.4g} (multiplier {z:.4g})",
                   noise_multiplier=z)

    @classmethod
    def correlated(cls, source: str, stream: Stream, covers: tuple[str, ...], description: str) -> Mechanism:
        """A matrix-factorization mechanism on the sum of contributions of L2 norm at most 1 (the
        noise is scaled by the bound in force): its events are the stream's (:class:`Stream`)."""
        event = dp_accounting.GaussianDpEvent(stream.noise_multiplier)
        return cls(source, "client", "central", event, dp_accounting.GaussianDpEvent(stream.noise_multiplier / 2), 1.0,
                   tuple(covers), description, noise_multiplier=stream.z, stream=stream)

    @classmethod
    def laplace(cls, source: str, scale: float, l1_sensitivity: float, placement: str, covers: tuple[str, ...],
                granularity: str = "client") -> Mechanism:
        """``Laplace(scale)`` per coordinate on a sum of contributions of L1 norm at most
        ``l1_sensitivity``."""
        b = scale / l1_sensitivity
        return cls(source, granularity, placement, dp_accounting.LaplaceDpEvent(b), dp_accounting.LaplaceDpEvent(b / 2),
                   l1_sensitivity, tuple(covers),
                   f"Laplace noise scale {scale:.4g} on contributions of L1 norm <= {l1_sensitivity:.4g}")

    @classmethod
    def pure(cls, source: str, epsilon: float, covers: tuple[str, ...], sensitivity: float = 1.0) -> Mechanism:
        """A local randomizer that is pure ``epsilon``-DP for any two inputs (replace-one)."""
        require(math.isfinite(epsilon) and epsilon > 0, f"{source}.epsilon", epsilon, "must be a finite number > 0",
                "set a positive epsilon")
        p = 2.0 / (1.0 + math.exp(epsilon))  # binary randomized response with e^eps = (1 - p/2) / (p/2)
        return cls(source, "client", "local", None, dp_accounting.RandomizedResponseDpEvent(p, 2), sensitivity,
                   tuple(covers), f"pure {epsilon:.4g}-DP local randomizer")

    @classmethod
    def dp_sgd(cls, source: str, noise_multiplier: float, profiles: tuple[RecordProfile, ...], sampling: str) -> Mechanism:
        """DP-SGD: per-record clipping and Gaussian noise of multiplier ``z`` on each batch's sum;
        one composition per local step (see :class:`RecordProfile`)."""
        z = noise_multiplier
        return cls(source, "record", "local", dp_accounting.GaussianDpEvent(z), dp_accounting.GaussianDpEvent(z / 2),
                   1.0, ("*",), f"DP-SGD noise multiplier {z:.4g} per local step", profiles, sampling,
                   noise_multiplier=z)
