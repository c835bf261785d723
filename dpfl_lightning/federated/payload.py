"""What a client sends: named segments laid out in one row, summed by one exact all-reduce.

Every client's contribution is a row of ``PayloadLayout.size`` float32 values made of named
segments: ``update`` (the model update, ``d`` values) always, plus whatever the plugins declare
(:meth:`~dpfl_lightning.plugins.FederatedCallback.payload_segments`), e.g. SCAFFOLD's control-variate
delta ``dc`` (``d``) or FedEXP's squared norm ``norm_sq`` (1). Plugins read and write a client's
segments by name (``client.payload["dc"]``); after the all-reduce the server reads the sums by the
same names (``server.aggregate["dc"]``).

Frozen parameters are not part of the update (:mod:`dpfl_lightning.federated.frozen`): in a round whose plan
marks some parameters frozen (``RoundPlan.trainable``), a client's ``update`` segment holds only
the ``d_t`` trainable entries, in the order of the flat parameters, and only those are bounded,
noised and sent (for a LoRA adapter on a frozen base, the adapter's entries). The server reads the
update sum at full length, zero at the frozen entries (``server.aggregate["update"]``, ``d``
values), so the server step and the plugins' server hooks index it as the flat parameters.
:func:`full_update` and :func:`trainable_part` convert a client's vector between the two.

A segment states its ``source``:

- ``model``: a function of the client's local model trajectory and of public state only (the update
  itself, a control-variate delta). DP-SGD inside the client protects it (post-processing).
- ``data``: computed from the client's raw data or raw update statistics (a loss, a norm, a count).
  Only a mechanism declared for it protects it.
- ``released``: computed from segments the client already randomized with a local mechanism
  (FedEXP's ``||c_i||^2`` of a noised update): post-processing of a local release, covered when a
  local mechanism covers every segment it reads (``derived_from``).
- ``control``: the trainer's own flag that a client's update was not finite, which stops the run
  (``on_nonfinite="raise"``); never logged.

In a DP run, every segment must be protected by a declared mechanism (noise it covers, or DP-SGD for
``model`` segments); :func:`check_coverage` refuses the run otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpfl_lightning.errors import ConfigError, require

SOURCES = ("model", "data", "released", "control")
UPDATE = "update"


@dataclass(frozen=True)
class Segment:
    """A named part of every client's row: ``size`` float32 values (1 for a scalar), declared by
    ``owner``; ``source`` as in the module docstring."""

    name: str
    size: int
    source: str = "model"
    owner: str = "trainer"
    derived_from: tuple[str, ...] = ("update",)  # "released" segments: what they are computed from

    def __post_init__(self) -> None:
        require(self.name.isidentifier(), "payload segment", self.name, "must be an identifier", "rename the segment")
        require(self.size >= 1, f"payload segment {self.name}", self.size, "must have size >= 1", "declare size >= 1")
        require(self.source in SOURCES, f"payload segment {self.name}", self.source, "unknown source",
                f"use one of {SOURCES}")


class PayloadLayout:
    """Where each segment lives in a row."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments: list[Segment] = []
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for seg in segments:
            if seg.name in self.offsets:
                other = next(s for s in self.segments if s.name == seg.name)
                raise ConfigError("payload segment", seg.name, f"declared by both {other.owner} and {seg.owner}",
                                  "rename one of them")
            self.segments.append(seg)
            self.offsets[seg.name] = (offset, offset + seg.size)
            offset += seg.size
        self.size = offset

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.segments]

    def views(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into ``row`` (1-D of length ``size``)."""
        return {name: row[a:b] for name, (a, b) in self.offsets.items()}

    def segment(self, name: str) -> Segment:
        return next(s for s in self.segments if s.name == name)

    def resized(self, name: str, size: int) -> PayloadLayout:
        """The same layout with segment ``name`` of ``size`` values (the update of a round with frozen
        parameters)."""
        return PayloadLayout([Segment(s.name, size, s.source, s.owner, s.derived_from) if s.name == name else s
                              for s in self.segments])


def full_update(update: torch.Tensor, trainable: torch.Tensor | None) -> torch.Tensor:
    """A client's ``update`` segment at the length of the flat parameters: itself when it already
    has that length (every parameter trainable, ``trainable`` is ``None``, or a run without DP, whose
    payload is never restricted), else a new vector, zero at the frozen entries and ``update`` at the
    trainable ones (``trainable``: the round's mask, ``client.plan.trainable``)."""
    if trainable is None or update.numel() == trainable.numel():
        return update
    return update.new_zeros(trainable.numel()).masked_scatter_(trainable, update)


def trainable_part(vector: torch.Tensor, trainable: torch.Tensor | None, length: int) -> torch.Tensor:
    """The entries of a vector over the flat parameters that a client's ``update`` segment of
    ``length`` entries holds: ``vector`` itself when the segment is at full length, else its
    trainable entries (a copy)."""
    return vector if trainable is None or length == vector.numel() else vector[trainable]


class Aggregate:
    """The cohort's sums after the all-reduce, identical on every rank, by segment name (float64).

    ``denominator`` is what the trainer divides the update sum by to get the mean update (the cohort
    size, its expectation under Poisson sampling, or the total weight); ``num_clients`` is the
    cohort's size (not public under Poisson sampling: never logged in a DP run).
    """

    def __init__(self, round_idx: int, sums: dict[str, torch.Tensor], num_clients: int, denominator: float,
                 skipped: int = 0) -> None:
        self.round_idx = round_idx
        self.sums = sums
        self.num_clients = num_clients
        self.denominator = denominator
        self.skipped = skipped

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.sums[name]

    def __contains__(self, name: str) -> bool:
        return name in self.sums

    @property
    def update_sum(self) -> torch.Tensor:
        return self.sums[UPDATE]

    def scalar(self, name: str) -> float:
        return float(self.sums[name][0])


def check_coverage(layout: PayloadLayout, covered: dict[str, list[str]], record_level: bool,
                   locally: set[str] | None = None) -> None:
    """Refuse a DP run in which a segment leaves every client unprotected.

    ``covered`` maps a segment name to the mechanisms (sources) that declared it; ``"*"`` covers
    every ``model`` segment (DP-SGD: everything derived from the DP-trained local model);
    ``locally`` names the segments a local mechanism covers (what ``released`` segments may read)."""
    for seg in layout.segments:
        if covered.get(seg.name):
            continue
        if seg.source == "released" and set(seg.derived_from) <= (locally or set()):
            continue
        if seg.source == "model" and (record_level or covered.get("*")):
            continue
        raise ConfigError(f"payload segment {seg.name!r}", seg.owner,
                          f"it leaves every client ({seg.source} statistic) with no declared DP mechanism in a DP run",
                          f"declare noise for it (e.g. GaussianNoise(segments=[{seg.name!r}, ...])) or remove the plugin "
                          f"that sends it")
