"""executor="auto": the vmap executor where it runs the module and its plugins with the
sequential executor's bits, the sequential one otherwise, with the reason in the summary and the
logged hyperparameters."""

import glob
import os

import pytest
import torch
import yaml

import behaviour
from dpfl_lightning.algorithms import PFL
from helpers import TinyClassifier, quiet_trainer, tiny_data
from test_executor import Frozen

# The shipped configs that name no executor and for which auto picks vmap in this environment
# (checked by the first test); the others name vmap, or auto picks sequential (DP-SGD, batch_size=None,
# or mnist_dpfedavg's 784-wide MLP, whose batched matmul differs in the last bits).
PICKS_VMAP = ["configs/adaptive_clipping_digits.yaml", "configs/npz_fedavg.yaml", "configs/quickstart.yaml",
              "configs/sweeps/paper000_base.yaml"]


class CountsEpochs(TinyClassifier):
    def on_train_epoch_start(self):
        self.epochs = getattr(self, "epochs", 0) + 1


def _choice(log_dir, model, **kw):
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=3, executor="auto", **kw)
    t.fit(model, tiny_data())
    return t.executor.choice


def test_auto_picks_vmap_for_a_vmap_friendly_module(log_dir):
    assert _choice(log_dir, TinyClassifier()) == "vmap"


@pytest.mark.parametrize("model,kw,reason", [
    (Frozen, {}, "frozen parameters"),
    (CountsEpochs, {}, "on_train_epoch_start"),
    (TinyClassifier, {"algorithm": PFL(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)}, "DPSGD"),
    (TinyClassifier, {"batch_size": None}, "batch_size=None"),
])
def test_auto_picks_sequential_with_the_reason_for_what_vmap_refuses(log_dir, model, kw, reason):
    choice = _choice(log_dir, model(), **kw)
    assert choice.startswith("sequential (vmap cannot run: ") and reason in choice, choice


def test_auto_runs_a_module_vmap_refuses_like_the_sequential_executor(log_dir):
    out = {}
    for ex in ("auto", "sequential"):
        torch.manual_seed(0)
        t = quiet_trainer(log_dir, rounds=2, clients_per_round=3, executor=ex)
        out[ex] = t.fit(CountsEpochs(), tiny_data()).global_params.clone()
    assert torch.equal(out["auto"], out["sequential"])


def test_the_summary_and_the_logged_hyperparameters_carry_the_choice(log_dir, capsys):
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=3, executor="auto", enable_summary=True)
    t.fit(Frozen(), tiny_data())
    printed = "".join(capsys.readouterr())
    assert "executor" in printed and "vmap cannot run" in printed
    [hparams] = glob.glob(os.path.join(log_dir, "**", "hparams.yaml"), recursive=True)
    with open(hparams) as f:
        logged = yaml.safe_load(f)
    assert logged["executor_choice"].startswith("sequential (vmap cannot run: frozen parameters")


@pytest.mark.parametrize("key", PICKS_VMAP)
def test_auto_gives_the_sequential_executors_bits_on_the_shipped_configs_it_picks_vmap_for(key):
    with open(os.path.join(behaviour.ROOT, key)) as f:
        assert "executor" not in (yaml.safe_load(f).get("trainer") or {})  # auto would choose
    sequential = behaviour.fresh_run_config(key, ("--trainer.executor", "sequential"))
    auto = behaviour.fresh_run_config(key, ("--trainer.executor", "auto"))
    vmap = behaviour.fresh_run_config(key, ("--trainer.executor", "vmap"))
    assert auto["sha256"] == sequential["sha256"] == vmap["sha256"]  # vmap's own bits: auto did pick it
    assert auto["epsilon"] == sequential["epsilon"]


class SkipsLater(TinyClassifier):
    """Skips every batch from the second round on (returns None): vmap would refuse mid-run."""

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= 1:
            return None
        return super().training_step(batch, batch_idx)


class BranchInAHelper(TinyClassifier):
    def training_step(self, batch, batch_idx):
        return self.shared_step(batch)

    def shared_step(self, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        return loss * 0.5 if self.global_step > 3 else loss


class StraightThroughHelper(TinyClassifier):
    def training_step(self, batch, batch_idx):
        return self.shared_step(batch)

    def shared_step(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)


def test_auto_trains_a_step_that_skips_later_sequentially_with_the_sequential_bits(log_dir):
    # the planted case: the vmap executor accepts this module at set-up and refuses it in round 2
    with pytest.raises(Exception, match="training_step returned None"):
        quiet_trainer(log_dir, rounds=2, clients_per_round=3, executor="vmap").fit(SkipsLater(), tiny_data())
    out, choice = {}, None
    for ex in ("auto", "sequential"):
        torch.manual_seed(0)
        t = quiet_trainer(log_dir, rounds=2, clients_per_round=3, executor=ex)
        out[ex] = t.fit(SkipsLater(), tiny_data()).global_params.clone()
        choice = choice or t.executor.choice
    assert choice.startswith("sequential (vmap cannot run: training_step has if (line "), choice
    assert torch.equal(out["auto"], out["sequential"])


def test_auto_reads_the_methods_training_step_calls(log_dir):
    choice = _choice(log_dir, BranchInAHelper())
    assert "shared_step has a conditional expression" in choice, choice
    assert _choice(log_dir, StraightThroughHelper()) == "vmap"


def test_auto_is_the_default_executor(log_dir):
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=3)
    t.fit(TinyClassifier(), tiny_data())
    assert t.settings.executor == "auto" and t.executor.choice == "vmap"


class HookedOptimizer(TinyClassifier):
    """A step post-hook on the optimizer: under lightning.Trainer it runs at every step."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        opt.register_step_post_hook(lambda *a: setattr(self, "hook_calls", getattr(self, "hook_calls", 0) + 1))
        return opt


def test_an_optimizer_with_hooks_trains_sequentially_and_its_hooks_run(log_dir):
    # vmap steps its own optimizer of the same class: the user's hook would silently not run
    model = HookedOptimizer()
    choice = _choice(log_dir, model)
    assert "step post-hooks" in choice and choice.startswith("sequential"), choice
    assert model.hook_calls > 0
    with pytest.raises(Exception, match="step post-hooks"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=3, executor="vmap").fit(HookedOptimizer(), tiny_data())
