"""The user's LightningModule, unchanged: Lightning's hook order, self.log, manual optimization."""

import csv
import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpfl_lightning import ConfigError, FederatedLightningModule
from dpfl_lightning.models import MLPClassifier
from helpers import TinyClassifier, quiet_trainer, tiny_data

PER_BATCH = ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer", "on_train_batch_start",
             "optimizer_step", "training_step", "on_before_zero_grad", "optimizer_zero_grad", "on_before_backward",
             "backward", "on_after_backward", "on_before_optimizer_step", "on_train_batch_end"]


class HookRecorder(TinyClassifier):
    def __init__(self):
        super().__init__(in_features=10)
        self.calls: list[str] = []
        self.rounds_seen: list[int] = []

    def _rec(name):  # noqa: N805 - builds overriding methods
        def method(self, *args, **kwargs):
            if self.training:  # evaluation moves its batches with the same hooks
                self.calls.append(name)
            return getattr(L.LightningModule, name)(self, *args, **kwargs)

        return method

    for _name in PER_BATCH:
        if _name not in ("training_step",):
            locals()[_name] = _rec(_name)

    def training_step(self, batch, batch_idx):
        self.calls.append("training_step")
        self.rounds_seen.append(self.trainer.current_epoch)
        return super().training_step(batch, batch_idx)


def _lightning_order():
    model = HookRecorder()
    x, y = torch.randn(8, 10), torch.randint(0, 10, (8,))
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", default_root_dir=os.devnull)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return [c for c in model.calls if c in PER_BATCH]


def test_hooks_run_in_lightnings_order(log_dir):
    expected = _lightning_order()  # measured on lightning.Trainer itself
    model = HookRecorder()
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=1, local_steps=1, batch_size=4)
    trainer.fit(model, tiny_data())
    calls = [c for c in model.calls if c in PER_BATCH]
    assert calls == expected * 2  # one local step in each of two rounds
    assert model.rounds_seen == [0, 1]  # self.trainer.current_epoch is the round


def test_self_log_values_reach_the_csv_log(log_dir):
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4)
    trainer.fit(TinyClassifier(), tiny_data())
    path = os.path.join(trainer.csv_log_dir, "metrics.csv")
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    for row, hist in zip(rows, trainer.history):
        assert float(row["my_train_loss"]) == pytest.approx(hist["my_train_loss"])
        assert 0.0 <= float(row["my_val_acc"]) <= 1.0
        assert float(row["my_val_loss"]) > 0


def test_train_loss_is_the_mean_of_logged_steps(log_dir):
    seen = []

    class Spy(TinyClassifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            seen.append((float(loss.detach()), batch[0].shape[0]))
            return loss

    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, batch_size=5)
    trainer.fit(Spy(), tiny_data(samples=12))
    mean = sum(v * n for v, n in seen) / sum(n for _, n in seen)
    assert trainer.history[0]["my_train_loss"] == pytest.approx(mean, rel=1e-6)


def test_unchanged_module_learns(log_dir):
    from dpfl_lightning.data import Digits

    trainer = quiet_trainer(log_dir, rounds=10, clients_per_round=10, batch_size=8)
    trainer.fit(TinyClassifier(in_features=64, lr=0.1), Digits(num_clients=30))
    accs = [h["my_val_acc"] for h in trainer.history]
    assert accs[-1] > 0.6 and accs[-1] > accs[0] + 0.2  # chance is 0.1


def test_parameters_are_views_of_one_flat_buffer(log_dir):
    storages = []

    class Spy(TinyClassifier):
        def on_train_epoch_end(self):
            storages.append({p.untyped_storage().data_ptr() for p in self.parameters()})

    model = Spy()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2)
    fm = trainer.fit(model, tiny_data())
    assert storages and all(len(s) == 1 for s in storages)  # while training: views of one buffer
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(flat, fm.global_params)  # after fit the user's module holds the global model
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters()))


def test_torchmetrics_metric_objects_are_computed_per_evaluation(log_dir):
    data = tiny_data(dim=10)
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=4, test_after_fit=True)
    fm = trainer.fit(MLPClassifier(in_features=10, hidden=[8]), data)
    x, y = data._test_tensors
    with torch.no_grad():
        acc = (fm.inner(x).argmax(-1) == y).float().mean().item()
    assert trainer.history[-1]["val_acc"] == pytest.approx(acc, abs=1e-6)
    assert trainer.final_metrics["test_acc"] == pytest.approx(acc, abs=1e-6)


