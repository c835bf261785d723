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
client, distributed per participation, replace-one, Gaussian(std / 2C)          the server, if secure
                                                                                 aggregation hides shares
                    and, second, as central                                      anyone who sees only
                                                                                 the models
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
        record_sampling: DP-SGD's batch sampling: ``poisson`` or ``fixed`` (without replacement).
        profiles: record-level only: ``(records n, sampling rate, steps per round, clients)`` for
            each group of clients that share them (their datasets differ in size).
    """

    source: str
    granularity: str
    placement: str
    std: float
    sensitivity: float
    steps_per_round: int = 1
    record_sampling: str = "poisson"
    profiles: tuple[tuple[int, float, int, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        require(self.granularity in GRANULARITIES, "granularity", self.granularity, "unknown", f"use {GRANULARITIES}")
        require(self.placement in PLACEMENTS, "placement", self.placement, "unknown", f"use {PLACEMENTS}")
        require(self.sensitivity > 0, "sensitivity", self.sensitivity, "must be > 0", "bound the contribution first")


@dataclass(frozen=True)
class Profile:
    """One accounted release and how many times a participation composes it; ``clients`` is
    ``None`` for every client."""

    release: GaussianRelease
    steps_per_round: int
    clients: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Guarantee:
    """Releases composed per round (``per_client=False``) or per participation of a client."""

    name: str
    description: str
    profiles: tuple[Profile, ...]
    per_client: bool
    granularity: str

    @property
    def release(self) -> GaussianRelease:
        return self.profiles[0].release

    @property
    def steps_per_round(self) -> int:
        return self.profiles[0].steps_per_round


def _record_release(mech: Mechanism, n: int, rate: float) -> GaussianRelease:
    z = mech.std / mech.sensitivity
    if rate >= 1:
        return GaussianRelease(z, "none", 1.0, "add_remove")
    if mech.record_sampling == "poisson":
        return GaussianRelease(z, "poisson", rate, "add_remove")
    # fixed-size batches: replacing one record moves the clipped sum by up to 2C
    return GaussianRelease(z / 2, "without_replacement", relation="replace_one", population=n,
                           sample_size=round(rate * n))


def guarantees(mech: Mechanism, sampler: ClientSampler) -> list[Guarantee]:
    """The accounted releases of ``mech`` under the trainer's client sampling (see module table);
    the first is the guarantee a run reports as ``epsilon``."""
    if mech.granularity == "record":
        profiles = tuple(Profile(_record_release(mech, n, rate), steps, clients) for n, rate, steps, clients in mech.profiles)
        return [Guarantee("record", f"record-level DP ({mech.source}) of each client's updates, towards the server",
                          profiles, True, "record")]
    # Whoever knows who took part (the server always does) gets no amplification by sampling, and
    # for it "neighbours" are the same clients with one client's data replaced: sensitivity 2C.
    per_participation = (Profile(GaussianRelease(mech.std / (2 * mech.sensitivity), "none", 1.0, "replace_one"),
                                 mech.steps_per_round),)
    if mech.placement == "local":
        return [Guarantee("client_local", "client-level local DP, towards the server", per_participation, True, "client")]
    if sampler.kind == "poisson":
        release = GaussianRelease(mech.std / mech.sensitivity, "poisson", sampler.rate, "add_remove")
    elif sampler.kind == "uniform" and sampler.clients_per_round < sampler.num_clients:
        release = GaussianRelease(mech.std / (2 * mech.sensitivity), "without_replacement", relation="replace_one",
                                  population=sampler.num_clients, sample_size=sampler.clients_per_round)
    else:
        release = GaussianRelease(mech.std / mech.sensitivity, "none", 1.0, "add_remove")
    models = (Profile(release, mech.steps_per_round),)
    if mech.placement == "central":
        return [Guarantee("client_central", "client-level DP, central noise, towards anyone who sees the models but "
                          "not who took part (trusted aggregator)", models, False, "client")]
    return [Guarantee("client_distributed", "client-level DP, distributed noise, towards the server (secure "
                      "aggregation hides the shares; the server knows who took part)", per_participation, True, "client"),
            Guarantee("client_distributed_models", "client-level DP, distributed noise, towards anyone who sees the "
                      "models but not who took part", models, False, "client")]


def guarantee(mech: Mechanism, sampler: ClientSampler) -> Guarantee:
    """The main guarantee of ``mech`` (the first of :func:`guarantees`)."""
    return guarantees(mech, sampler)[0]


def default_delta(n: int) -> float:
    """A power of ten at most ``0.1 / n``: well below ``1/n`` (``n``: clients or records)."""
    import math

    return 10.0 ** math.floor(math.log10(0.1 / max(n, 1)))
