"""Any Lightning model, unchanged: schedules across rounds, the Trainer API inside the module, hooks,
trainer settings, Lightning callbacks, DataModules, DP-SGD with manual optimization and skipped
batches, export, and lightning.Trainer after a federated fit (see dpfl_lightning.lightning.semantics)."""

from __future__ import annotations

import math
import os
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint,
                                         StochasticWeightAveraging, TQDMProgressBar)
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from dpfl_lightning import ConfigError, FederatedDataModule
from dpfl_lightning.models import MLPClassifier
from dpfl_lightning.plugins import DPSGD, GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data, torch_lrs

DP_FEDAVG = lambda: [UpdateClipping(1.0), GaussianNoise(noise_multiplier=0.3)]  # noqa: E731


def _lightning_trainer(**kw) -> L.Trainer:
    kw.setdefault("max_epochs", 1)
    return L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", default_root_dir=os.devnull, **kw)


# ---------------------------------------------------------------------------------------- schedules
class LrSpy(TinyClassifier):
    """Records (round, global_step, lr) at every local optimizer step."""

    def __init__(self, make_scheduler=None, interval="epoch", **kw):
        super().__init__(**kw)
        self.make_scheduler, self.interval = make_scheduler, interval
        self.seen: list[tuple[int, int, float]] = []
        self.estimated: list[int] = []

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.estimated.append(self.trainer.estimated_stepping_batches)
        if self.make_scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.make_scheduler(self, opt),
                                                   "interval": self.interval}}

    def on_before_optimizer_step(self, optimizer):
        self.seen.append((self.current_epoch, self.global_step, optimizer.param_groups[0]["lr"]))


def test_epoch_scheduler_advances_once_per_round_for_every_client(log_dir):
    model = LrSpy(lambda m, opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    trainer = quiet_trainer(log_dir, rounds=4, local_epochs=2, batch_size=4)  # 3 clients x 2 epochs x 3 batches
    trainer.fit(model, tiny_data(num_clients=3))
    by_round = {}
    for r, _, lr in model.seen:
        by_round.setdefault(r, set()).add(lr)
    assert by_round == {r: {0.1 * 0.5**r} for r in range(4)}  # exact: it never steps inside a client
    assert len(model.seen) == 4 * 3 * 6


def test_step_schedulers_continue_across_rounds_like_one_lightning_run(log_dir):
    R, S = 4, 3
    onecycle = lambda m, opt: torch.optim.lr_scheduler.OneCycleLR(  # noqa: E731
        opt, max_lr=1.0, total_steps=m.trainer.estimated_stepping_batches if m is not None else R * S)
    steplr = lambda m, opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
    for make in (onecycle, steplr):
        model = LrSpy(make, interval="step")
        trainer = quiet_trainer(log_dir, rounds=R, clients_per_round=2, local_steps=S, batch_size=4)
        trainer.fit(model, tiny_data(num_clients=5))
        ref = torch_lrs(lambda opt: make(None, opt), R * S)
        assert set(model.estimated) == {R * S}  # the steps one client takes over the run
        assert len(model.seen) == R * 2 * S
        for r, g, lr in model.seen:
            assert r * S <= g < (r + 1) * S  # global_step continues from r * S
            assert lr == pytest.approx(ref[g]), (r, g)
        for r in range(R):  # each of the round's two clients takes steps r S, ..., r S + S - 1
            assert sorted(g for rr, g, _ in model.seen if rr == r) == sorted(2 * list(range(r * S, (r + 1) * S)))
        assert [lr for r, g, lr in model.seen if r == R - 1][-1] == pytest.approx(ref[-1])


def test_client_lr_decay_scales_every_step_of_the_schedule(log_dir):
    make = lambda m, opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    steps = []

    class StepSpy(LrSpy):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            steps.append(self._moved())

        def on_train_batch_start(self, batch, batch_idx):
            self._before = [p.detach().clone() for p in self.parameters()]

        def _moved(self):  # lr actually used = |change| / |grad|
            p = next(self.parameters())
            return float(((self._before[0] - p.detach()).norm() / p.grad.norm()))

    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=1, local_steps=2, client_lr_decay=0.5)
    trainer.fit(StepSpy(make, interval="step"), tiny_data())
    assert steps == pytest.approx([0.1, 0.05, 0.5 * 0.025, 0.5 * 0.0125], rel=1e-4)


class Plateau(LrSpy):
    def __init__(self, monitor="my_val_loss", **kw):
        super().__init__(**kw)
        self.monitor = monitor

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": self.monitor}}


def test_reduce_on_plateau_steps_once_per_round_on_the_released_metric(log_dir):
    model = Plateau(lr=0.5)
    trainer = quiet_trainer(log_dir, rounds=4, clients_per_round=2, local_epochs=2)
    trainer.fit(model, tiny_data())
    ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, factor=0.5, patience=0, threshold=0.5)
    for r in range(4):
        assert {lr for rr, _, lr in model.seen if rr == r} == {ref_opt.param_groups[0]["lr"]}
        ref.step(trainer.history[r]["my_val_loss"])
    assert model.seen[-1][2] < 0.5  # it did reduce


def test_reduce_on_plateau_refuses_a_metric_a_dp_run_withholds(log_dir):
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, plugins=DP_FEDAVG())
    with pytest.raises(ConfigError, match="withholds"):
        trainer.fit(Plateau(monitor="my_train_loss"), tiny_data())
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, plugins=DP_FEDAVG())
    trainer.fit(Plateau(), tiny_data())  # an evaluation metric is released


def test_reduce_on_plateau_needs_a_monitor(log_dir):
    class NoMonitor(TinyClassifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.ReduceLROnPlateau(opt)]

    with pytest.raises(ConfigError, match="monitor"):
        quiet_trainer(log_dir, rounds=1).fit(NoMonitor(), tiny_data())


class WarmUp(LrSpy):
    """Lightning's documented warm-up: the learning rate set in optimizer_step, keyed on global_step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        for pg in optimizer.param_groups:
            pg["lr"] = min(1.0, (self.trainer.global_step + 1) / 10) * self.lr


def _warm_lr(g, lr=0.1, w=10):
    """The warm-up's learning rate at step ``g`` of one lightning.Trainer run."""
    return lr if g == 0 else min(1.0, g / w) * lr


def test_learning_rates_the_module_sets_carry_across_rounds_like_one_lightning_run(log_dir):
    S = 3
    model = WarmUp()
    trainer = quiet_trainer(log_dir, rounds=4, clients_per_round=2, local_steps=S)  # partial participation
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing differs from lightning.Trainer here
        trainer.fit(model, tiny_data(num_clients=5))
    assert len(model.seen) == 4 * 2 * S
    for r, g, lr in model.seen:  # every client of round r starts at r * S, where the warm-up stands
        assert r * S <= g < (r + 1) * S
        assert lr == pytest.approx(_warm_lr(g), rel=1e-12), (r, g)
    assert [lr for r, g, lr in model.seen if g == S] == [pytest.approx(_warm_lr(S))] * 2  # not the base rate


