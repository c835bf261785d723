"""Executors: how a rank trains its share of a round's cohort.

An executor fills one row of ``rows`` per client with that client's raw update (local model minus
global model). Plugins never see the executor: the trainer applies ``on_client_end`` to the rows
afterwards, so a vectorised executor (e.g. ``torch.func.vmap`` over stacked client parameters)
can replace :class:`SequentialExecutor` without touching them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dpfl_lightning import rng
from dpfl_lightning.module import ClientRun

if TYPE_CHECKING:
    from dpfl_lightning.trainer import FederatedTrainer


class Executor:
    """Train ``clients`` from the global model; write update ``k`` into ``rows[k]``."""

    def train(self, trainer: FederatedTrainer, clients: list[int], round_idx: int, rows: torch.Tensor) -> list[ClientRun]:
        raise NotImplementedError


class SequentialExecutor(Executor):
    """One client after another through the wrapped module's own ``training_step``."""

    def train(self, trainer: FederatedTrainer, clients: list[int], round_idx: int, rows: torch.Tensor) -> list[ClientRun]:
        module, data = trainer.module, trainer.data
        lr_factor = trainer.client_lr_decay**round_idx
        runs = []
        for k, client in enumerate(clients):
            module.load_global()
            trainer.call_hook("on_client_start", client=client, round_idx=round_idx)
            rng.seed_global(trainer.seed, round_idx, client, module.device)
            g = rng.generator(trainer.seed, round_idx, client, rng.DATA)
            batches = data.client_batches(client, trainer.batch_size, epochs=trainer.local_epochs,
                                          steps=trainer.local_steps, generator=g)
            runs.append(module.fit_client(batches, round_idx, lr_factor, trainer.step_hook(client)))
            torch.sub(module.working, module.global_params, out=rows[k])
        return runs
