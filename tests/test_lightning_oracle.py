"""The equivalence oracle: one client holding all the data, full participation, FedAvg with server
rate 1 and no DP is one lightning.Trainer run. Both runs get the same batches (the federated run's,
replayed to lightning.Trainer in the same order) and are compared at every optimizer step: the
weights, the learning rate of every param group, ``global_step``, and the sequence of hooks.

The one documented difference (dpfl_lightning.lightning.semantics): a client's ``on_train_epoch_end``
ends its local training, before the round's evaluation of the aggregated model; lightning.Trainer
validates first. The hook sequences are compared with that one hook placed as the federated run
places it. Weights are compared to float rounding: the server adds the mean update to the global
model, ``g + (w - g)``, which need not be ``w`` in the last bit."""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpfl_lightning import FederatedDataModule, FederatedTrainer

ROUNDS = 3
BATCH = 8
SAMPLES = 32  # one client, 4 batches a round

# hooks whose sequence is compared (left out: configure_optimizers, which a client calls every round
# to build its optimizers; the batch-transfer hooks, which evaluation calls too; and
# on_validation_model_eval / _train, which lightning.Trainer calls only when they are overridden)
HOOKS = ("setup", "configure_model", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start",
         "on_before_zero_grad", "optimizer_zero_grad", "on_before_backward", "on_after_backward",
         "on_before_optimizer_step", "on_train_batch_end", "on_train_epoch_end", "on_validation_model_zero_grad",
         "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
         "on_validation_epoch_end", "on_validation_end", "lr_scheduler_step", "on_train_end", "on_fit_end", "teardown")


def _recording(name):
    def method(self, *args, **kwargs):
        self.hooks.append(name)
        if name == "on_train_batch_start":
            batch, batch_idx = args[:2]
            self.batches.setdefault(self.current_epoch, []).append(tuple(t.clone() for t in batch))
        if name == "on_validation_batch_start":
            self.val_batches.append(tuple(t.clone() for t in args[0]))
        if name == "on_before_optimizer_step":
            lrs = [g["lr"] for opt in self._all_optimizers() for g in opt.param_groups]
            self.steps.append((self.current_epoch, self.global_step, lrs))
        if name == "on_train_batch_end":
            self.weights.append(torch.cat([p.detach().flatten() for p in self.parameters()]).clone())
        return getattr(super(Probe, self), name)(*args, **kwargs)

    method.__name__ = name
    return method


class Probe(L.LightningModule):
    """Records the hooks, the batches, and at every optimizer step the round, ``global_step`` and the
    learning rates (``on_before_optimizer_step``), and the weights after every batch."""

    def __init__(self):
        super().__init__()
        self.hooks: list[str] = []
        self.batches: dict[int, list[tuple[torch.Tensor, ...]]] = {}
        self.val_batches: list[tuple[torch.Tensor, ...]] = []
        self.steps: list[tuple[int, int, list[float]]] = []
        self.weights: list[torch.Tensor] = []

    def _all_optimizers(self):
        opts = self.optimizers(use_pl_optimizer=False)
        return opts if isinstance(opts, list) else [opts]

    for _name in HOOKS:
        locals()[_name] = _recording(_name)
    del _name


class Replay(Dataset):
    """The federated run's batches of each round, served to lightning.Trainer in the same order
    (``batch_size=None``: each item is a whole batch)."""

    def __init__(self, by_epoch, trainer_of=None):
        self.by_epoch, self.trainer_of = by_epoch, trainer_of

    def __len__(self):
        return max(len(b) for b in self.by_epoch.values()) if isinstance(self.by_epoch, dict) else len(self.by_epoch)

    def __getitem__(self, i):
        if not isinstance(self.by_epoch, dict):
            return self.by_epoch[i]
        return self.by_epoch[self.trainer_of().current_epoch][i]


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES + 16, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return x[:SAMPLES], y[:SAMPLES], x[SAMPLES:], y[SAMPLES:]


