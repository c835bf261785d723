"""PrivacyLedger: epsilon after every round, in the logs and checkpoints, and an optional budget.

The ledger collects the :class:`~dpfl_lightning.privacy.events.Mechanism` every plugin declares,
turns each into a :class:`~dpfl_lightning.privacy.events.Guarantee` for the trainer's client
sampler, and composes it:

- per round for central / distributed noise (every round is one release about every client);
- per participation for local noise and record-level DP-SGD: it counts how often each client took
  part and reports the worst client (all clients run the same mechanism, so the most frequent
  participant has the largest epsilon).

Its state (rounds and participation counts) is checkpointed, so a resumed run continues the same
ledger: no double counting, no reset. With ``budget`` set, training stops *before* a round after
which epsilon would exceed the budget. The trainer adds a ledger with default settings when a
plugin declares a mechanism and none was given.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.plugins.base import FederatedCallback
from dpfl_lightning.privacy.accountants import ACCOUNTANTS, PLD_DISCRETIZATION, epsilon
from dpfl_lightning.privacy.events import Guarantee, default_delta, guarantees


class PrivacyLedger(FederatedCallback):
    """Account the declared mechanisms round by round.

    Args:
        delta: the delta of the reported epsilon. Default: a power of ten at most ``0.1/N``
            (``N``: clients for client-level, the smallest client's records for record-level DP),
            or the delta a calibrated ``GaussianNoise`` was given. ``delta >= 1/N`` is refused.
        accountant: ``rdp`` (dp_accounting RDP; fast), ``pld`` (dp_accounting PLD; tighter, ~20-60 ms
            per round) or ``prv`` (Opacus PRV; Poisson or no sampling only, slow). Default: the
            accountant a calibrated plugin (``target_epsilon``) used, else ``rdp``.
        budget: stop before a round that would take epsilon above this.
    """

    order = 950

    def __init__(self, delta: float | None = None, accountant: str | None = None, budget: float | None = None,
                 pld_discretization: float = PLD_DISCRETIZATION) -> None:
        require(accountant is None or accountant in ACCOUNTANTS, "PrivacyLedger.accountant", accountant,
                "unknown accountant", f"use one of {', '.join(ACCOUNTANTS)}")
        require(delta is None or (isinstance(delta, (int, float)) and 0 < delta < 1), "PrivacyLedger.delta", delta,
                "must be in (0, 1)", "set delta well below 1/N, e.g. 1e-5")
        require(budget is None or (math.isfinite(budget) and budget > 0), "PrivacyLedger.budget", budget,
                "must be a finite epsilon > 0", "set a positive budget or leave it unset")
        self.delta = delta
        self.accountant = accountant
        self.budget = budget
        self.pld_discretization = pld_discretization
        self.guarantees: list[Guarantee] = []
        self.rounds = 0
        self.counts: np.ndarray | None = None
        self._cohort: list[int] = []
        self._cache: dict[tuple[int, int, int], float] = {}
        self.method_notes: dict[str, str] = {}
        self._saved_releases: list | None = None

    # ------------------------------------------------------------------ set-up
    def setup(self, *, trainer, module) -> None:
        self._build(trainer)

    def _build(self, trainer) -> None:
        """Collect the declared mechanisms into guarantees; settle delta and the accountant."""
        mechanisms = [m for p in trainer.plugins if p is not self
                      for m in [p.privacy_mechanism(trainer=trainer)] if m is not None]
        self.guarantees = [g for m in mechanisms for g in guarantees(m, trainer.sampler)]
        self._cache.clear()
        if not self.guarantees:
            return
        data = trainer.data
        calibrated = [p for p in trainer.plugins if p is not self and getattr(p, "target_epsilon", None) is not None]
        if self.accountant is None:
            self.accountant = calibrated[0].accountant if calibrated else "rdp"
        if self.delta is None:
            declared = {getattr(p, "delta", None) for p in calibrated} - {None}
            self.delta = min(declared) if declared else min(default_delta(self._population(g, data)) for g in self.guarantees)
        for g in self.guarantees:
            n = self._population(g, data)
            if self.delta >= 1.0 / n:
                raise ConfigError("PrivacyLedger.delta", self.delta,
                                  f"{g.granularity}-level DP over {n} {g.granularity}s needs delta well below 1/{n} "
                                  f"(a mechanism that publishes one {g.granularity} in full would meet delta >= 1/{n})",
                                  f"set delta <= {default_delta(n):g}")
        if self.counts is None or len(self.counts) != data.num_clients:
            self.counts = np.zeros(data.num_clients, dtype=np.int64)

    def _releases(self) -> list:
        return [(g.name, g.profiles) for g in self.guarantees]

    @staticmethod
    def _population(g: Guarantee, data) -> int:
        if g.granularity == "client":
            return data.num_clients
        return min(data.client_num_samples(c) for c in range(data.num_clients))

    # ------------------------------------------------------------------ epsilon
    def _eps(self, index: int, profile: int, compositions: int) -> float:
        key = (index, profile, compositions)
        if key not in self._cache:
            g = self.guarantees[index]
            res = epsilon(g.profiles[profile].release, compositions, self.delta, self.accountant, self.pld_discretization)
            if res.note:
                self.method_notes[g.name] = res.note
            self._cache[key] = res.epsilon
        return self._cache[key]

    def _guarantee_eps(self, index: int, rounds: int, counts: np.ndarray) -> float:
        g = self.guarantees[index]
        if not g.per_client:
            return self._eps(index, 0, rounds * g.steps_per_round)
        worst = 0.0  # the busiest client of each profile is its worst case
        for k, p in enumerate(g.profiles):
            n = int(counts.max() if p.clients is None else counts[list(p.clients)].max())
            worst = max(worst, self._eps(index, k, n * p.steps_per_round))
        return worst

    def epsilons(self, rounds: int | None = None, counts: np.ndarray | None = None) -> dict[str, float]:
        """Epsilon of every guarantee after ``rounds`` rounds with participation ``counts``
        (default: what the ledger has recorded); per-client guarantees report the worst client."""
        rounds = self.rounds if rounds is None else rounds
        counts = self.counts if counts is None else counts
        return {g.name: self._guarantee_eps(i, rounds, counts) for i, g in enumerate(self.guarantees)}

    def client_epsilon(self, client: int, name: str | None = None) -> float:
        """Epsilon of one client under a per-client guarantee (its own participations)."""
        index = next(i for i, g in enumerate(self.guarantees) if g.name == (name or self.main))
        g = self.guarantees[index]
        for k, p in enumerate(g.profiles):
            if p.clients is None or client in p.clients:
                n = int(self.counts[client]) if g.per_client else self.rounds
                return self._eps(index, k, n * p.steps_per_round)
        raise KeyError(client)

    def planned_epsilons(self, trainer, rounds: int) -> dict[str, float]:
        """What the ledger will report after ``rounds`` rounds from the start (cohorts are keyed
        by the seed, so participation is known in advance)."""
        return self.epsilons(rounds, trainer.sampler.participation_counts(trainer.seed, rounds))

    @property
    def main(self) -> str | None:
        return self.guarantees[0].name if self.guarantees else None

    def describe(self) -> list[str]:
        lines = []
        for g in self.guarantees:
            r = g.release
            sampling = {"poisson": f"Poisson sampling q={r.rate:g}", "none": "no sampling",
                        "without_replacement": f"{r.sample_size} of {r.population} without replacement"}[r.sampling]
            relation = {"add_remove": "add/remove", "replace_one": "replace-one"}[r.relation]
            lines.append(f"{g.description}; {sampling}, {relation} neighbours, "
                         f"noise multiplier {r.noise_multiplier:.4g}; {self.accountant} accountant, delta={self.delta:g}")
        return lines

    # ------------------------------------------------------------------ hooks
    def _check_budget(self, trainer, round_idx: int, cohort: list[int]) -> None:
        """Stop if round ``round_idx`` (with ``cohort``) would take epsilon above the budget."""
        if self.budget is None or not self.guarantees:
            return
        counts = self.counts.copy()
        counts[cohort] += 1
        eps = self.epsilons(self.rounds + 1, counts)[self.main]
        if eps > self.budget:
            trainer.stop(f"privacy budget: round {round_idx + 1} would reach epsilon {eps:.4g} > budget "
                         f"{self.budget:g} (delta={self.delta:g}); stopped after {self.rounds} rounds")

    def before_round(self, *, trainer, round_idx: int, cohort: list[int]) -> None:
        self._check_budget(trainer, round_idx, cohort)

    def on_fit_start(self, *, trainer) -> None:
        # After a resume the plugins' restored state (e.g. a calibrated noise multiplier) is in
        # force: rebuild, and refuse to continue a ledger whose past rounds used other releases.
        self._build(trainer)
        if self._saved_releases is not None and self._saved_releases != self._releases():
            raise ConfigError("resume", "privacy mechanism",
                              "the checkpoint's rounds were accounted for other releases (noise, sampling, clients "
                              "or delta) than this run's, so continuing would misreport epsilon",
                              "resume with the privacy settings that wrote the checkpoint")
        if trainer.is_global_zero and self.guarantees and trainer.enable_summary:
            from rich.console import Console

            console = Console(stderr=True, soft_wrap=True)
            for line in self.describe():
                console.print(f"[bold]privacy[/bold]: {line}")

    def on_round_start(self, *, trainer, round_idx: int, cohort: list[int]) -> None:
        self._cohort = cohort

    def on_round_end(self, *, trainer, round_idx: int, metrics: dict[str, float]) -> None:
        if not self.guarantees:
            return
        self.rounds += 1
        self.counts[self._cohort] += 1
        eps = self.epsilons()
        metrics["epsilon"] = eps[self.main]
        for name, value in eps.items():
            if name != self.main:
                metrics[f"epsilon_{name}"] = value
        if round_idx + 1 < trainer.rounds:  # decide now, so this round's row gets the final test
            self._check_budget(trainer, round_idx + 1, trainer.sampler.sample(trainer.seed, round_idx + 1))

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "counts": None if self.counts is None else self.counts.copy(),
                "delta": self.delta, "accountant": self.accountant, "releases": self._releases()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])
        self.counts = None if state["counts"] is None else np.asarray(state["counts"], dtype=np.int64).copy()
        if state.get("delta") != self.delta or state.get("accountant") != self.accountant:
            raise ConfigError("resume", {"delta": state.get("delta"), "accountant": state.get("accountant")},
                              f"the checkpoint's ledger used other delta/accountant than this run's "
                              f"({self.delta}, {self.accountant})", "resume with the same PrivacyLedger settings")
        self._saved_releases = state.get("releases")
        self._cache.clear()
