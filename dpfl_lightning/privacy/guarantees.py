"""From declared mechanisms to the DP guarantees a run reports, and towards whom.

:func:`guarantees` groups the :class:`~dpfl_lightning.privacy.mechanisms.Mechanism` s of a run by
granularity and audience, composes the mechanisms of a group that act on the same round, and puts
the trainer's client sampling in front:

==========================  =======================================================  ============================
guarantee (metric)          accounted as                                             towards
==========================  =======================================================  ============================
``record``                  per DP-SGD step of a client: Poisson(B/n)-sampled         the server, per client
                            Gaussian (add/remove), or B of n without replacement
                            (replace-one, 2C; also when B >= n)
``client_local`` /          per participation of a client: every local and            the server (for distributed
``client_distributed``      distributed mechanism, replace-one (2C), no               noise: if secure aggregation
                            amplification (the server knows who took part)            hides the shares)
``client_central`` /        per round: every client-level mechanism after the         anyone who sees the models but
``client_distributed_       client sampling: Poisson(q) add/remove (C); m of M        not who took part
models``                    without replacement, replace-one (2C); everyone: C
==========================  =======================================================  ============================

Gaussians on the same sample compose as one Gaussian; a pure-DP local randomizer is randomized
response (replace-one only) and is not amplified by sampling. With a central mechanism in the run
no guarantee towards the server is reported: the server sees the un-noised aggregate (trusted
aggregator). The first guarantee is the one a run logs as ``epsilon``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpfl_lightning.privacy.accountants import GaussianRelease, Release
from dpfl_lightning.privacy.mechanisms import Mechanism, RecordProfile


@dataclass(frozen=True)
class Profile:
    """One accounted release. ``record`` (record-level) says how many compositions a
    participation makes (its local steps); ``clients`` is ``None`` for every client."""

    release: Release
    clients: tuple[int, ...] | None = None
    record: RecordProfile | None = None


@dataclass(frozen=True)
class Guarantee:
    """Releases composed per round (``per_client=False``) or per participation of a client."""

    name: str
    description: str
    audience: str
    granularity: str
    per_client: bool
    profiles: tuple[Profile, ...]

    @property
    def release(self) -> Release:
        return self.profiles[0].release


@dataclass(frozen=True)
class Sampling:
    """The client sampling in front of every round (what the accountant assumes)."""

    kind: str  # poisson, uniform, full
    num_clients: int
    rate: float  # Poisson rate, or m / M
    clients_per_round: int | None = None
    groups: int | None = None  # cyclic participation: the number of groups (min-separation)


def _record_release(mech: Mechanism, p: RecordProfile) -> Release:
    z = mech.noise_multiplier
    if mech.record_sampling == "poisson":
        if p.rate >= 1:
            return GaussianRelease(z, "none", 1.0, "add_remove")
        return GaussianRelease(z, "poisson", p.rate, "add_remove")
    # fixed-size batches: replacing one record moves the clipped sum by up to 2C, also when the
    # batch is every record, so that every client is accounted under the same relation
    if p.batch >= p.records:
        return GaussianRelease(z / 2, "none", 1.0, "replace_one")
    return GaussianRelease(z / 2, "without_replacement", relation="replace_one", population=p.records,
                           sample_size=p.batch)


def _models_release(mechs: list[Mechanism], sampling: Sampling, relation: str | None = None) -> Release:
    streams = [m.stream for m in mechs if m.stream is not None]
    if streams:  # correlated noise: accounted over its stream (the sampler's groups are in the stream)
        others = tuple(m.event("add_remove") for m in mechs if m.stream is None)
        return Release(others, "none", 1.0, "add_remove", stream=streams[0])
    if any(m.add_remove is None for m in mechs) or \
            (relation == "replace_one" and (sampling.kind == "full" or sampling.rate >= 1)):
        # a local randomizer: replace-one, not amplified; or replace-one asked for (papers 000 and 002)
        return Release(tuple(m.event("replace_one") for m in mechs), "none", 1.0, "replace_one")
    if sampling.kind == "poisson" and sampling.rate < 1:
        return Release(tuple(m.event("add_remove") for m in mechs), "poisson", sampling.rate, "add_remove")
    if sampling.kind == "uniform" and sampling.clients_per_round < sampling.num_clients:
        return Release(tuple(m.event("replace_one") for m in mechs), "without_replacement", relation="replace_one",
                       population=sampling.num_clients, sample_size=sampling.clients_per_round)
    return Release(tuple(m.event("add_remove") for m in mechs), "none", 1.0, "add_remove")


def _names(mechs: list[Mechanism]) -> str:
    return ", ".join(sorted({m.source for m in mechs}))


def guarantees(mechanisms: list[Mechanism], sampling: Sampling, relation: str | None = None) -> list[Guarantee]:
    """The guarantees of a run (see the module table); the first is the one logged as ``epsilon``.
    ``relation="replace_one"`` accounts the models guarantee of a run without client sampling
    under replace-one neighbours (``2C`` for clipped updates, ``C^2`` for squared norms), the
    convention of papers 000 and 002, instead of add/remove."""
    out: list[Guarantee] = []
    for mech in (m for m in mechanisms if m.granularity == "record"):
        profiles = tuple(Profile(_record_release(mech, p), p.clients, p) for p in mech.record_profiles)
        out.append(Guarantee("record", f"record-level DP ({mech.source}) of each client's updates, towards the server",
                             "server", "record", True, profiles))
    client = [m for m in mechanisms if m.granularity == "client"]
    if not client:
        return out
    at_clients = [m for m in client if m.placement in ("local", "distributed")]
    central = [m for m in client if m.placement == "central"]
    if at_clients and not central:
        release = Release(tuple(m.event("replace_one") for m in at_clients), "none", 1.0, "replace_one")
        if all(m.placement == "local" for m in at_clients):
            out.append(Guarantee("client_local", f"client-level local DP ({_names(at_clients)}), towards the server",
                                 "server", "client", True, (Profile(release),)))
            return out  # the models are a function of what the server saw
        out.append(Guarantee("client_distributed", f"client-level DP, distributed noise ({_names(at_clients)}), towards "
                             "the server (secure aggregation hides the shares; the server knows who took part)",
                             "server", "client", True, (Profile(release),)))
    release = _models_release(client, sampling, relation)
    if central:
        name, what = "client_central", "client-level DP, central noise"
    else:
        name, what = "client_distributed_models", "client-level DP, distributed noise"
    streams = "".join(f"; {m.description}" for m in client if m.stream is not None)
    out.append(Guarantee(name, f"{what} ({_names(client)}), towards anyone who sees the models but not who took part"
                         + (" (trusted aggregator)" if central else "") + streams, "models", "client", False,
                         (Profile(release),)))
    return out


def default_delta(n: int) -> float:
    """A power of ten at most ``0.1 / n``: well below ``1/n`` (``n``: clients or records)."""
    return 10.0 ** math.floor(math.log10(0.1 / max(n, 1)))


#: the records per client that record-level DP's default delta assumes at most (a public setting)
ASSUMED_RECORDS_PER_CLIENT = 10 ** 5


def default_delta_for(granularity: str, num_clients: int) -> float:
    """The default delta of a ``granularity``-level guarantee, a function of public settings only.

    The common rule is ``delta << 1/n`` for ``n`` the units the neighbouring relation adds or removes
    (a mechanism that publishes one of ``n`` units in full, at random, is ``(0, 1/n)``-DP: Dwork and
    Roth, *The Algorithmic Foundations of Differential Privacy*, 2014, section 2.3). Client-level:
    ``n`` is the number of clients, a setting of the run; the default is
    :func:`default_delta` ``(num_clients)``.

    Record-level (DP-SGD): neighbours add or remove one record of one client, so the clients' record
    counts are the data itself, and a default that followed them (the smallest client's count, as it
    once did) would print and save a delta that changes when one client's count crosses a power of
    ten -- a release about that client that no mechanism accounts. The default assumes instead at most
    :data:`ASSUMED_RECORDS_PER_CLIENT` (``10^5``) records per client: ``1e-6 <= 0.1/n`` for every client
    that holds no more (a whole MNIST or CIFAR-10 training set in one client included; Abadi et al.,
    "Deep Learning with Differential Privacy", 2016, used 1e-5 for MNIST's 60,000). A client holding
    more needs a smaller delta, set explicitly (``DPSGD(delta=)``, ``PrivacyLedger(delta=)``)."""
    if granularity == "client":
        return default_delta(num_clients)
    return default_delta(ASSUMED_RECORDS_PER_CLIENT)
