"""A round's metric row: every value tagged with its release kind where it is produced, and one
release filter (:class:`~dpfl_lightning.federated.releases.ReleaseList`) between the row and every logger,
callback and schedule."""

from __future__ import annotations

from typing import Any

from dpfl_lightning.comm import Communicator
from dpfl_lightning.plugins.contexts import ServerContext
from dpfl_lightning.module.logged_metrics import merge
from dpfl_lightning.federated.payload import Aggregate
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.federated.releases import MetricKinds, ReleaseList, sources_of
from dpfl_lightning.run.hooks import HookTable


class RoundRow:
    def __init__(self, releases: ReleaseList, cohort_size_is_public: bool) -> None:
        self.releases = releases
        self.kinds = MetricKinds()
        self.cohort_size_is_public = cohort_size_is_public

    def training(self, plan: RoundPlan, agg: Aggregate, train_logs: Any, comm: Communicator) -> dict[str, float]:
        """What the round's training gives: its number, the cohort size, skipped clients, and what
        the module logged during local training (un-noised: gathered only where released)."""
        kinds = self.kinds
        metrics = kinds.tag({"round": plan.round_idx + 1}, "public")
        metrics.update(kinds.tag({"clients": float(len(plan.cohort))},
                                 "public" if self.cohort_size_is_public else "unaccounted"))
        if "skipped" in agg:
            metrics.update(kinds.tag({"skipped_clients": float(agg.skipped)}, "unaccounted"))
        if train_logs is not None:
            metrics.update(kinds.tag(merge(comm.allgather_object(train_logs)), "unaccounted"))
        return metrics

    def plugins_round_end(self, hooks: HookTable, server: ServerContext, metrics: dict[str, float]) -> None:
        """The plugins' ``on_round_end`` (the ledger's epsilon, noise statistics), each key tagged
        with the kind its plugin declared."""
        for p in hooks["on_round_end"]:
            added: dict[str, float] = {}
            p.on_round_end(server=server, metrics=added)
            for key in added:
                self.kinds[key] = self.releases.kind(key, sources_of(p))
            metrics.update(added)

    def released(self, metrics: dict[str, float], kind: str) -> dict[str, float]:
        """``metrics`` of ``kind``, through the release filter."""
        return self.releases.filter(self.kinds.tag(metrics, kind), self.kinds)
