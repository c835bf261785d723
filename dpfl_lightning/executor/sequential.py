"""SequentialExecutor: one client after another through the wrapped module's own hooks."""

from __future__ import annotations

from typing import Iterator

import torch

from dpfl_lightning.executor.interface import Executor, RoundWork, TrainedClient


class SequentialExecutor(Executor):
    """Every client runs the module's ``training_step``, optimizers, schedulers and per-batch hooks
    in Lightning's order (see :mod:`dpfl_lightning.module`); any module, any plugin."""

    name = "sequential"

    def train(self, work: RoundWork) -> Iterator[TrainedClient]:
        module, plan, hooks = work.module, work.plan, work.hooks
        for k, client in enumerate(work.clients):
            if k % 32 == 0:
                work.random.prepare_torch(plan.round_idx, work.clients[k : k + 32])
            module.load_global()
            ctx = hooks.open(client)
            work.random.seed_torch(plan.round_idx, client, module.device)
            per_round, per_epoch = work.local_batches(client)
            run = module.fit_client(work.batches(client), plan.round_idx, plan.lr_factor, hooks.step_hook(ctx),
                                    hooks.optimizer_wrapper(ctx), batches_per_round=per_round,
                                    batches_per_epoch=per_epoch)
            rows = work.rows(1)
            update = rows[0] if rows is not None else torch.empty_like(module.global_params)
            torch.sub(module.working, module.global_params, out=update)
            yield TrainedClient(k, ctx, run, update)