def test_a_dp_run_keeps_what_a_client_decides_and_says_so_at_set_up(log_dir):
    S = 3
    model = WarmUp()
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2, local_steps=S, plugins=DP_FEDAVG())
    with pytest.warns(RuntimeWarning, match="lightning.Trainer would differ: the module overrides optimizer_step, .*"
                                            "in a DP run what a client's training decides stays with the client") as w:
        trainer.fit(model, tiny_data(num_clients=5))
    said = [x for x in w if "would differ" in str(x.message)]
    assert len(said) == 1 and said[0].filename.endswith("trainer.py")  # at set-up, not from a round's end
    assert [lr for r, g, lr in model.seen if g % S == 0] == [0.1] * 6  # every round starts on the schedule


class DataDependentLr(LrSpy):
    """Changes its learning rate from the data in training_step, through no hook a DP run reads."""

    def training_step(self, batch, batch_idx):
        for pg in self.trainer.optimizers[0].param_groups:
            pg["lr"] = float(batch[0].abs().mean()) / 10
        return super().training_step(batch, batch_idx)


def test_a_dp_run_says_nothing_from_what_its_clients_did(log_dir):
    """Clients that end off the schedule are never said in a DP run: only the module's code is read."""
    model = DataDependentLr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        quiet_trainer(log_dir, rounds=3, clients_per_round=3, local_steps=2, plugins=DP_FEDAVG()).fit(
            model, tiny_data(num_clients=5))
    with pytest.warns(RuntimeWarning, match="ended their local training in different optimizer states"):
        quiet_trainer(log_dir, rounds=3, clients_per_round=3, local_steps=2).fit(DataDependentLr(), tiny_data(5))


class LrFromData(LrSpy):
    """Sets its learning rate from the data: clients end their rounds in different states."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        for pg in self.trainer.optimizers[0].param_groups:
            pg["lr"] = float(batch[0].abs().mean()) / 10


def test_clients_that_end_in_different_states_start_the_next_round_on_the_schedule(log_dir):
    model = LrFromData()
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=3, local_steps=2)
    with pytest.warns(RuntimeWarning, match="ended their local training in different optimizer states"):
        trainer.fit(model, tiny_data(num_clients=5))
    assert [lr for r, g, lr in model.seen if g % 2 == 0] == [0.1] * 9


def test_global_step_counts_every_optimizer_step_of_manual_optimization_across_rounds(log_dir):
    starts = []

    class Counts(GanLike):  # two optimizers, each stepped once per batch
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 0:
                starts.append((self.current_epoch, self.global_step))

    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2, local_steps=2)
    trainer.fit(Counts(), tiny_data())
    assert starts == [(r, r * 2 * 2) for r in range(3) for _ in range(2)]  # 2 optimizer steps per batch


def test_a_resumed_run_continues_what_the_clients_carried(log_dir, tmp_path):
    full = quiet_trainer(log_dir, rounds=4, clients_per_round=2, local_steps=3)
    whole = full.fit(WarmUp(), tiny_data(num_clients=5)).global_params.clone()
    first = quiet_trainer(log_dir, rounds=2, clients_per_round=2, local_steps=3, checkpoint_every=2,
                          checkpoint_dir=str(tmp_path))
    first.fit(WarmUp(), tiny_data(num_clients=5))
    model = WarmUp()
    rest = quiet_trainer(log_dir, rounds=4, clients_per_round=2, local_steps=3)
    resumed = rest.fit(model, tiny_data(num_clients=5), ckpt_path=str(tmp_path / "last.ckpt")).global_params
    assert model.seen[0][1:] == (6, pytest.approx(_warm_lr(6)))  # round 3 starts where round 2 ended
    assert torch.equal(resumed, whole)


# ---------------------------------------------------------------------------------------- the Trainer API
def test_trainer_api_inside_the_module(log_dir):
    seen = {}

    class Api(TinyClassifier):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

        def training_step(self, batch, batch_idx):
            t = self.trainer
            seen["optimizers"] = self.optimizers()
            seen["schedulers"] = self.lr_schedulers()
            seen["raw"] = list(t.optimizers)
            seen["model"] = t.model is self and t.lightning_module is self
            seen["shape"] = (t.max_epochs, t.num_training_batches, t.estimated_stepping_batches, t.is_last_batch)
            seen["training"] = t.training
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            seen["validating"] = self.trainer.validating
            seen["callback_metrics"] = set(self.trainer.callback_metrics)
            return super().validation_step(batch, batch_idx)

    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, local_steps=3)
    model = Api()
    trainer.fit(model, tiny_data())
    assert isinstance(seen["optimizers"], LightningOptimizer) and isinstance(seen["optimizers"], torch.optim.SGD)
    assert isinstance(seen["schedulers"], torch.optim.lr_scheduler.StepLR)
    assert seen["raw"] == [seen["optimizers"].optimizer] and seen["model"]
    assert seen["shape"] == (2, 3, 6, True) and seen["training"] and seen["validating"]
    assert "my_val_loss" in seen["callback_metrics"]  # the previous round's released row
    with pytest.raises(RuntimeError, match="not attached"):  # after fit: detached, as a fresh module
        _ = model.trainer


def test_unknown_trainer_attributes_name_themselves(log_dir):
    class Reads(TinyClassifier):
        def training_step(self, batch, batch_idx):
            return self.trainer.val_dataloaders

    with pytest.raises(AttributeError, match="self.trainer.val_dataloaders is not available in a federated run"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=1).fit(Reads(), tiny_data())


class GanLike(TinyClassifier):
    """Manual optimization with two optimizers, toggling, clip_gradients and a stepped scheduler."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.head_norms: list[float] = []

    def configure_optimizers(self):
        a = torch.optim.SGD(self.net[0].parameters(), lr=0.1)
        b = torch.optim.SGD(self.net[2].parameters(), lr=0.1)
        return [a, b], [torch.optim.lr_scheduler.StepLR(b, 1, 0.5)]

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        for opt in (opt_a, opt_b):
            with self.toggled_optimizer(opt):
                loss = F.cross_entropy(self(x), y)
                opt.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
                if opt is opt_b:
                    self.head_norms.append(float(torch.cat([p.grad.flatten() for p in self.net[2].parameters()]).norm()))
                opt.step()
        self.lr_schedulers().step()
        self.log("gan_loss", loss)


def test_manual_optimization_with_two_optimizers_toggles_and_clips(log_dir):
    model = GanLike()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, local_steps=2)
    trainer.fit(model, tiny_data())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert model.head_norms and max(model.head_norms) <= 1e-3 * (1 + 1e-4)
    assert all(p.requires_grad for p in model.parameters())  # untoggled


# ---------------------------------------------------------------------------------------- hooks
RUN_HOOKS = ["setup", "configure_model", "on_fit_start", "on_train_start", "on_train_epoch_start",
             "on_train_epoch_end", "on_validation_start", "on_validation_end", "on_test_start", "on_test_end",
             "on_train_end", "on_fit_end", "teardown"]


