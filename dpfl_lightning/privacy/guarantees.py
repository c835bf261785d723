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
                            amplification (the server knows who took part)            hides the shares; in a
                                                                                      simulation, not from
                                                                                      whoever has the seed)
``client_central`` /        per round: every client-level mechanism after the         anyone who sees the models but
``client_distributed_       client sampling: Poisson(q) add/remove (C); m of M        not who took part
models``                    without replacement, replace-one (2C); everyone: C
==========================  =======================================================  ============================

Distributed noise whose shares come with their client (``share_per_participant``) is accounted
towards model observers under zero-out neighbours instead of add/remove
(:data:`~dpfl_lightning.privacy.accountants.RELATIONS`). Gaussians on the same sample compose as one Gaussian; a pure-DP local randomizer is randomized
response (replace-one only) and is not amplified by sampling. With a central mechanism in the run
no guarantee towards the server is reported: the server sees the un-noised aggregate (trusted
aggregator). The first guarantee is the one a run logs as ``epsilon``.

**A stop that depends on the hidden sample.** A mechanism may declare a ``stop_probability``
(:class:`~dpfl_lightning.privacy.mechanisms.Mechanism`): per round, a bound ``p`` on the chance that
the round stops the run, observably, where that chance depends on whether a client is in the
sample (:class:`~dpfl_lightning.plugins.DiscreteDistributedNoise` under Poisson sampling: a round
with fewer survivors than its shares are sized for). The standard "bad event" argument charges it
to delta. Let ``B`` be the stop, ``s = min(1, rounds * p)`` (bounding ``P_D[B]`` and ``P_D'[B]``), ``M'``
the real run and ``I`` the ideal mechanism that never stops (every round with the noise the ledger
accounts; ``(eps, delta_I)``-DP). Coupled on the same coins, ``M'`` and ``I`` agree off ``B``, so for
every output set ``S`` and neighbours ``D, D'``::

    P[M'(D) in S] <= P[I(D) in S] + P_D[B] <= e^eps P[I(D') in S] + delta_I + P_D[B]
                  <= e^eps P[M'(D') in S] + delta_I + P_D[B] + e^eps P_D'[B]

and ``M'`` is ``(eps, delta_I + (1 + e^eps) s)``-DP. The guarantees towards model observers
(``client_central``, ``client_distributed_models``, amplified by the hidden sampling) therefore report
the least ``eps`` with ``eps >= eps_I(delta - (1 + e^eps) s)`` (:func:`epsilon_with_stop`; ``eps_I``
falls as its delta grows, so iterating from ``s = 0`` climbs to it), and a run where no such ``eps``
exists is refused at set-up (:func:`stop_refusal`). The guarantees towards the server are not
charged: it runs secure aggregation with the cohort, so who took part and who dropped are known to
it (it unmasks the dropped clients' shares), the stop is a function of those, and a per-participation
guarantee without amplification already treats them as public.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from dpfl_lightning.errors import ConfigError
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
    #: per round: a bound on the chance of a stop that depends on the hidden sample (module docstring;
    #: the sum over the mechanisms that declare one: a union bound), and those mechanisms
    stop_probability: float = 0.0
    stop_sources: tuple[str, ...] = ()

    @property
    def release(self) -> Release:
        return self.profiles[0].release

    def stop_after(self, rounds: int) -> float:
        """``s``: a bound on the chance that the first ``rounds`` rounds stop the run (union bound)."""
        return min(1.0, rounds * self.stop_probability)


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
    # shares that come and go with their client: zero-out neighbours (accountants.RELATIONS says why)
    add = "zero_out" if any(m.share_per_participant for m in mechs) else "add_remove"
    if sampling.kind == "poisson" and sampling.rate < 1:
        return Release(tuple(m.event("add_remove") for m in mechs), "poisson", sampling.rate, add)
    if sampling.kind == "uniform" and sampling.clients_per_round < sampling.num_clients:
        return Release(tuple(m.event("replace_one") for m in mechs), "without_replacement", relation="replace_one",
                       population=sampling.num_clients, sample_size=sampling.clients_per_round)
    return Release(tuple(m.event("add_remove") for m in mechs), "none", 1.0, add)


def _names(mechs: list[Mechanism]) -> str:
    return ", ".join(sorted({m.source for m in mechs}))


#: what hides a client's noise share from the server, in ``client_distributed``'s description, by mode
#: (``trainer.secure``; ``None``: not said)
SHARES_HIDDEN = {
    None: "secure aggregation hides the shares",
    True: "secure aggregation hides the shares",
    False: "simulation: the noise shares and any SecAgg masks are keyed by the logged seed, so anyone with the seed "
           "rebuilds every share and mask: they are hidden only from someone without the seed",
}


def guarantees(mechanisms: list[Mechanism], sampling: Sampling, relation: str | None = None,
               secure: bool | None = None) -> list[Guarantee]:
    """The guarantees of a run (see the module table); the first is the one logged as ``epsilon``.
    ``relation="replace_one"`` accounts the models guarantee of a run without client sampling
    under replace-one neighbours (``2C`` for clipped updates, ``C^2`` for squared norms), the
    convention of papers 000 and 002, instead of add/remove. ``secure``: the run's mode
    (``trainer.secure``), which says what hides the noise shares from the server
    (:data:`SHARES_HIDDEN`: in a simulation, nothing from whoever knows the seed)."""
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
                             f"the server ({SHARES_HIDDEN[secure]}; the server knows who took part)",
                             "server", "client", True, (Profile(release),)))
    release = _models_release(client, sampling, relation)
    if central:
        name, what = "client_central", "client-level DP, central noise"
    else:
        name, what = "client_distributed_models", "client-level DP, distributed noise"
    streams = "".join(f"; {m.description}" for m in client if m.stream is not None)
    stoppers = [m for m in client if m.stop_probability > 0]
    out.append(Guarantee(name, f"{what} ({_names(client)}), towards anyone who sees the models but not who took part"
                         + (" (trusted aggregator)" if central else "") + streams, "models", "client", False,
                         (Profile(release),), min(1.0, sum(m.stop_probability for m in stoppers)),
                         tuple(sorted({m.source for m in stoppers}))))
    return out


