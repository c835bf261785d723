"""ServerOptimizer: how the server applies the mean client update to the global model.

The mean update ``Delta`` (local minus global model, averaged) is treated as the negative of a
pseudo-gradient (Reddi et al., "Adaptive Federated Optimization"): the server runs a torch optimizer
on ``g = -Delta``. ``sgd`` with ``lr=1`` is plain FedAvg averaging, ``x + Delta`` (paper 000 Alg. 1
line 11); ``lr=beta`` gives paper 003's global learning rate (Alg. 1 line 14), and ``momentum``
its server momentum (App. H uses 0.8).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpfl_lightning.errors import require
from dpfl_lightning.plugins.callback import ORDER_SERVER_OPTIMIZER, FederatedCallback

OPTIMIZERS = ("sgd", "adam", "adagrad")
_BLOCK = 1 << 20


class ServerOptimizer(FederatedCallback):
    """Apply the round's mean update with SGD (with momentum), Adam or Adagrad.

    Args:
        optimizer: ``"sgd"``, ``"adam"`` or ``"adagrad"``.
        lr: the server learning rate ``beta``.
        momentum / nesterov: SGD momentum.
        betas / eps: Adam's; ``eps`` is also Adagrad's (FedOpt uses ~1e-3).
        weight_decay: applied by the torch optimizer.
        lr_decay: the learning rate of round ``k`` is ``lr * lr_decay**k``.
    """

    order = ORDER_SERVER_OPTIMIZER

    def __init__(self, optimizer: str = "sgd", lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 lr_decay: float = 1.0) -> None:
        require(optimizer in OPTIMIZERS, "ServerOptimizer.optimizer", optimizer, "unknown server optimizer",
                f"use one of {', '.join(OPTIMIZERS)}")
        require(math.isfinite(lr) and lr > 0, "ServerOptimizer.lr", lr, "must be > 0", "set a positive server learning rate")
        require(0 <= momentum < 1, "ServerOptimizer.momentum", momentum, "must be in [0, 1)", "set momentum in [0, 1)")
        require(0 < lr_decay <= 1, "ServerOptimizer.lr_decay", lr_decay, "must be in (0, 1]", "set lr_decay in (0, 1]")
        self.optimizer = optimizer
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.betas = tuple(betas)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.lr_decay = float(lr_decay)
        self._opt: torch.optim.Optimizer | None = None
        self._pending_state: dict | None = None

    def setup(self, *, ctx) -> None:
        if ctx.module is None:
            return
        # The Parameter shares storage with the global model: stepping it updates the global model.
        self._param = nn.Parameter(ctx.module.global_params, requires_grad=True)
        if self.optimizer == "sgd":
            self._opt = torch.optim.SGD([self._param], lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
                                        weight_decay=self.weight_decay)
        elif self.optimizer == "adam":
            self._opt = torch.optim.Adam([self._param], lr=self.lr, betas=self.betas, eps=self.eps,
                                         weight_decay=self.weight_decay)
        else:
            self._opt = torch.optim.Adagrad([self._param], lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if self._pending_state is not None:
            self._opt.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_fit_start(self, *, ctx) -> None:
        from dpfl_lightning.plugins.correlated_noise import check_server_optimizer

        check_server_optimizer(self.optimizer, self.momentum, self.nesterov, ctx.mechanisms)

    def step(self, *, params: torch.Tensor, server) -> None:
        """Move ``params`` (the global model) by the round's mean update ``server.update``: the one
        place where the global model changes (the trainer's server phase calls it after the other
        plugins' ``on_server_update``)."""
        assert self._opt is not None
        if params.data_ptr() != self._param.data_ptr():  # the optimizer's state belongs to this model
            raise RuntimeError("ServerOptimizer.step: params are not the global model it was set up with")
        for group in self._opt.param_groups:
            group["lr"] = self.lr * self.lr_decay**server.round_idx
        if self.optimizer == "sgd" and self.momentum == 0 and self.weight_decay == 0:
            # plain SGD, x <- x + lr * update, in one pass (the update stays float64 until the add)
            lr, param, update = self._opt.param_groups[0]["lr"], self._param.detach(), server.update
            for i in range(0, update.numel(), _BLOCK):  # blocks: a mixed-dtype add of a large model is slow
                param[i : i + _BLOCK].add_(update[i : i + _BLOCK].to(param.dtype), alpha=lr)
            return
        mask = server.plan.trainable
        kept = None if mask is None else self._param.detach()[~mask].clone()
        self._param.grad = server.update.to(self._param.dtype).neg_()
        self._opt.step()
        self._param.grad = None
        if kept is not None:  # frozen parameters stay as they are (momentum, Adam and weight decay move them)
            self._param.detach()[~mask] = kept

    def state_dict(self) -> dict:
        return {"optimizer": self._opt.state_dict()} if self._opt is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if self._opt is None:
            self._pending_state = state["optimizer"]
        else:
            self._opt.load_state_dict(state["optimizer"])