class HookLog(TinyClassifier):
    def __init__(self, fail_in_round=None):
        super().__init__()
        self.calls: list[str] = []
        self.fail_in_round = fail_in_round
        self.extra = None

    def _rec(name):  # noqa: N805 - builds overriding methods
        def method(self, *args, **kwargs):
            self.calls.append(name)
            return getattr(L.LightningModule, name)(self, *args, **kwargs)

        return method

    for _name in RUN_HOOKS:
        if _name not in ("configure_model",):
            locals()[_name] = _rec(_name)

    def configure_model(self):
        self.calls.append("configure_model")
        if self.extra is None:
            self.extra = nn.Linear(10, 10)  # built here: trained and federated like the rest
            self.extra_init = self.extra.weight.detach().clone()

    def forward(self, x):
        return self.net(self.extra(x))

    def training_step(self, batch, batch_idx):
        if self.fail_in_round is not None and self.current_epoch == self.fail_in_round:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)


def test_run_level_hooks_run_in_lightnings_order(log_dir):
    client = ["on_train_epoch_start", "on_train_epoch_end"] * 2
    val = ["on_validation_start", "on_validation_end"]
    for test_after_fit, test in ((False, []), (True, ["on_test_start", "on_test_end"])):
        model = HookLog()
        trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, test_after_fit=test_after_fit)
        trainer.fit(model, tiny_data())
        assert model.calls == (["setup", "configure_model", "on_fit_start", "on_train_start"] + client + val + client
                               + val + test + ["on_train_end", "on_fit_end", "teardown"])
        assert not torch.equal(model.extra.weight, model.extra_init)


def test_a_failed_run_tears_down_and_leaves_the_module_clean(log_dir):
    model = HookLog(fail_in_round=1)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2, plugins=[DPSGD(noise_multiplier=1.0)])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model, tiny_data())
    assert model.calls[-1] == "teardown" and "on_fit_end" not in model.calls
    assert model._trainer is None and "log" not in vars(model)
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # no Opacus hooks or attributes left
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == len(list(model.parameters()))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(flat, trainer.module.global_params)  # the global model of the last finished round
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, gradient_clip_val=1.0,
                            plugins=[DPSGD(noise_multiplier=1.0)])
    with pytest.raises(ConfigError):  # refused at set-up: nothing attached either
        trainer.fit(model, tiny_data())
    assert model._trainer is None and "log" not in vars(model)


def _lstm_data(num_clients=4, vocab=12, seq=6, per_client=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (num_clients * per_client, seq), generator=g)
    y = (x + 1) % vocab  # predict the next token id: learnable
    return FederatedDataModule.from_tensors(x, y, x[:8], y[:8], num_clients=num_clients)


def _tiny_lstm(vocab=12):
    from lightning.pytorch.demos import LightningLSTM
    from lightning.pytorch.demos.lstm import SimpleLSTM

    torch.manual_seed(0)
    model = LightningLSTM(vocab_size=vocab)
    model.model = SimpleLSTM(vocab_size=vocab, ninp=16, nhid=16, nlayers=1, dropout=0.0)
    model.prepare_data = lambda: None  # it downloads WikiText-2 (as lightning.Trainer would): the test brings data
    return model


@pytest.mark.parametrize("dp", [False, True])
def test_lightning_lstm_demo_state_does_not_leak_between_clients(log_dir, dp):
    model = _tiny_lstm()
    starts = []
    original = type(model).training_step

    def spy(batch, batch_idx):
        if batch_idx == 0:
            starts.append(model.hidden is None)
        return original(model, batch, batch_idx)

    model.training_step = spy
    x, y = _lstm_data()._given[0].tensors
    before = F.nll_loss(model.model(x, model.model.init_hidden(x.shape[0]))[0], y.view(-1)).item()
    # Lightning's LSTM demo needs batches of one size (its hidden state carries over): 8 records, batch 4;
    # its SGD(lr=20) needs the gradient clipping PyTorch's word-language-model example uses
    trainer = quiet_trainer(log_dir, rounds=4, batch_size=4, gradient_clip_val=0.1,
                            plugins=DP_FEDAVG() if dp else [])
    trainer.fit(model, _lstm_data())
    assert starts and all(starts)  # every client starts without the previous client's hidden state
    assert model.hidden is None
    after = F.nll_loss(model.model(x, model.model.init_hidden(x.shape[0]))[0], y.view(-1)).item()
    assert after < before


# ---------------------------------------------------------------------------------------- trainer settings
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clip_val_clips_each_local_step(log_dir, algorithm):
    rec = Recorder(order=1)
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, local_steps=1, gradient_clip_val=0.01,
                            gradient_clip_algorithm=algorithm, plugins=[rec])
    trainer.fit(TinyClassifier(lr=1.0), tiny_data())
    for u in rec.updates:  # one SGD step with lr 1: the update is minus the clipped gradient
        size = u.norm() if algorithm == "norm" else u.abs().max()
        assert 0.009 < size <= 0.01 * (1 + 1e-5)


def test_configure_gradient_clipping_is_called_with_the_trainer_settings(log_dir):
    got = []

    class Custom(TinyClassifier):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            got.append((gradient_clip_val, gradient_clip_algorithm))
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm="value")

    rec = Recorder(order=1)
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, local_steps=1, gradient_clip_val=0.002,
                            plugins=[rec])
    trainer.fit(Custom(lr=1.0), tiny_data())
    assert got == [(0.002, None)] * 2  # as lightning.Trainer passes them (no algorithm set)
    assert all(u.abs().max() <= 0.002 * (1 + 1e-5) for u in rec.updates)  # the module chose clipping by value
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=1, local_steps=1, gradient_clip_val=0.002,
                            gradient_clip_algorithm="norm")
    with pytest.raises(Exception, match="gradient_clip_algorithm"):  # Lightning's own conflict check
        trainer.fit(Custom(), tiny_data())


def test_gradient_clipping_and_accumulation_refusals(log_dir):
    dpsgd = lambda: [DPSGD(noise_multiplier=1.0)]  # noqa: E731
    cases = [(dict(gradient_clip_val=1.0, plugins=dpsgd()), TinyClassifier, "per record|every record"),
             (dict(accumulate_grad_batches=2, plugins=dpsgd()), TinyClassifier, "one noisy step per sampled batch"),
             (dict(gradient_clip_val=1.0), GanLike, "manual optimization"),
             (dict(accumulate_grad_batches=2), GanLike, "manual optimization"),
             (dict(precision="16-mixed"), TinyClassifier, "needs CUDA"),
             (dict(precision="bf16-true"), TinyClassifier, "fp32 buffer"),
             (dict(accumulate_grad_batches=2, executor="vmap"), TinyClassifier, "executor='sequential'")]
    for kw, model, match in cases:
        with pytest.raises(ConfigError, match=match):
            quiet_trainer(log_dir, rounds=1, clients_per_round=1, **kw).fit(model(), tiny_data())


def test_accumulate_grad_batches_equals_a_larger_batch(log_dir):
    out = {}
    for bs, acc in ((8, 1), (4, 2)):
        trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=3, batch_size=bs, accumulate_grad_batches=acc)
        model = LrSpy()
        out[acc] = trainer.fit(model, tiny_data(samples=16)).global_params.clone()
        assert {g for _, g, _ in model.seen} == {0, 1, 2, 3}  # 2 optimizer steps per round either way
        assert set(model.estimated) == {4}
    assert torch.allclose(out[1], out[2], atol=1e-6)