# ------------------------------------------------------------------ a stop charged to delta
#: the share of delta that a default setting lets the stop's charge ``(1 + e^eps) s`` take
#: (DiscreteDistributedNoise's default ``min_survivors`` under Poisson sampling)
STOP_SHARE = 0.1


def stop_penalty(epsilon: float, stop: float) -> float:
    """``(1 + e^eps) s``: what a stop of probability at most ``s`` adds to delta (module docstring)."""
    if stop <= 0:
        return 0.0
    return math.inf if epsilon > 700 else (1.0 + math.exp(epsilon)) * stop


def epsilon_with_stop(eps_at: Callable[[float], float], delta: float, stop: float, rtol: float = 1e-9,
                      max_iter: int = 200) -> float | None:
    """The least ``eps`` (to ``rtol``, never below it) with ``eps >= eps_at(delta - (1 + e^eps) stop)``,
    ``eps_at(d)`` the ideal mechanism's epsilon at delta ``d`` (non-increasing in ``d``); ``None`` when
    none exists (the charge reaches delta, or the iteration diverges). ``stop = 0``: ``eps_at(delta)``.

    Fixed-point iteration from ``s = 0``: ``e_0 = eps_at(delta)``, ``e_{k+1} = eps_at(delta -
    (1 + e^{e_k}) stop)``, climbing to the least fixed point; once a step is below ``rtol``, the
    candidate one step further up is returned as soon as it satisfies the inequality (a valid
    epsilon, within two steps of the least one)."""
    e = eps_at(delta)
    if stop <= 0:
        return e
    for _ in range(max_iter):
        room = delta - stop_penalty(e, stop)
        if not room > 0 or not math.isfinite(e):
            return None
        nxt = eps_at(room)
        if nxt <= e:  # e already satisfies the inequality
            return e
        step = nxt - e
        if step <= rtol * max(1.0, nxt):
            up = nxt + 2 * step + rtol * max(1.0, nxt)
            room = delta - stop_penalty(up, stop)
            if room > 0 and eps_at(room) <= up:
                return up
        e = nxt
    return None


def stop_refusal(guarantee: Guarantee, delta: float, rounds: int) -> ConfigError:
    """The set-up's refusal of a run whose stop leaves the guarantee ``guarantee`` no delta."""
    s = guarantee.stop_after(rounds)
    names = guarantee.stop_sources or ("the mechanism",)
    setting = " / ".join(f"{n}.min_survivors, {n}.dropout" for n in names) + ", trainer.sampling"
    return ConfigError(setting, {"stop_probability": float(f"{s:.3g}"), "delta": delta},
                       f"under hidden-size sampling (Poisson, amplified cyclic) a round with fewer survivors than the shares are sized for "
                       f"(or than the SecAgg threshold) stops the run, observably, with probability up to {s:.3g} "
                       f"over {rounds} rounds; the guarantee towards model observers ({guarantee.name}) must charge "
                       f"(1 + e^eps) x that to delta={delta:g}, which leaves no epsilon",
                       "lower min_survivors, set fewer dropouts, or use sampling='uniform' (a fixed-size cohort: "
                       "the stop then reveals nothing and is not charged); or raise delta")


def default_delta(n: int) -> float:
    """A power of ten at most ``0.1 / n``: well below ``1/n`` (``n``: clients or records)."""
    return 10.0 ** math.floor(math.log10(0.1 / max(n, 1)))


#: the records per client that record-level DP's default delta assumes at most (a public setting)
ASSUMED_RECORDS_PER_CLIENT = 10 ** 5


def default_delta_for(granularity: str, num_clients: int, records: int | None = None) -> float:
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
    more needs a smaller delta, set explicitly (``DPSGD(delta=)``, ``PrivacyLedger(delta=)``), or a
    public ``records`` per client (``trainer.records_per_client``) above it: the default is then
    :func:`default_delta` ``(records)``."""
    if granularity == "client":
        return default_delta(num_clients)
    return default_delta(max(ASSUMED_RECORDS_PER_CLIENT, records or 0))
