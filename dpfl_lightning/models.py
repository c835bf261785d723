"""Ordinary LightningModules for the built-in experiments (nothing federated in them).

They are what a user would write: ``training_step`` logs ``train_loss``, ``validation_step`` /
``test_step`` log loss and accuracy through torchmetrics, ``configure_optimizers`` returns SGD.
:class:`SupervisedModule` is what :class:`~dpfl_lightning.FederatedLightningModule` builds around
a plain ``nn.Module`` and a loss.
"""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from dpfl_lightning.problems import linear_regression_target, quadratic_problem


def _optimizer(params, name: str, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer={name!r}: use 'sgd' or 'adam'")


class SupervisedModule(L.LightningModule):
    """A LightningModule around an ``nn.Module`` and a loss function."""

    def __init__(self, net: nn.Module, loss_fn: Callable[..., torch.Tensor], optimizer: str = "sgd", lr: float = 0.1,
                 momentum: float = 0.0, weight_decay: float = 0.0, task: str = "classification") -> None:
        super().__init__()
        self.net = net
        self.loss_fn = loss_fn
        self.optimizer_name, self.lr, self.momentum, self.weight_decay = optimizer, lr, momentum, weight_decay
        self.task = task

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch, stage: str) -> None:
        x, y = batch
        out = self(x)
        self.log(f"{stage}_loss", self.loss_fn(out, y))
        if self.task == "classification":
            self.log(f"{stage}_acc", (out.argmax(-1) == y).float().mean())

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return _optimizer(self.parameters(), self.optimizer_name, self.lr, self.momentum, self.weight_decay)


class MLPClassifier(L.LightningModule):
    """``in -> hidden (ReLU) ... -> classes`` with cross-entropy; ``hidden=[]`` is softmax regression.

    Accuracy is a torchmetrics ``MulticlassAccuracy`` logged as a Metric object, as Lightning users do.
    """

    def __init__(self, in_features: int = 60, hidden: list[int] | None = None, num_classes: int = 10, lr: float = 0.1,
                 momentum: float = 0.0, weight_decay: float = 0.0, optimizer: str = "sgd") -> None:
        super().__init__()
        self.save_hyperparameters()
        sizes = [in_features, *([200] if hidden is None else hidden), num_classes]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("test_loss", F.cross_entropy(logits, y))
        self.test_acc(logits, y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        hp = self.hparams
        return _optimizer(self.parameters(), hp.optimizer, hp.lr, hp.momentum, hp.weight_decay)


class LinearRegression(L.LightningModule):
    """``y = x^T w`` with the squared error, for paper 002's synthetic linear regression
    (:class:`~dpfl_lightning.data.SyntheticLinearRegression`); ``w`` starts at 0. Evaluation logs the
    mean squared error and, given the data's seed as ``target_seed``, the distance ``||w - w*||``."""

    def __init__(self, dim: int = 100, lr: float = 0.01, target_seed: int | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.w = nn.Parameter(torch.zeros(dim))
        # not a buffer: neither trained nor federated
        self.w_star = None if target_seed is None else linear_regression_target(dim, target_seed)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((x @ self.w - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", ((x @ self.w - y) ** 2).mean())
        if self.w_star is not None:
            self.log("distance_to_optimum", torch.linalg.vector_norm(self.w - self.w_star.to(self.w.device)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class QuadraticModel(L.LightningModule):
    """The parameter ``w`` of paper 003 App. F's quadratic problem (see
    :func:`~dpfl_lightning.data.quadratic_problem`), trained on :class:`QuadraticClients` batches.

    ``init="I1"`` starts at ``w* + z`` and ``"I2"`` at ``w* + z/5``, ``z ~ U(0, 1)^d`` (seeded by
    ``init_seed``). Evaluation logs ``suboptimality = f(w) - f(w*)``.
    """

    def __init__(self, num_clients: int = 100, dim: int = 200, rank: int = 20, seed: int = 0, init: str = "I1",
                 init_seed: int = 0, lr: float = 0.001) -> None:
        super().__init__()
        if init not in ("I1", "I2"):
            raise ValueError(f"init={init!r}: use 'I1' or 'I2'")
        self.save_hyperparameters()
        p = quadratic_problem(num_clients, dim, rank, seed)
        z = torch.rand(dim, generator=torch.Generator().manual_seed(init_seed))
        self.w = nn.Parameter(p.w_star + (z if init == "I1" else z / 5))
        self.f_star = p.f_star

    def losses(self, A: torch.Tensor, w_star_i: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``f_i(w)`` for each record of the batch, computed in ``dtype``."""
        r = torch.einsum("bdk,bd->bk", A.to(dtype), self.w.to(dtype).unsqueeze(0) - w_star_i.to(dtype))
        return 0.5 * (r**2).sum(-1)

    def training_step(self, batch, batch_idx):
        loss = self.losses(*batch).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("suboptimality", self.losses(*batch, dtype=torch.float64).mean() - self.f_star)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