def test_bf16_mixed_autocasts_the_steps_and_keeps_fp32_weights(log_dir):
    dtypes = set()

    class Cast(TinyClassifier):
        def forward(self, x):
            out = super().forward(x)
            dtypes.add(out.dtype)
            return out

    for plugins in ([], DP_FEDAVG(), [DPSGD(noise_multiplier=0.5)]):
        trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, precision="bf16-mixed", plugins=plugins)
        fm = trainer.fit(Cast(), tiny_data())
        assert fm.global_params.dtype == torch.float32 and all(p.dtype == torch.float32 for p in fm.inner.parameters())
        assert math.isfinite(trainer.history[-1]["my_val_loss"])
    assert dtypes == {torch.bfloat16}


def test_16_mixed_scales_the_loss(log_dir, monkeypatch):
    """The float16 path (CUDA in practice), run on CPU with the device check lifted."""
    import dpfl_lightning.lightning.semantics as compat

    monkeypatch.setattr(compat, "mixed16_needs_cuda", lambda trainer: None)
    losses = {}
    for precision in ("32", "16-mixed"):
        trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, precision=precision)
        fm = trainer.fit(TinyClassifier(), tiny_data())
        losses[precision] = [h["my_train_loss"] for h in trainer.history]
    assert fm._scaler is not None and fm._scaler.get_scale() > 1 and fm.global_params.dtype == torch.float32
    # the same training to float16's precision, except the steps the GradScaler skips while its scale
    # settles (seeds 0-4: mean |difference| 0.02-0.05, largest 0.12, on losses ~2.1)
    diffs = [abs(a - b) for a, b in zip(losses["16-mixed"], losses["32"])]
    assert sum(diffs) / len(diffs) < 0.08 and max(diffs) < 0.2


# ---------------------------------------------------------------------------------------- callbacks
def test_model_checkpoint_on_a_round_metric_and_load_from_checkpoint(log_dir, tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_acc", mode="max", save_top_k=1)
    trainer = quiet_trainer(log_dir, rounds=4, clients_per_round=4, callbacks=[ckpt])
    trainer.fit(MLPClassifier(in_features=10, hidden=[8]), tiny_data())
    accs = [h["val_acc"] for h in trainer.history]
    assert ckpt.best_model_score == pytest.approx(max(accs))
    assert os.path.basename(ckpt.best_model_path).startswith(f"epoch={accs.index(max(accs))}-")  # epoch = round
    loaded = MLPClassifier.load_from_checkpoint(ckpt.best_model_path)  # hyperparameters come from the file
    assert loaded.hparams.hidden == [8]
    assert len(os.listdir(tmp_path / "ckpt")) == 1  # top-1: the others were removed


def test_early_stopping_stops_the_run_after_a_round(log_dir):
    stop = EarlyStopping(monitor="my_val_loss", patience=0, min_delta=10.0)  # no round improves by 10
    trainer = quiet_trainer(log_dir, rounds=6, clients_per_round=2, callbacks=[stop])
    trainer.fit(TinyClassifier(), tiny_data())
    assert len(trainer.history) == 2 and "EarlyStopping" in trainer.stop_reason
    assert "my_val_loss" in trainer.history[-1]  # the last round trained is evaluated and tested as usual


def test_early_stopping_patience_survives_resume(log_dir, tmp_path):
    def stop():
        return EarlyStopping(monitor="my_val_loss", patience=3, min_delta=10.0)  # only round 1 "improves"

    whole = quiet_trainer(log_dir, rounds=8, clients_per_round=2, callbacks=[stop()])
    whole.fit(TinyClassifier(), tiny_data())
    assert len(whole.history) == 4  # round 1 sets the best, rounds 2-4 use up the patience

    first = quiet_trainer(log_dir, rounds=2, clients_per_round=2, callbacks=[stop()], checkpoint_every=1,
                          checkpoint_dir=str(tmp_path))
    first.fit(TinyClassifier(), tiny_data())
    resumed = quiet_trainer(log_dir, rounds=8, clients_per_round=2, callbacks=[stop()])
    resumed.fit(TinyClassifier(), tiny_data(), ckpt_path=str(tmp_path / "round-000002.ckpt"))
    assert len(resumed.history) == 4  # a fresh EarlyStopping would take round 3 as its best and run to 6
    assert [h["my_val_loss"] for h in resumed.history] == pytest.approx([h["my_val_loss"] for h in whole.history])


def test_the_modules_configure_callbacks_are_added(log_dir):
    class Stops(TinyClassifier):
        def configure_callbacks(self):
            return EarlyStopping(monitor="my_val_loss", patience=0, min_delta=10.0)

    trainer = quiet_trainer(log_dir, rounds=5, clients_per_round=2)
    trainer.fit(Stops(), tiny_data())
    assert len(trainer.history) == 2


def test_learning_rate_monitor_logs_the_round_schedule(log_dir):
    model = LrSpy(lambda m, opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2, callbacks=[LearningRateMonitor("epoch")],
                            plugins=DP_FEDAVG())
    trainer.fit(model, tiny_data())
    assert [h["lr-SGD"] for h in trainer.history] == [0.1, 0.05, 0.025]  # public: released in a DP run too


class SeesMetrics(Callback):
    def __init__(self):
        self.keys = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.keys.append(set(trainer.callback_metrics))


def test_callbacks_see_only_the_released_row(log_dir):
    cb = SeesMetrics()
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, plugins=DP_FEDAVG(), callbacks=[cb])
    trainer.fit(TinyClassifier(), tiny_data())
    assert cb.keys and all("my_val_loss" in k and "my_train_loss" not in k and "epsilon" in k for k in cb.keys)


class PerBatch(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


@pytest.mark.parametrize("callback,match", [
    (ModelCheckpoint(every_n_train_steps=5), "every_n_train_steps"),
    (LearningRateMonitor(logging_interval="step"), "logging_interval='step'"),
    (StochasticWeightAveraging(swa_lrs=0.1), "StochasticWeightAveraging"),
    (TQDMProgressBar(), "progress bar"),
    (PerBatch(), "on_train_batch_end"),
    (UpdateClipping(1.0), "plugins="),
])
def test_callbacks_that_cannot_run_per_round_are_refused(log_dir, callback, match):
    with pytest.raises(ConfigError, match=match):
        quiet_trainer(log_dir, rounds=1, callbacks=[callback]).fit(TinyClassifier(), tiny_data())


# ---------------------------------------------------------------------------------------- DataModules
class RecordsWithNoise(Dataset):
    """Dict records ``{"x": ..., "label": ...}`` (no tuple structure)."""

    def __init__(self, n, seed, shift=0.0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 10, generator=g) + shift
        self.y = (self.x[:, 0] > shift).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "label": self.y[i]}


def collate_records(items):
    return {"inputs": torch.stack([it["x"] for it in items]), "targets": torch.stack([it["label"] for it in items])}


class DictDataModule(L.LightningDataModule):
    def __init__(self, batch_size=4):
        super().__init__()
        self.save_hyperparameters()
        self.collate_calls = 0
        self.prepared = 0

    def prepare_data(self):
        self.prepared += 1

    def setup(self, stage):
        self.train, self.val, self.test = RecordsWithNoise(96, 0), RecordsWithNoise(40, 1), RecordsWithNoise(40, 2, 3.0)

    def teardown(self, stage):
        self.torn_down = getattr(self, "torn_down", []) + [stage]

    def _collate(self, items):
        self.collate_calls += 1
        return collate_records(items)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.transfers = getattr(self, "transfers", 0) + 1  # the DataModule's hook is used, as in Lightning
        return batch

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=self._collate)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=7, collate_fn=collate_records)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=7, collate_fn=collate_records)


class DictModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(10, 2)
        self.prepared = 0

    def prepare_data(self):
        self.prepared += 1

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.net(batch["inputs"]), batch["targets"])
        self.log("train_loss", loss)
        return loss

    def _eval(self, batch, stage):
        logits = self.net(batch["inputs"])
        self.log(f"{stage}_loss", F.cross_entropy(logits, batch["targets"]))
        self.log(f"{stage}_acc", (logits.argmax(-1) == batch["targets"]).float().mean())

    def validation_step(self, batch, batch_idx):
        self._eval(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval(batch, "test")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.parametrize("plugins", [[], DP_FEDAVG(), [DPSGD(noise_multiplier=0.3)]], ids=["fedavg", "dpfedavg", "dpsgd"])
def test_datamodule_collate_dict_batches_and_validation_set(log_dir, plugins):
    dm = DictDataModule()
    data = FederatedDataModule.from_datamodule(dm, num_clients=4)
    public = {"records_per_client": 24} if plugins and isinstance(plugins[0], DPSGD) else {}  # 96 records / 4
    trainer = quiet_trainer(log_dir, rounds=4, batch_size=4, plugins=plugins, test_after_fit=True, **public)
    model = DictModel()
    trainer.fit(model, data)
    last = trainer.history[-1]
    assert dm.prepared == 1 and model.prepared == 1  # Lightning's prepare_data, once each
    assert dm.collate_calls > 0  # the DataModule's collate_fn built the clients' batches
    assert dm.transfers > 0
    assert last["val_loss"] != pytest.approx(last["test_loss"])  # val_dataloader, not the test set
    assert last["val_acc"] > 0.7
    assert dm.torn_down == ["fit"]  # as lightning.Trainer.fit ends


def test_fit_runs_no_test_step_unless_asked(log_dir):
    from lightning.pytorch.demos.boring_classes import BoringModel

    class DictBatches(BoringModel):  # trained on dict batches; BoringModel's test_step expects a tensor
        def training_step(self, batch, batch_idx):
            return super().training_step(batch["inputs"], batch_idx)

        def validation_step(self, batch, batch_idx):
            return super().validation_step(batch["inputs"], batch_idx)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Records(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {"inputs": torch.full((32,), float(i))}

    data = lambda: FederatedDataModule.from_datasets(Records(), Records(), num_clients=2)  # noqa: E731
    trainer = quiet_trainer(log_dir, rounds=2)
    trainer.fit(DictBatches(), data())  # as lightning.Trainer.fit: training and validation, no test_step
    assert not any(k.startswith("test") for row in trainer.history for k in row)
    with pytest.raises(TypeError):  # asked for: the test runs (and BoringModel's test_step fails on a dict)
        quiet_trainer(log_dir, rounds=2, test_after_fit=True).fit(DictBatches(), data())


def test_label_aware_partitions_read_dict_records(log_dir):
    data = FederatedDataModule.from_datamodule(DictDataModule(), num_clients=4, partition="shards", shards_per_client=1)
    data.setup()
    labels = [set(data._train_ds.y[data.client_indices(c)].tolist()) for c in range(4)]
    assert all(len(s) == 1 for s in labels)  # one class per client: labels came from the "label" key

    class NoLabel(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return {"x": torch.zeros(3)}

    with pytest.raises(ConfigError, match="partition='iid'"):
        FederatedDataModule.from_datasets(NoLabel(), num_clients=2, partition="dirichlet").setup()
    FederatedDataModule.from_datasets(NoLabel(), num_clients=2).setup()  # iid needs no labels


def test_datamodule_iterable_training_set_is_refused(log_dir):
    class Stream(IterableDataset):
        def __iter__(self):
            yield from (torch.randn(10) for _ in range(8))

    class StreamDM(L.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(Stream(), batch_size=2)

    with pytest.raises(ConfigError, match="IterableDataset"):
        quiet_trainer(log_dir, rounds=1).fit(TinyClassifier(), FederatedDataModule.from_datamodule(StreamDM(), num_clients=2))
    from lightning.pytorch.demos.boring_classes import BoringDataModuleNoLen, BoringModel

    # Lightning's own: its validation and test loaders have no len() either (refused, not a raw TypeError)
    with pytest.raises(ConfigError, match="training set is an IterableDataset"):
        quiet_trainer(log_dir, rounds=1).fit(BoringModel(),
                                             FederatedDataModule.from_datamodule(BoringDataModuleNoLen(), num_clients=2))


def test_datamodule_batch_size_that_clients_do_not_use_is_announced(log_dir):
    with pytest.warns(UserWarning, match="batch_size=8"):
        quiet_trainer(log_dir, rounds=1, batch_size=4).fit(
            DictModel(), FederatedDataModule.from_datamodule(DictDataModule(batch_size=8), num_clients=4))


# ---------------------------------------------------------------------------------------- DP-SGD
class ConvBN(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(40, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x.unsqueeze(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fix_model_trains_the_module_that_was_passed(log_dir):
    model = ConvBN()
    before = model.net[0].weight.detach().clone()
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=2, plugins=[DPSGD(noise_multiplier=0.5, fix_model=True)])
    with pytest.warns(UserWarning, match="in place: net.1: BatchNorm1d -> GroupNorm"):
        fm = trainer.fit(model, tiny_data())
    assert fm.inner is model and isinstance(model.net[1], nn.GroupNorm)
    assert not torch.equal(before, model.net[0].weight)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(flat, fm.global_params)


class SkipsOddBatches(TinyClassifier):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


def test_dpsgd_with_manual_optimization_and_skipped_batches(log_dir):
    data = tiny_data(num_clients=6, samples=20)
    for model in (ManualTiny(), SkipsOddBatches()):
        trainer = quiet_trainer(log_dir, rounds=6, clients_per_round=4, batch_size=5, log_client_metrics=True,
                                plugins=[DPSGD(noise_multiplier=0.3)])
        trainer.fit(model, data)
        losses = [h["my_train_loss"] for h in trainer.history]
        assert losses[-1] < losses[0], type(model).__name__


def test_a_skipped_dpsgd_batch_is_a_noise_only_step(log_dir):
    class AlwaysSkips(TinyClassifier):
        def training_step(self, batch, batch_idx):
            return None

    z, C, B = 1.0, 1.0, 4
    model = AlwaysSkips(in_features=200, lr=1.0)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()]).double()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=B, local_steps=1,
                            plugins=[DPSGD(noise_multiplier=z, max_grad_norm=C)])
    fm = trainer.fit(model, tiny_data(num_clients=2, samples=20, dim=200))
    moved = (fm.global_params.double() - before) * B  # one step: N(0, (zC)^2) / B, lr 1
    assert moved.std().item() == pytest.approx(z * C, rel=0.1)


def test_dpsgd_refuses_two_steps_on_one_batch(log_dir):
    class TwoSteps(ManualTiny):
        def training_step(self, batch, batch_idx):
            super().training_step(batch, batch_idx)
            super().training_step(batch, batch_idx)

    with pytest.raises(ConfigError, match="more than once on one batch"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, plugins=[DPSGD(noise_multiplier=1.0)]).fit(
            TwoSteps(), tiny_data())


class ManualTiny(TinyClassifier):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = F.cross_entropy(self(batch[0]), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("my_train_loss", loss)


# ---------------------------------------------------------------------------------------- export, lightning.Trainer after fit
def test_final_checkpoint_loads_with_load_from_checkpoint(log_dir, tmp_path):
    trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=3, final_checkpoint=True, test_after_fit=True,
                            checkpoint_dir=str(tmp_path), plugins=DP_FEDAVG())
    fm = trainer.fit(MLPClassifier(in_features=10, hidden=[8], lr=0.3), tiny_data())
    loaded = MLPClassifier.load_from_checkpoint(str(tmp_path / "final.ckpt"))
    assert loaded.hparams.lr == 0.3
    flat = torch.cat([p.detach().flatten() for p in loaded.parameters()])
    assert torch.equal(flat, fm.global_params)
    path = trainer.save_lightning_checkpoint(str(tmp_path / "again.ckpt"))
    assert torch.load(path, weights_only=False)["epoch"] == 2
    data = tiny_data()
    data.setup()
    results = _lightning_trainer().test(loaded, DataLoader(TensorDataset(*data._test_tensors), batch_size=16),
                                        verbose=False)
    assert results[0]["test_acc"] == pytest.approx(trainer.final_metrics["test_acc"], abs=1e-6)


def test_run_checkpoints_load_with_load_from_checkpoint(log_dir, tmp_path):
    seen = []

    class Spy(FederatedCallback):
        def on_round_end(self, *, server, metrics):
            seen.append(server.global_params.clone())

    for dp in (False, True):
        seen.clear()
        where = tmp_path / str(dp)
        trainer = quiet_trainer(log_dir, rounds=2, clients_per_round=3, checkpoint_every=1, checkpoint_dir=str(where),
                                plugins=[*(DP_FEDAVG() if dp else []), Spy()])
        trainer.fit(MLPClassifier(in_features=10, hidden=[8], lr=0.3), tiny_data())
        # a DP run's checkpoint holds the privacy ledger's records, which torch's weights-only loading refuses
        kw = {"weights_only": False} if dp else {}
        for name, params in (("round-000001.ckpt", seen[0]), ("last.ckpt", seen[1])):
            loaded = MLPClassifier.load_from_checkpoint(str(where / name), **kw)  # Lightning reads the run's file
            assert loaded.hparams.lr == 0.3
            assert torch.equal(torch.cat([p.detach().flatten() for p in loaded.parameters()]), params)


@pytest.mark.parametrize("plugins", [[], DP_FEDAVG(), [DPSGD(noise_multiplier=0.5, fix_model=True)]],
                         ids=["fedavg", "dpfedavg", "dpsgd"])
def test_lightning_trainer_fits_and_tests_the_module_after_a_federated_fit(log_dir, plugins):
    model = ConvBN() if plugins and isinstance(plugins[0], DPSGD) else TinyClassifier()
    data = tiny_data()
    data.setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer(log_dir, rounds=2, clients_per_round=2, plugins=plugins).fit(model, data)
        x, y = data._train_tensors
        loader = DataLoader(TensorDataset(x, y), batch_size=16)
        before = [p.detach().clone() for p in model.parameters()]
        _lightning_trainer(max_epochs=1).fit(model, loader)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        if isinstance(model, TinyClassifier):
            _lightning_trainer().validate(model, loader, verbose=False)


# ---------------------------------------------------------------------------------------- Lightning's demo modules
def _boring_data(num_clients=4):
    from lightning.pytorch.demos.boring_classes import RandomDataset

    torch.manual_seed(0)
    return FederatedDataModule.from_datasets(RandomDataset(32, 64), RandomDataset(32, 16), num_clients=num_clients)


def _boring_loss(model):
    x = _boring_data()._given[0].data
    with torch.no_grad():
        return model.loss(model(x)).item()


# z = 0.05: with 2 clients a round, z = 0.3 leaves a coin flip between learning and not (seed-dependent)
@pytest.mark.parametrize("plugins", [[], [UpdateClipping(1.0), GaussianNoise(noise_multiplier=0.05)],
                                     [DPSGD(noise_multiplier=0.3, max_grad_norm=5.0)]],
                         ids=["fedavg", "dpfedavg", "dpsgd"])
@pytest.mark.parametrize("demo", ["BoringModel", "ManualOptimBoringModel"])
def test_lightning_boring_models(log_dir, demo, plugins):
    from lightning.pytorch.demos import boring_classes

    torch.manual_seed(0)
    model = getattr(boring_classes, demo)()  # StepLR(step_size=1): the lr falls 10x per round
    before = _boring_loss(model)
    public = {"records_per_client": 16} if plugins and isinstance(plugins[0], DPSGD) else {}  # 64 records / 4
    trainer = quiet_trainer(log_dir, rounds=3, batch_size=8, plugins=plugins, **public)
    trainer.fit(model, _boring_data())
    assert _boring_loss(model) < 0.9 * before


# DP-FedAvg on a 1.3M-parameter model with 3 clients: only a tiny noise multiplier leaves any signal
@pytest.mark.parametrize("plugins", [[], [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1e-4)],
                                     [DPSGD(noise_multiplier=0.3)]], ids=["fedavg", "dpfedavg", "dpsgd"])
def test_lightning_transformer_demo(log_dir, plugins):
    from lightning.pytorch.demos import LightningTransformer

    torch.manual_seed(0)
    vocab = 16
    model = LightningTransformer(vocab_size=vocab)
    model.prepare_data = lambda: None  # it downloads WikiText-2 (as lightning.Trainer would): the test brings data
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (24, 5), generator=g)
    data = FederatedDataModule.from_tensors(x, (x + 1) % vocab, num_clients=3)
    loss = lambda: F.nll_loss(model(x, (x + 1) % vocab), ((x + 1) % vocab).view(-1)).item()  # noqa: E731
    model.eval()
    before = loss()
    trainer = quiet_trainer(log_dir, rounds=3, batch_size=4, plugins=plugins)
    if plugins and isinstance(plugins[0], DPSGD):  # Opacus has no per-record gradients for nn.MultiheadAttention
        with pytest.raises(ConfigError, match="DPSGD.*MultiheadAttention") as err:
            trainer.fit(model, data)
        assert "\n" not in str(err.value)
        # fix_model's replacement fails on the demo's causal mask: refused at set-up, the model left as it was
        trainer = quiet_trainer(log_dir, rounds=3, batch_size=4, plugins=[DPSGD(noise_multiplier=0.3, fix_model=True)])
        with pytest.raises(ConfigError, match="DPSGD.fix_model.*is_causal"):
            trainer.fit(model, data)
        assert isinstance(model.model.transformer.encoder.layers[0].self_attn, nn.MultiheadAttention)
        return
    trainer.fit(model, data)
    model.eval()
    assert loss() < before


# ---------------------------------------------------------------------------------------- train/eval modes
class FrozenDropout(L.LightningModule):
    """A net whose dropout the user switched off (eval mode) in __init__: lightning.Trainer keeps it
    off in training and after evaluation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3))
        self.net[1].eval()
        self.modes_in_training: set[tuple[bool, bool]] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.modes_in_training.add((self.net[0].training, self.net[1].training))
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_submodule_modes_are_kept_as_under_lightning(log_dir):
    x, y = torch.randn(40, 5) * 3 + 1, torch.randint(0, 3, (40,))
    ref = FrozenDropout()
    with pytest.warns(UserWarning, match="1 module\\(s\\) in eval mode at the start of training"):
        _lightning_trainer(limit_val_batches=1).fit(ref, DataLoader(TensorDataset(x, y), batch_size=10),
                                                    DataLoader(TensorDataset(x, y), batch_size=10))
    assert ref.modes_in_training == {(True, False)} and not ref.net[1].training

    ours = FrozenDropout()
    data = FederatedDataModule.from_tensors(x, y, num_clients=4, partition="iid", seed=0)
    t = quiet_trainer(log_dir, rounds=2, clients_per_round=2, eval_every=1)
    with pytest.warns(UserWarning, match="1 module\\(s\\) in eval mode at the start of training"):
        t.fit(ours, data)
    assert ours.modes_in_training == ref.modes_in_training
    assert not ours.net[1].training and ours.net[0].training


class OutputsSpy(TinyClassifier):
    """Returns a dict with an extra key and records what on_train_batch_end receives."""

    def __init__(self, as_dict: bool, **kw):
        super().__init__(**kw)
        self.as_dict, self.seen = as_dict, []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.raw = loss.item()
        return {"loss": loss, "n": len(batch[0])} if self.as_dict else loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        ratio = round(outputs["loss"].item() / self.raw, 5)  # 1 / accumulate_grad_batches
        self.seen.append((type(outputs).__name__, sorted(outputs), outputs["loss"].requires_grad, ratio))


@pytest.mark.parametrize("as_dict", [False, True])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_on_train_batch_end_gets_lightnings_outputs(log_dir, as_dict, accumulate):
    data = tiny_data(num_clients=2)
    ref = OutputsSpy(as_dict)
    loader = DataLoader(TensorDataset(*data.in_memory_tensors), batch_size=8)
    _lightning_trainer(accumulate_grad_batches=accumulate, limit_train_batches=2).fit(ref, loader)
    ours = OutputsSpy(as_dict)
    quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=8, local_steps=2,
                  accumulate_grad_batches=accumulate).fit(ours, data)
    assert ours.seen == ref.seen


class LbfgsClassifier(TinyClassifier):
    """L-BFGS re-evaluates the closure within one step: it must get the closure, as under Lightning."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


def test_an_optimizer_that_reevaluates_the_closure_gets_it(log_dir):
    data = tiny_data(num_clients=1, samples=12)
    fed = LbfgsClassifier()
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=12, exact_aggregation=False)
    trainer.fit(fed, data)
    x, y = data.in_memory_tensors
    ref = LbfgsClassifier()
    _lightning_trainer().fit(ref, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=12))
    assert fed.calls == ref.calls > 1  # one optimizer step, several closure evaluations
    for a, b in zip(fed.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_training_enables_gradients_when_fit_is_called_without_them(log_dir):
    # The local step runs training_step and backward with gradients on, as optimizer.step(closure)
    # does, even inside torch.no_grad() (where a plain backward would fail).
    model = TinyClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        quiet_trainer(log_dir, rounds=1, clients_per_round=2).fit(model, tiny_data())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class StepHookOrder(TinyClassifier):
    """Records the order of the optimizer's step hooks, training_step and on_before_optimizer_step,
    and whether gradients are on in on_before_optimizer_step."""

    def __init__(self):
        super().__init__()
        self.events = []

    def training_step(self, batch, batch_idx):
        self.events.append("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        self.events.append(("on_before_optimizer_step", torch.is_grad_enabled()))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        opt.register_step_pre_hook(lambda o, args, kwargs: self.events.append(("pre", sorted(kwargs))))
        opt.register_step_post_hook(lambda o, args, kwargs: self.events.append("post"))
        return opt


def test_optimizer_step_hooks_run_in_lightnings_order(log_dir):
    data = tiny_data(num_clients=1, samples=12)
    ours = StepHookOrder()
    quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=6).fit(ours, data)
    x, y = data.in_memory_tensors
    ref = StepHookOrder()
    _lightning_trainer().fit(ref, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6))
    assert ours.events == ref.events
    assert ours.events[:4] == [("pre", ["closure"]), "training_step", ("on_before_optimizer_step", True), "post"]