def run_both(make, tmp_path, rounds=ROUNDS, **trainer_kw):
    """Fit ``make()`` federated (one client, all the data, FedAvg, no DP) and with lightning.Trainer
    on the same batches; return both modules."""
    x, y, xv, yv = _data()
    fed = make()
    data = FederatedDataModule.from_tensors(x, y, xv, yv, num_clients=1)
    FederatedTrainer(rounds=rounds, batch_size=BATCH, seed=0, num_threads=1, enable_progress_bar=False,
                     enable_summary=False, log_dir=str(tmp_path / "fed"), **trainer_kw).fit(fed, data)
    ref = make()
    trainer = L.Trainer(max_epochs=rounds, deterministic=True, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        accelerator="cpu", devices=1, default_root_dir=str(tmp_path / "lightning"))
    train = DataLoader(Replay(fed.batches, lambda: trainer), batch_size=None)
    val = DataLoader(Replay(fed.val_batches[: len(fed.val_batches) // max(1, rounds)]), batch_size=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (num_workers, the one-process loader, eval-mode modules)
        trainer.fit(ref, train, val if fed.val_batches else None)
    return fed, ref


def _lightning_order(hooks):
    """Lightning's sequence with each ``on_train_epoch_end`` moved before the round's evaluation, where
    a client's local training ends (the one documented difference)."""
    out, pending = [], []
    eval_hooks = {h for h in HOOKS if "validation" in h}
    for h in hooks:
        if h == "on_train_epoch_end" and pending:
            out[len(out) - len(pending):len(out) - len(pending)] = [h]
            pending = []
            continue
        out.append(h)
        pending = pending + [h] if h in eval_hooks else []
    return out


def assert_same(fed, ref, atol=1e-6):
    assert len(fed.steps) == len(ref.steps) > 0
    for i, (a, b) in enumerate(zip(fed.steps, ref.steps)):
        assert a == b, f"step {i}: (round, global_step, lrs) federated {a}, lightning {b}"
    assert len(fed.weights) == len(ref.weights)
    for i, (a, b) in enumerate(zip(fed.weights, ref.weights)):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=f"weights after batch {i}")
    assert fed.hooks == _lightning_order(ref.hooks)


# ---------------------------------------------------------------------------------------- the modules
class Net(Probe):
    def __init__(self, lr=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(10, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.lr = lr

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Classifier(Net):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


class WarmUpInOptimizerStep(Classifier):
    """Lightning's documented warm-up: the learning rate set in ``optimizer_step`` after each step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < 20:
            scale = min(1.0, float(self.trainer.global_step + 1) / 20.0)
            for pg in optimizer.param_groups:
                pg["lr"] = scale * self.lr


class TwoOptimizers(Classifier):
    """Manual optimization: the backbone and the head, each stepped once per batch; the head's
    scheduler stepped by the module at the end of each epoch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        a = torch.optim.SGD(self.backbone.parameters(), lr=0.1)
        b = torch.optim.SGD(self.head.parameters(), lr=0.2)
        return [a, b], [torch.optim.lr_scheduler.StepLR(b, step_size=1, gamma=0.5)]

    def training_step(self, batch, batch_idx):
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self(x), y))
            opt.step()

    def on_train_epoch_end(self):
        super().on_train_epoch_end()
        self.lr_schedulers().step()


class SchedulerNeverStepped(Classifier):
    """Manual optimization that returns a scheduler and never steps it (Lightning's
    ``ManualOptimBoringModel``): lightning.Trainer never steps it either."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


class FrozenBackbone(Classifier):
    """A pretrained backbone, frozen, with a BatchNorm in eval mode; only the head trains."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.backbone[1].running_mean.uniform_(-0.5, 0.5)
        self.backbone.eval().requires_grad_(False)


class GradualUnfreeze(Classifier):
    """The backbone frozen in ``__init__``; its second layer unfrozen at epoch 1, its first at epoch 2
    (in ``on_train_epoch_start``, keyed on the epoch: the same in every client)."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.backbone.requires_grad_(False)

    def on_train_epoch_start(self):
        super().on_train_epoch_start()
        if self.current_epoch >= 1:
            self.backbone[2].requires_grad_(True)
        if self.current_epoch >= 2:
            self.backbone[0].requires_grad_(True)


class EndsEpochEarly(Net):
    """``on_train_batch_start`` returns -1 at the third batch of the first epoch (no validation step:
    lightning.Trainer skips that epoch's validation, a federated round does not)."""

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        return -1 if self.current_epoch == 0 and batch_idx == 2 else None


# ---------------------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("make", [Classifier, WarmUpInOptimizerStep, TwoOptimizers, SchedulerNeverStepped,
                                  FrozenBackbone, GradualUnfreeze, EndsEpochEarly], ids=lambda m: m.__name__)
def test_one_client_equals_lightning_trainer(tmp_path, make):
    fed, ref = run_both(make, tmp_path)
    assert_same(fed, ref)


# ---------------------------------------------------------------------------------------- clients of different sizes
class OneCycleBySteps(Classifier):
    """A step-interval OneCycleLR over ``estimated_stepping_batches`` (each client's own run length)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _by_size(base):
    """``base`` also recording, by the client's batches per round, its batches per round and its
    (round, global_step, lrs) at every optimizer step."""

    class BySize(base):
        def __init__(self):
            super().__init__()
            self.sized_batches: dict[int, dict[int, list]] = {}
            self.sized_steps: dict[int, list] = {}

        def on_train_batch_start(self, batch, batch_idx):
            rounds = self.sized_batches.setdefault(self.trainer.num_training_batches, {})
            rounds.setdefault(self.current_epoch, []).append(tuple(t.clone() for t in batch))
            return super().on_train_batch_start(batch, batch_idx)

        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            self.sized_steps.setdefault(self.trainer.num_training_batches, []).append(self.steps[-1])

    BySize.__name__ = base.__name__
    return BySize


@pytest.mark.parametrize("make", [WarmUpInOptimizerStep, OneCycleBySteps], ids=lambda m: m.__name__)
def test_clients_of_different_sizes_each_follow_their_own_lightning_run(tmp_path, make):
    """Full participation, clients of 4 and 3 batches a round: each client's global_step and learning
    rates at every step are those of one lightning.Trainer run over that client's batches (the weights
    differ: the server averages)."""
    make = _by_size(make)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(56 + 16, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    data = FederatedDataModule.from_tensors(x[:56], y[:56], x[56:], y[56:],
                                            client_indices=[list(range(32)), list(range(32, 56))])
    fed = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FederatedTrainer(rounds=ROUNDS, batch_size=BATCH, seed=0, num_threads=1, enable_progress_bar=False,
                         enable_summary=False, log_dir=str(tmp_path / "fed")).fit(fed, data)
    differ = [str(w.message) for w in caught if "lightning.Trainer would differ" in str(w.message)]
    assert all("on_train_epoch_end" in m for m in differ), differ  # (Probe's hook: the documented difference)
    assert sorted(fed.sized_steps) == [3, 4]
    for steps, batches in fed.sized_batches.items():
        ref = make()
        trainer = L.Trainer(max_epochs=ROUNDS, deterministic=True, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            accelerator="cpu", devices=1, default_root_dir=str(tmp_path / f"lightning{steps}"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(ref, DataLoader(Replay(batches, lambda: trainer), batch_size=None))
        assert len(fed.sized_steps[steps]) == len(ref.steps) == ROUNDS * steps
        assert fed.sized_steps[steps] == ref.steps, steps
