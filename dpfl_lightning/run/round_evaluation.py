"""Evaluation during a fit: the global model (or what plugins choose to evaluate, e.g. an average
of iterates) on the validation set every ``eval_every`` rounds, per client when asked, and on the
test set after the last round. Training always continues from the global model."""

from __future__ import annotations

from typing import Any, Callable

import torch

from dpfl_lightning.comm import Communicator
from dpfl_lightning.module.logged_metrics import merge
from dpfl_lightning.federated.releases import MetricKinds
from dpfl_lightning.run.hooks import HookTable


class RoundEvaluation:
    def __init__(self, module: Any, data: Any, comm: Communicator, hooks: HookTable, per_client: bool,
                 owner: Callable[[int], int]) -> None:
        self.module, self.data, self.comm, self.hooks = module, data, comm, hooks
        self.per_client = per_client
        self.owner = owner

    def validate(self, kinds: MetricKinds) -> dict[str, float]:
        """The validation metrics of the model to evaluate (kind ``evaluation``; per client:
        ``unaccounted``)."""
        self.load_evaluation_params()
        try:
            return self._validate(kinds)
        finally:
            self.module.load_global()

    def _validate(self, kinds: MetricKinds) -> dict[str, float]:
        out: dict[str, float] = {}
        module, data, comm = self.module, self.data, self.comm
        if not module.has_validation_step:
            return out
        if data.has_val_set:  # the DataModule's val_dataloader, else the test set
            res = merge([module.evaluate(data.val_batches(), "validation")]) if comm.rank == 0 else None
            out.update(kinds.tag(comm.broadcast_object(res, root=0) if comm.size > 1 else res, "evaluation"))
        if self.per_client:
            out.update(kinds.tag(self._per_client(), "unaccounted"))
        return out

    def _per_client(self) -> dict[str, float]:
        data, comm, module = self.data, self.comm, self.module
        mine = [c for c in range(data.num_clients) if self.owner(c) == comm.rank]
        local = {c: merge([module.evaluate(data.client_eval_batches(c), "validation")]) for c in mine}
        per_client: dict[int, dict[str, float]] = {}
        for part in comm.allgather_object(local):
            per_client.update(part)
        out: dict[str, float] = {}
        for name in sorted({k for v in per_client.values() for k in v}):
            vals = torch.tensor([v[name] for v in per_client.values() if name in v], dtype=torch.float64)
            out[f"client_{name}_mean"] = float(vals.mean())
            out[f"client_{name}_p10"] = float(torch.quantile(vals, 0.1))
        return out

    def test(self) -> dict[str, float]:
        """The test set's metrics of the model to evaluate (after the last round)."""
        module, data, comm = self.module, self.data, self.comm
        module.load_global()
        if not (module.has_test_step and data.has_test_set):
            return {}
        self.load_evaluation_params()
        res = merge([module.evaluate(data.test_batches(), "test")]) if comm.rank == 0 else None
        module.load_global()
        return comm.broadcast_object(res, root=0) if comm.size > 1 else res

    def load_evaluation_params(self) -> None:
        """Let plugins choose the parameters evaluation sees (e.g. the average of the last iterates)."""
        params = self.module.global_params
        for p in self.hooks["evaluation_params"]:
            params = p.evaluation_params(params=params)
        if params is not self.module.global_params:
            self.module.working.copy_(params)
