"""SequentialExecutor: one client after another through the wrapped module's own hooks."""

from __future__ import annotations

from typing import Iterator

import torch

from dpfl_lightning.executor.base import Executor, RoundWork


class SequentialExecutor(Executor):
    """Every client runs the module's ``training_step``, optimizers, schedulers and per-batch hooks
    in Lightning's order (see :mod:`dpfl_lightning.module`); any module, any plugin."""

    name = "sequential"

    def train(self, work: RoundWork) -> Iterator:
        module, plan = work.module, work.plan
        for k, client in enumerate(work.clients):
            if k % 32 == 0:
                work.random.prepare_torch(plan.round_idx, work.clients[k : k + 32])
            module.load_global()
            ctx = work.open_client(client)
            work.random.seed_torch(plan.round_idx, client, module.device)
            per_round, per_epoch = work.local_batches(client)
            run = module.fit_client(work.batches(client), plan.round_idx, plan.lr_factor, work.step_hook(ctx),
                                    work.optimizer_wrapper(ctx), batches_per_round=per_round,
                                    batches_per_epoch=per_epoch)
            torch.sub(module.working, module.global_params, out=work.out(k))
            yield k, ctx, run
