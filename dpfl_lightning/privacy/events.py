"""What a mechanism releases, and the DP guarantee that follows for the configured threat model.

A plugin that adds noise declares a :class:`Mechanism` (``FederatedCallback.privacy_mechanism``):
its noise standard deviation, the L2 bound of one unit's contribution, the granularity (a client's
whole update, or one record inside a client) and the placement of the noise. :func:`guarantee`
turns it, together with the trainer's client sampler, into the :class:`GaussianRelease` that is
composed and the set of neighbouring datasets it is valid for:

==================  ==========================================================  =======================
declared            accounted as (per round)                                    guarantee towards
==================  ==========================================================  =======================
client, central     Gaussian(std / C) after the trainer's client sampling:       anyone who sees the
                    Poisson(q): add/remove, sensitivity C;                       models (trusted
                    fixed-size m of M: without replacement, replace-one, 2C;     aggregator)
                    full participation: add/remove, C
client, distributed same as central (the shares sum to the central noise)        anyone, if secure
                                                                                 aggregation hides shares
client, local       Gaussian(std / 2C) per round the client took part in;        the server (local DP)
                    replace-one (any two updates of norm <= C differ by 2C);
                    no amplification: the server sees who takes part
record (DP-SGD)     Poisson(s)-sampled Gaussian(z) per local step, add/remove     the server, per client
                    of one record, K steps per round the client took part in
==================  ==========================================================  =======================
"""

from __future__ import annotations

from dataclasses import dataclass

from dpfl_lightning.errors import require
from dpfl_lightning.privacy.accountants import GaussianRelease
from dpfl_lightning.sampling import ClientSampler

GRANULARITIES = ("client", "record")
PLACEMENTS = ("local", "central", "distributed")


@dataclass(frozen=True)
class Mechanism:
    """A Gaussian mechanism a plugin runs every round.

    Args:
        source: the plugin's name, for messages.
        granularity: ``client`` (a client's whole update is the unit) or ``record``.
        placement: ``local``, ``central`` or ``distributed``.
        std: the noise standard deviation (for record-level DP-SGD: the noise multiplier, with
            ``sensitivity = 1``).
        sensitivity: the L2 bound ``C`` of one unit's contribution.
        steps_per_round: compositions per round a client takes part in (DP-SGD's local steps).
        record_sampling_rate: DP-SGD's Poisson sampling rate of records within a client.
    """

    source: str
    granularity: str
    placement: str
    std: float
    sensitivity: float
    steps_per_round: int = 1
    record_sampling_rate: float | None = None

    def __post_init__(self) -> None:
        require(self.granularity in GRANULARITIES, "granularity", self.granularity, "unknown", f"use {GRANULARITIES}")
        require(self.placement in PLACEMENTS, "placement", self.placement, "unknown", f"use {PLACEMENTS}")
        require(self.sensitivity > 0, "sensitivity", self.sensitivity, "must be > 0", "bound the contribution first")


@dataclass(frozen=True)
class Guarantee:
    """A release composed per round (``per_client=False``) or per participation of a client."""

    name: str
    description: str
    release: GaussianRelease
    per_client: bool
    steps_per_round: int
    granularity: str


def guarantee(mech: Mechanism, sampler: ClientSampler) -> Guarantee:
    """The accounted release of ``mech`` under the trainer's client sampling (see module table)."""
    if mech.granularity == "record":
        release = GaussianRelease(mech.std / mech.sensitivity, "poisson" if (mech.record_sampling_rate or 1) < 1 else "none",
                                  mech.record_sampling_rate or 1.0, "add_remove")
        return Guarantee("record", "record-level DP of each client's updates, towards the server", release, True,
                         mech.steps_per_round, "record")
    if mech.placement == "local":
        release = GaussianRelease(mech.std / (2 * mech.sensitivity), "none", 1.0, "replace_one")
        return Guarantee("client_local", "client-level local DP, towards the server", release, True,
                         mech.steps_per_round, "client")
    if sampler.kind == "poisson":
        release = GaussianRelease(mech.std / mech.sensitivity, "poisson", sampler.rate, "add_remove")
    elif sampler.kind == "uniform" and sampler.clients_per_round < sampler.num_clients:
        release = GaussianRelease(mech.std / (2 * mech.sensitivity), "without_replacement", relation="replace_one",
                                  population=sampler.num_clients, sample_size=sampler.clients_per_round)
    else:
        release = GaussianRelease(mech.std / mech.sensitivity, "none", 1.0, "add_remove")
    who = ("anyone who sees the models (trusted aggregator)" if mech.placement == "central"
           else "anyone incl. the server, assuming secure aggregation")
    return Guarantee(f"client_{mech.placement}", f"client-level DP, {mech.placement} noise, towards {who}", release,
                     False, mech.steps_per_round, "client")


def default_delta(n: int) -> float:
    """A power of ten at most ``0.1 / n``: well below ``1/n`` (``n``: clients or records)."""
    import math

    return 10.0 ** math.floor(math.log10(0.1 / max(n, 1)))