def test_before_step_hooks_see_gradients_on_when_fit_is_called_without_them(log_dir):
    model = StepHookOrder()
    with torch.no_grad():
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=6).fit(model, tiny_data(num_clients=1, samples=12))
    # with step hooks the closure goes through optimizer.step; the next test covers the direct path
    assert [e for e in model.events if isinstance(e, tuple) and e[0] == "on_before_optimizer_step"] == \
        [("on_before_optimizer_step", True)] * 2


class NoHooksGradSpy(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.grad_on = []

    def on_before_optimizer_step(self, optimizer):
        self.grad_on.append(torch.is_grad_enabled())


def test_before_step_hooks_see_gradients_on_in_the_direct_path_too(log_dir):
    model = NoHooksGradSpy()
    with torch.no_grad():
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=6).fit(model, tiny_data(num_clients=1, samples=12))
    assert model.grad_on == [True, True]


class SgdVariant(TinyClassifier):
    """Two parameter groups with their own lr, a parameter that never gets a gradient, and an
    optimizer built by ``make`` (with or without a no-op post-hook, which makes the loop call
    ``optimizer.step()`` itself)."""

    def __init__(self, make, post_hook: bool):
        super().__init__()
        self.unused = nn.Parameter(torch.ones(3))
        self.make, self.post_hook, self.hook_calls = make, post_hook, 0

    def configure_optimizers(self):
        opt = self.make([{"params": self.net[0].parameters(), "lr": 0.3},
                         {"params": list(self.net[2].parameters()) + [self.unused]}])
        if self.post_hook:
            opt.register_step_post_hook(lambda *a: setattr(self, "hook_calls", self.hook_calls + 1))
            opt.zero_grad = opt.zero_grad  # on the instance: the loop calls it rather than set grads to None
        return opt