class ManualModule(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("manual_loss", loss)


def test_manual_optimization_trains(log_dir):
    data = tiny_data(num_clients=10, samples=30)
    model = ManualModule()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(log_dir, rounds=8, clients_per_round=5)
    trainer.fit(model, data)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    losses = [h["manual_loss"] for h in trainer.history]
    assert losses[-1] < losses[0]


def test_plain_module_with_loss(log_dir):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 10))
    fm = FederatedLightningModule(net, loss_fn=F.cross_entropy, lr=0.2)
    trainer = quiet_trainer(log_dir, rounds=10, clients_per_round=10)
    trainer.fit(fm, tiny_data(num_clients=20, samples=30))
    assert trainer.history[-1]["val_acc"] > 0.2  # chance is 0.1; seeds 0-4 reach 0.29-0.34
    assert "train_loss" in trainer.history[-1]


def test_plain_module_needs_a_loss():
    with pytest.raises(ConfigError, match="loss_fn"):
        FederatedLightningModule(nn.Linear(2, 2))


def test_lr_decay_and_scheduler(log_dir):
    lrs = []

    class Sched(TinyClassifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                       "interval": "step"}}

        def on_before_optimizer_step(self, optimizer):
            lrs.append(optimizer.param_groups[0]["lr"])

    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=1, local_steps=3, client_lr_decay=0.9)
    trainer.fit(Sched(), tiny_data())
    # the step schedule continues across rounds (round 1 starts at step 3); the hooks see the scheduled
    # lr, and client_lr_decay scales the lr of every step of round 1 by 0.9 (tested in test_lightning_compat)
    assert lrs == pytest.approx([0.1, 0.05, 0.025, 0.0125, 0.00625, 0.003125])


class PretrainedBatchNorm(TinyClassifier):
    """A pretrained BatchNorm, frozen in eval mode: its statistics never change (runs, as under Lightning)."""

    def __init__(self, frozen=True):
        super().__init__()
        self.bn = nn.BatchNorm1d(10).eval().requires_grad_(not frozen)
        self.bn.running_mean.fill_(0.5)
        self.bn.running_var.fill_(2.0)

    def forward(self, x):
        return self.net(self.bn(x))


class SwitchesBatchNormToTrainMode(PretrainedBatchNorm):
    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            self.bn.train()


@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_a_pretrained_batchnorm_frozen_in_eval_mode_runs(log_dir, executor):
    frozen = executor == "sequential"  # (vmap refuses frozen parameters: there, eval mode with trainable affine)
    model = PretrainedBatchNorm(frozen)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=3, executor=executor)
    fm = trainer.fit(model, tiny_data())
    assert not model.bn.training and trainer.history[-1]["my_val_acc"] >= 0
    assert torch.equal(model.bn.running_mean, torch.full((10,), 0.5))  # never updated from client data
    assert torch.equal(model.bn.running_var, torch.full((10,), 2.0)) and int(model.bn.num_batches_tracked) == 0
    assert not torch.equal(fm.global_params, before)
    assert not model.bn._forward_pre_hooks  # the run's check is gone with the run


def test_a_batchnorm_switched_to_train_mode_during_training_is_refused_by_name(log_dir):
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2)
    with pytest.raises(ConfigError, match=r"model='bn': was switched to train mode during training: BatchNorm running"):
        trainer.fit(SwitchesBatchNormToTrainMode(), tiny_data())
    assert len(trainer.history) == 1


def test_trainable_mask_marks_the_entries_of_trainable_parameters():
    model = TinyClassifier()
    model.net[0].requires_grad_(False)
    fm = FederatedLightningModule(model)
    fm.setup(torch.device("cpu"))  # the flat layout
    sizes = [p.numel() for p in model.parameters()]  # net.0 weight and bias, net.2 weight and bias
    expected = torch.cat([torch.full((n,), i >= 2) for i, n in enumerate(sizes)])
    assert torch.equal(fm.trainable_mask(), expected)
    model.net[0].weight.requires_grad_(True)  # read again after a change
    assert torch.equal(fm.trainable_mask(), torch.cat([torch.full((n,), i != 1) for i, n in enumerate(sizes)]))
    fm.teardown()
