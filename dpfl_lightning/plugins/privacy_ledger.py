"""PrivacyLedger: epsilon after every round, in the logs and checkpoints, and an optional budget.

The ledger takes every :class:`~dpfl_lightning.privacy.mechanisms.Mechanism` the plugins declare,
turns them into the run's :class:`~dpfl_lightning.privacy.guarantees.Guarantee` s (grouped by
granularity and towards whom) for the trainer's client sampling, and composes them:

- per round for guarantees towards model observers (every round is one release about everyone);
- per participation for guarantees towards the server (local and distributed noise, record-level
  DP-SGD, local randomizers): it counts each client's compositions (participations, times local
  steps for DP-SGD) as the round plans say and reports the worst client. In secure mode nobody may
  know the cohorts, so it uses the binomial participation bound of
  :mod:`dpfl_lightning.privacy.planning` instead (its tail is folded into delta).

A mechanism that may stop the run at a round whose shortfall depends on the hidden sample
(``stop_probability``: DiscreteDistributedNoise under Poisson sampling) charges ``(1 + e^eps) s`` to
the delta of the guarantees towards model observers, ``s`` the stop's probability over the rounds
accounted: they report the least ``eps`` with ``eps >= eps_I(delta - tail - (1 + e^eps) s)``
(:func:`~dpfl_lightning.privacy.guarantees.epsilon_with_stop`, the "bad event" argument in
:mod:`dpfl_lightning.privacy.guarantees`); a run where none exists over its planned rounds is refused
at set-up.

Its state is checkpointed, so a resumed run continues the same ledger: no double counting, no
reset. With ``budget`` set, training stops *before* a round after which epsilon would exceed the
budget. The trainer adds a ledger with default settings when a mechanism is declared and none was
given.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.plugins.callback import ORDER_LEDGER, FederatedCallback
from dpfl_lightning.privacy.accountants import PLD_DISCRETIZATION, accountant_used, create_accountant, epsilon
from dpfl_lightning.privacy.guarantees import Guarantee, default_delta, epsilon_with_stop, guarantees, stop_refusal
from dpfl_lightning.privacy.mechanisms import Mechanism
from dpfl_lightning.federated.releases import MetricRelease


#: each neighbouring relation in a privacy line
RELATION_WORDS = {"add_remove": "add/remove neighbours", "replace_one": "replace-one neighbours",
                  "zero_out": "zero-out neighbours (a client's update replaced by zero; its participation and noise "
                              "share kept: whether it took part is not protected)"}


class PrivacyLedger(FederatedCallback):
    """Account the declared mechanisms round by round.

    Args:
        delta: the delta of the reported epsilon. Default: the smallest delta a calibrated plugin
            (``target_epsilon``) was given, else a function of public settings
            (:func:`~dpfl_lightning.privacy.guarantees.default_delta_for`): a power of ten at most
            ``0.1/M`` for client-level DP (``M`` clients), ``1e-6`` for record-level DP (it assumes
            at most 10^5 records per client; ``0.1/N`` rounded down to a power of ten for a larger
            public ``trainer.records_per_client``). A client-level ``delta >= 1/M`` is refused; a
            record-level one is not checked against the clients' record counts (they are the data,
            and a refusal would say where one lies).
        accountant: ``rdp`` (dp_accounting RDP; fast), ``pld`` (dp_accounting PLD; tighter, ~20-60 ms
            per round) or ``prv`` (Opacus PRV; Poisson or no sampling only, slow). Default: the
            accountant a calibrated plugin used, else ``rdp``.
        budget: stop before a round that would take epsilon above this.
        relation: ``None`` (the sampling's natural relation: add/remove, or replace-one for fixed-size
            cohorts) or ``"replace_one"``: account a run without client sampling under replace-one
            neighbours (papers 000 and 002 do; it doubles the update's sensitivity, not that of a
            sum of values in ``[0, B]`` such as FedEXP's squared norms).
    """

    order = ORDER_LEDGER

    def __init__(self, delta: float | None = None, accountant: str | None = None, budget: float | None = None,
                 pld_discretization: float = PLD_DISCRETIZATION, relation: str | None = None) -> None:
        if accountant is not None:
            create_accountant(accountant, "PrivacyLedger.accountant")
        require(delta is None or (isinstance(delta, (int, float)) and 0 < delta < 1), "PrivacyLedger.delta", delta,
                "must be in (0, 1)", "set delta well below 1/N, e.g. 1e-5")
        require(budget is None or (math.isfinite(budget) and budget > 0), "PrivacyLedger.budget", budget,
                "must be a finite epsilon > 0", "set a positive budget or leave it unset")
        require(relation in (None, "replace_one"), "PrivacyLedger.relation", relation, "unknown relation",
                "leave it unset, or use 'replace_one' (runs without client sampling)")
        self.delta = delta
        self.accountant = accountant
        self.budget = budget
        self.relation = relation
        self.pld_discretization = pld_discretization
        self.guarantees: list[Guarantee] = []
        self.rounds = 0
        self.counts: dict[str, np.ndarray] = {}  # per-client guarantees: compositions of each client
        self.max_steps: dict[str, int] = {}  # secure mode: the most compositions a participation made
        self.secure = False
        self.method_notes: dict[str, str] = {}
        self._cache: dict[tuple[int, int, int], float] = {}
        self._saved: dict[str, Any] | None = None
        self._pending = None
        self._profile_of: dict[str, np.ndarray] = {}
        self._busiest: dict[str, list[int]] = {}  # per-client guarantees: the busiest client of each profile
        self._planner = None
        self._sampler = None
        self._random = None
        self._declared: list[Mechanism] = []
        self._redeclare = None

    # ------------------------------------------------------------------ set-up
    def setup(self, *, ctx) -> None:
        self._planner, self._sampler, self._random = ctx.privacy, ctx.sampler, ctx.random
        self._declared, self._redeclare = list(ctx.mechanisms), ctx.redeclare
        self.secure = ctx.secure
        sampling = ctx.sampler.accounted()
        require(self.relation is None or sampling.kind == "full" or sampling.rate >= 1, "PrivacyLedger.relation",
                self.relation, f"replace-one is accounted here for runs without client sampling ({sampling.kind} "
                "sampling is accounted under its own relation)", "leave relation unset")
        self.guarantees = guarantees(ctx.mechanisms, sampling, self.relation, secure=ctx.secure)
        self._cache.clear()
        if not self.guarantees:
            return
        calibrated = ctx.privacy.calibrations
        if self.accountant is None:
            self.accountant = calibrated[0][1] if calibrated else "rdp"
        if self.delta is None:
            self.delta = min(d for d, _ in calibrated) if calibrated else \
                min(ctx.privacy.default_delta(g.granularity) for g in self.guarantees)
        for g in self.guarantees:
            if g.granularity != "client":
                continue  # the clients' record counts are data: refusing by them would release them
            n = ctx.privacy.population(g.granularity)
            if self.delta >= 1.0 / n:
                raise ConfigError("PrivacyLedger.delta", self.delta,
                                  f"{g.granularity}-level DP over {n} {g.granularity}s needs delta well below 1/{n} "
                                  f"(a mechanism that publishes one {g.granularity} in full would meet delta >= 1/{n})",
                                  f"set delta <= {default_delta(n):g}")
        self._check_stops(ctx.rounds)
        M = ctx.data.num_clients
        for g in self.guarantees:
            if not g.per_client:
                continue
            if g.name not in self.counts:
                self.counts[g.name] = np.zeros(M, dtype=np.int64)
                self.max_steps[g.name] = 0
            profile_of = np.zeros(M, dtype=np.int64)  # which profile each client belongs to
            for k, p in enumerate(g.profiles):
                if p.clients is not None:
                    profile_of[list(p.clients)] = k
            self._profile_of[g.name] = profile_of
            self._busiest[g.name] = self._maxima(g, self.counts[g.name])

    def _check_stops(self, rounds: int) -> None:
        """Refuse, at set-up, a guarantee that a stop leaves no epsilon after the planned ``rounds``
        (charged per round, not per client: only the guarantees towards model observers carry one)."""
        for i, g in enumerate(self.guarantees):
            if g.stop_probability > 0 and not math.isfinite(self._eps(i, 0, rounds)):
                raise stop_refusal(g, self.delta, rounds)

    def _maxima(self, g: Guarantee, counts: np.ndarray) -> list[int]:
        """The most compositions of any client of each profile of ``g`` (O(clients): at set-up)."""
        of = self._profile_of[g.name]
        return [int(counts[of == k].max(initial=0)) for k in range(len(g.profiles))]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [MetricRelease("epsilon", "public", "PrivacyLedger", "the main guarantee's epsilon"),
                MetricRelease("epsilon_*", "public", "PrivacyLedger", "the other guarantees' epsilons")]

    @property
    def main(self) -> str | None:
        return self.guarantees[0].name if self.guarantees else None

    @property
    def mechanism_delta(self) -> float:
        """The delta the mechanisms are accounted at (``delta`` less the participation bound's tail)."""
        return self.delta - (self._planner.tail(self.delta) if self.secure else 0.0)

    # ------------------------------------------------------------------ epsilon
    def _eps(self, index: int, profile: int, compositions: int) -> float:
        """Epsilon of one profile after ``compositions``; a guarantee charged for a stop (per round:
        ``compositions`` are its rounds) at the least fixed point of the module docstring, ``inf``
        where there is none."""
        key = (index, profile, compositions)
        if key not in self._cache:
            g = self.guarantees[index]
            release = g.profiles[profile].release

            def at(delta: float) -> float:
                res = epsilon(release, compositions, delta, self.accountant, self.pld_discretization)
                if res.note:
                    self.method_notes[g.name] = res.note
                return res.epsilon

            stop = 0.0 if g.per_client else g.stop_after(compositions)
            eps = epsilon_with_stop(at, self.mechanism_delta, stop)
            self._cache[key] = math.inf if eps is None else eps
        return self._cache[key]

    def _profile_compositions(self, g: Guarantee, k: int, rounds: int, busiest: list[int] | None) -> int:
        p = g.profiles[k]
        if not g.per_client:
            return rounds
        if self.secure:  # nobody knows the cohorts: bound the participations
            steps = max(self.max_steps.get(g.name, 0),
                        self._planner.steps_for(p.record.records) if p.record is not None else 1)
            return self._planner.busiest(p.clients, rounds, self.delta) * steps
        return busiest[k]

    def epsilons(self, rounds: int | None = None, busiest: dict[str, list[int]] | None = None) -> dict[str, float]:
        """Epsilon of every guarantee after ``rounds`` rounds, with ``busiest`` the most compositions
        of a client of each profile of every per-client guarantee (default: what the ledger has
        recorded): per-client guarantees report the worst client."""
        rounds = self.rounds if rounds is None else rounds
        busiest = self._busiest if busiest is None else busiest
        out = {}
        for i, g in enumerate(self.guarantees):
            out[g.name] = max((self._eps(i, k, self._profile_compositions(g, k, rounds, busiest.get(g.name)))
                               for k in range(len(g.profiles))), default=0.0)
        return out

    def epsilon_at(self, delta: float | None = None) -> float:
        """The main guarantee's epsilon after the rounds accounted so far, at ``delta`` (default: the
        ledger's own); ``inf`` without a guarantee."""
        if not self.guarantees:
            return math.inf
        if delta is None or delta == self.delta:
            return self.epsilons()[self.main]
        require(isinstance(delta, (int, float)) and 0 < delta < 1, "delta", delta,
                "must be in (0, 1)", "give a small delta, e.g. 1e-5")
        saved, cache = self.delta, self._cache
        self.delta, self._cache = float(delta), {}
        try:
            return self.epsilons()[self.main]
        finally:
            self.delta, self._cache = saved, cache

    def client_epsilon(self, client: int, name: str | None = None) -> float:
        """Epsilon of one client under a per-client guarantee (its own compositions)."""
        index = next(i for i, g in enumerate(self.guarantees) if g.name == (name or self.main))
        g = self.guarantees[index]
        for k, p in enumerate(g.profiles):
            if p.clients is None or client in p.clients:
                if g.per_client and self.secure:  # no counts are kept: the participation bound
                    return self._eps(index, k, self._profile_compositions(g, k, self.rounds, None))
                n = int(self.counts[g.name][client]) if g.per_client else self.rounds
                return self._eps(index, k, n)
        raise KeyError(client)

    def planned_epsilons(self, rounds: int) -> dict[str, float]:
        """What the ledger will report after ``rounds`` rounds from the start, with the default
        round plan (cohorts are keyed by the seed in a simulation)."""
        return self.epsilons(rounds, self._planned_busiest(rounds))

    def planned_compositions(self, rounds: int) -> dict[str, list[int]]:
        """The compositions of each profile of every guarantee that :meth:`planned_epsilons` accounts
        (a sweep composes or selects whole runs from them)."""
        busiest = self._planned_busiest(rounds)
        return {g.name: [self._profile_compositions(g, k, rounds, busiest.get(g.name)) for k in range(len(g.profiles))]
                for g in self.guarantees}

    def _planned_busiest(self, rounds: int) -> dict[str, list[int]]:
        busiest = {}
        for g in self.guarantees:
            if g.per_client and not self.secure:
                planned = self._planner.counts(rounds)
                steps = [self._planner.steps_for(p.record.records) if p.record is not None else 1 for p in g.profiles]
                busiest[g.name] = [m * s for m, s in zip(self._maxima(g, planned), steps)]
        return busiest

    def accountant_of(self, name: str) -> tuple[str, str | None]:
        """The accountant that gives guarantee ``name``'s epsilon, and why it is not the one asked for
        (``None`` when it is): RDP's bound where the asked accountant cannot account the release
        (PLD and PRV with sampling without replacement, say)."""
        g = next(g for g in self.guarantees if g.name == name)
        used = [accountant_used(p.release, self.accountant) for p in g.profiles]
        return next(((a, why) for a, why in used if why is not None), used[0])

    def describe(self) -> list[str]:
        lines = []
        for g in self.guarantees:
            r = g.release
            sampling = {"poisson": f"Poisson sampling q={r.rate:g}", "none": "no sampling",
                        "without_replacement": f"{r.sample_size} of {r.population} without replacement"}[r.sampling]
            relation = RELATION_WORDS[r.relation]
            z = r.noise_multiplier
            noise = f"noise multiplier {z:.4g}" if z is not None else "non-Gaussian release"
            if r.stream is not None:  # correlated noise: the participation pattern and the stream's noise
                sampling, noise = r.stream.describe()
            counted = ""
            if g.per_client:
                counted = "; participations bounded by a binomial tail (secure mode)" if self.secure else \
                    "; worst client's participations"
            used, why = self.accountant_of(g.name)
            accountant = f"{used} accountant" + (f" ({self.accountant} was asked for; {why})" if why else "")
            stop = ""
            if g.stop_probability > 0:
                rounds = self._planner.rounds if self._planner is not None else self.rounds
                stop = (f"; a stop at a short round (probability <= {g.stop_after(rounds):.3g} over {rounds} rounds, "
                        f"{', '.join(g.stop_sources)}) charged to delta as (1 + e^eps) x it")
            lines.append(f"{g.description}; {sampling}, {relation}, {noise}{counted}{stop}; "
                         f"{accountant}, delta={self.delta:g}")
        return lines

    # ------------------------------------------------------------------ hooks
    def _round_members(self, plan) -> dict[str, list[tuple[np.ndarray, int]]]:
        """For each per-client guarantee and each of its profiles: the members of ``plan``'s cohort
        and the compositions a participation makes under the plan (O(cohort))."""
        cohort = np.asarray(plan.cohort, dtype=np.int64)
        out = {}
        for g in self.guarantees:
            if g.per_client:
                of = self._profile_of[g.name][cohort]
                out[g.name] = [(cohort[of == k], plan.steps_for(p.record.records) if p.record is not None else 1)
                               for k, p in enumerate(g.profiles)]
        return out

    def _busiest_after(self, members: dict[str, list[tuple[np.ndarray, int]]]) -> dict[str, list[int]]:
        out = {}
        for name, parts in members.items():
            counts = self.counts[name]
            out[name] = [max(cur, int(counts[m].max()) + steps) if len(m) else cur
                         for cur, (m, steps) in zip(self._busiest[name], parts)]
        return out

    def _over_budget(self, plan) -> float | None:
        if self.budget is None or not self.guarantees:
            return None
        members = self._round_members(plan)
        saved = dict(self.max_steps)
        for name, parts in members.items():
            self.max_steps[name] = max(self.max_steps[name], max(steps for _, steps in parts))
        eps = self.epsilons(self.rounds + 1, self._busiest_after(members))[self.main]
        self.max_steps = saved
        return eps if eps > self.budget else None

    def before_round(self, *, plan, server) -> None:
        if self._redeclare is not None:  # every plugin has set this round's bounds and noise by now
            check_unchanged(self._declared, self._redeclare(), plan.round_idx)
        eps = self._over_budget(plan)
        if eps is not None:
            server.stop(f"privacy budget: round {plan.round_idx + 1} would reach epsilon {eps:.4g} > budget "
                        f"{self.budget:g} (delta={self.delta:g}); stopped after {self.rounds} rounds")
            return
        self._pending = plan

    def on_fit_start(self, *, ctx) -> None:
        if self._saved is not None and self._saved.get("releases") not in (self._releases(), self._releases(True)):
            raise ConfigError("resume", "privacy mechanism",
                              "the checkpoint's rounds were accounted for other releases (noise, sampling, clients "
                              "or delta) than this run's, so continuing would misreport epsilon",
                              "resume with the privacy settings that wrote the checkpoint")

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        if not self.guarantees:
            return
        self.rounds += 1
        members = self._round_members(self._pending)
        if not self.secure:  # secure mode keeps no per-client counts: they would reveal the cohorts
            self._busiest.update(self._busiest_after(members))
            for name, parts in members.items():
                for m, steps in parts:
                    self.counts[name][m] += steps
        for name, parts in members.items():
            self.max_steps[name] = max(self.max_steps[name], max(steps for _, steps in parts))
        eps = self.epsilons()
        metrics["epsilon"] = eps[self.main]
        for name, value in eps.items():
            if name != self.main:
                metrics[f"epsilon_{name}"] = value
        nxt = server.next_plan() if server.next_plan is not None and self.budget is not None else None
        if nxt is not None:  # decide now, so that this round's row gets the final test
            eps_next = self._over_budget(nxt)
            if eps_next is not None:
                server.stop(f"privacy budget: round {nxt.round_idx + 1} would reach epsilon {eps_next:.4g} > budget "
                            f"{self.budget:g} (delta={self.delta:g}); stopped after {self.rounds} rounds")

    # ------------------------------------------------------------------ state
    def _releases(self, replaced: bool = False) -> list:
        """What is accounted; ``replaced``: a correlated-noise stream restarted on a secure resume as the
        stream it replaced (what the checkpoint's rounds were accounted for)."""
        def was(p):
            s = p.release.stream
            return p if not replaced or s is None or s.replaces is None else \
                dataclasses.replace(p, release=dataclasses.replace(p.release, stream=s.replaces))
        stops = [(g.name, g.stop_probability) for g in self.guarantees if g.stop_probability > 0]
        return [(g.name, tuple(was(p) for p in g.profiles)) for g in self.guarantees] + \
            [("delta", self.delta), ("secure", self.secure)] + ([("stops", tuple(stops))] if stops else [])

    def state_dict(self) -> dict[str, Any]:
        # Secure mode: no per-client counts in checkpoints (two checkpoints would give a round's cohort).
        counts = {} if self.secure else {k: v.copy() for k, v in self.counts.items()}
        return {"rounds": self.rounds, "counts": counts,
                "max_steps": dict(self.max_steps), "delta": self.delta, "accountant": self.accountant,
                "releases": self._releases()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("delta") != self.delta or state.get("accountant") != self.accountant:
            raise ConfigError("resume", {"delta": state.get("delta"), "accountant": state.get("accountant")},
                              f"the checkpoint's ledger used other delta/accountant than this run's "
                              f"({self.delta}, {self.accountant})", "resume with the same PrivacyLedger settings")
        self.rounds = int(state["rounds"])
        self.counts.update({k: np.asarray(v, dtype=np.int64).copy() for k, v in state["counts"].items()})
        self.max_steps = dict(state.get("max_steps", {}))
        for g in self.guarantees:
            if g.per_client and g.name in self._profile_of:
                self._busiest[g.name] = self._maxima(g, self.counts[g.name])
        self._saved = state
        self._cache.clear()


def _weaker(before: Mechanism, now: Mechanism) -> str | None:
    """How ``now`` protects less than ``before`` (``None``: it does not)."""
    if (before.source, before.covers, before.placement, before.granularity) != \
            (now.source, now.covers, now.placement, now.granularity):
        return f"{before.source} now declares {now.description} on {list(now.covers)}"
    if before.is_gaussian and now.is_gaussian:
        z0, z1 = before.replace_one.noise_multiplier, now.replace_one.noise_multiplier
        return None if z1 >= z0 * (1 - 1e-9) else f"{before.source}'s noise fell from {before.description} to " \
            f"{now.description}"
    return None if (before.replace_one, before.add_remove) == (now.replace_one, now.add_remove) else \
        f"{before.source} changed from {before.description} to {now.description}"


def check_unchanged(declared: list[Mechanism], now: list[Mechanism], round_idx: int) -> None:
    """Refuse to run round ``round_idx`` when a mechanism in force is weaker than what the ledger
    accounts (a plugin whose noise did not follow a bound another plugin moved, say): every
    mechanism's multiplier must come from the bound in force in the round it is used."""
    problems = [_weaker(b, n) for b, n in zip(declared, now)]
    if len(declared) != len(now):
        problems.append(f"{len(declared)} mechanisms were accounted and {len(now)} are declared now")
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError("privacy mechanisms", f"round {round_idx + 1}", "; ".join(problems) + ": the ledger "
                          "accounts the mechanisms declared at set-up, so epsilon would be understated",
                          "make every noise scale with the bound in force (noise_multiplier=, not a fixed std), or "
                          "drop the plugin that moves the bound")