def _step_ranges(model, log_dir, lr_scheduler=None) -> int:
    """Trains 2 rounds with the sequential executor (the loop under test; vmap steps one optimizer for
    a chunk of clients); the number of ``Optimizer.step#`` profiler ranges, which only the
    optimizer's own ``step`` opens."""
    with torch.autograd.profiler.profile() as prof:
        quiet_trainer(log_dir, rounds=2, clients_per_round=2, batch_size=6, executor="sequential").fit(
            model, tiny_data(num_clients=3, samples=12))
    return sum(e.name.startswith("Optimizer.step#") for e in prof.function_events)


@pytest.mark.parametrize("make, direct", [
    (lambda groups: torch.optim.SGD(groups, lr=0.1), True),
    (lambda groups: torch.optim.SGD(groups, lr=1), True),  # an int lr: SGD's alpha=-1, the same bits
    (lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9), False),
    (lambda groups: torch.optim.SGD(groups, lr=0.1, weight_decay=1e-2, nesterov=False), False),
    (lambda groups: torch.optim.SGD(groups, lr=0.1, maximize=True), False),
    (lambda groups: torch.optim.SGD(groups, lr=0.1, foreach=True), False),
    (lambda groups: torch.optim.Adam(groups, lr=0.01), False),
])
def test_a_plain_sgd_step_computed_by_the_loop_gives_the_bits_of_sgd_step(log_dir, make, direct):
    # The reference calls optimizer.step() and optimizer.zero_grad() (a post-hook and a zero_grad on
    # the instance force that); the model trained without them must end bit for bit equal, and only
    # plain SGD may skip optimizer.step's own bookkeeping.
    ours, ref = SgdVariant(make, post_hook=False), SgdVariant(make, post_hook=True)
    ranges = _step_ranges(ours, log_dir)
    ref_ranges = _step_ranges(ref, log_dir)
    assert ref.hook_calls == ref_ranges == 8  # 2 rounds x 2 clients x 2 steps, all through step()
    assert ranges == (0 if direct else 8)
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(ours.unused, torch.ones(3))


class StepLrSgd(TinyClassifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                   "interval": "step"}}


def test_a_step_scheduler_sees_plain_sgd_steps_taken_by_the_loop(log_dir):
    # torch's scheduler warns when it steps before its optimizer did; the loop's SGD step counts.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = StepLrSgd()
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=6).fit(model, tiny_data(num_clients=1, samples=12))
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]


class CountingZeroGrad(torch.optim.SGD):
    calls = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        CountingZeroGrad.calls += 1
        super().zero_grad(set_to_none)


class OwnZeroGrad(TinyClassifier):
    def configure_optimizers(self):
        return CountingZeroGrad(self.parameters(), lr=0.1)


def test_an_optimizer_with_its_own_zero_grad_has_it_called_every_step(log_dir):
    CountingZeroGrad.calls = 0
    quiet_trainer(log_dir, rounds=2, clients_per_round=2, batch_size=6).fit(OwnZeroGrad(), tiny_data(num_clients=3, samples=12))
    assert CountingZeroGrad.calls == 8


class OwnStepUnderScheduler(TinyClassifier):
    """A ``step`` replaced on the optimizer instance, then wrapped by an LR scheduler's counter."""

    def __init__(self):
        super().__init__()
        self.own_steps = 0

    def configure_optimizers(self):
        import types

        opt = torch.optim.SGD(self.parameters(), lr=0.1)

        def own_step(optimizer, closure=None):
            self.own_steps += 1
            return torch.optim.SGD.step(optimizer, closure)

        opt.step = types.MethodType(own_step, opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                   "interval": "step"}}


def test_a_step_replaced_on_the_optimizer_runs_even_under_a_schedulers_wrapper(log_dir):
    model = OwnStepUnderScheduler()
    quiet_trainer(log_dir, rounds=2, clients_per_round=2, batch_size=6).fit(model, tiny_data(num_clients=3, samples=12))
    assert model.own_steps == 8


class RegistersAPreHookInItsFirstStep(TinyClassifier):
    """At its first training_step it registers step pre-hooks on its optimizer and globally, which
    record the optimizer steps they see."""

    def __init__(self, make):
        super().__init__()
        self.make = make
        self.calls: list[str] = []
        self.handles = []

    def configure_optimizers(self):
        return self.make(self.parameters())

    def training_step(self, batch, batch_idx):
        if not self.handles:
            self.register(self.optimizers().optimizer)
        return super().training_step(batch, batch_idx)

    def register(self, opt):
        self.handles = [opt.register_step_pre_hook(lambda o, a, k: self.calls.append("own")),
                        register_optimizer_step_pre_hook(lambda o, a, k: self.calls.append("global"))]


class RemovesItsPreHookAfterTheFirstStep(RegistersAPreHookInItsFirstStep):
    """... and a post-hook that removes the pre-hook: the pre-hook never runs."""

    def register(self, opt):
        pre = opt.register_step_pre_hook(lambda o, a, k: self.calls.append("pre"))

        def post(o, a, k):
            self.calls.append("post")
            pre.remove()

        self.handles = [pre, opt.register_step_post_hook(post)]


class StepsASecondOptimizerInAPostHook(RegistersAPreHookInItsFirstStep):
    """A post-hook steps a second optimizer; the global pre-hook from the first training_step sees
    that step already (it was registered before it)."""

    def configure_optimizers(self):
        opt = self.make(self.net[0].parameters())
        second = torch.optim.SGD(self.net[2].parameters(), lr=0.01)
        self.handles_post = opt.register_step_post_hook(lambda o, a, k: second.step())
        return opt

    def register(self, opt):
        self.handles = [self.handles_post,
                        register_optimizer_step_pre_hook(lambda o, a, k: self.calls.append(type(o).__name__))]


@pytest.mark.parametrize("model,expected", [
    (RegistersAPreHookInItsFirstStep, ["global", "own"] * 2),  # 3 steps; the hooks see the other two
    (RemovesItsPreHookAfterTheFirstStep, ["post"] * 3),
    (StepsASecondOptimizerInAPostHook, ["SGD", "Adam", "SGD", "Adam", "SGD"]),
], ids=["own-and-global", "removed-by-a-post-hook", "nested-step"])
@pytest.mark.parametrize("make", [lambda p: torch.optim.Adam(p, lr=0.01), lambda p: torch.optim.SGD(p, lr=0.1)],
                         ids=["adam", "plain-sgd"])  # optimizer.step(), and the step computed by the loop
def test_step_hooks_registered_in_training_step_run_as_under_lightning(log_dir, model, expected, make):
    data = tiny_data(num_clients=1, samples=12)
    data.setup()
    x, y = data.in_memory_tensors
    got = {}
    for who in ("lightning", "dpfl"):
        m = model(make)
        try:
            if who == "lightning":
                loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
                _lightning_trainer().fit(m, loader)
            else:
                quiet_trainer(log_dir, rounds=1, clients_per_round=1, batch_size=4).fit(m, data)
        finally:
            for h in m.handles:
                h.remove()
        got[who] = m.calls
    expected = [type(make([torch.nn.Parameter(torch.zeros(1))])).__name__ if c == "Adam" else c for c in expected]
    assert got["lightning"] == expected
    assert got["dpfl"] == got["lightning"]


def test_on_train_epoch_end_before_the_round_s_validation_is_said_at_set_up(log_dir):
    class EpochEnd(TinyClassifier):
        def on_train_epoch_end(self):
            self.seen = dict(self.trainer.callback_metrics)

    with pytest.warns(RuntimeWarning, match="on_train_epoch_end runs when each client's local training of the round "
                                            "ends, before the round's validation"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2).fit(EpochEnd(), tiny_data(num_clients=4))
    with warnings.catch_warnings(record=True) as caught:  # a module without the hook hears nothing of it
        warnings.simplefilter("always")
        quiet_trainer(log_dir, rounds=1, clients_per_round=2).fit(TinyClassifier(), tiny_data(num_clients=4))
    assert not any("on_train_epoch_end" in str(w.message) for w in caught)
