"""DP-SGD's own rules on the local loop (they live in DPSGD; the loop honours them without knowing
DP-SGD): one optimizer, one step per batch, no clipping of the batch gradient."""

import pytest
import torch
import torch.nn.functional as F

from dpfl_lightning import ConfigError, FederatedLightningModule
from dpfl_lightning.plugins import DPSGD
from helpers import TinyClassifier, quiet_trainer, tiny_data


class TwoOptimizers(TinyClassifier):
    """Manual optimization with one optimizer per layer, each stepped once per batch."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.steps = 0

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]

    def training_step(self, batch, batch_idx):
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
            opt.step()
            self.steps += 1


class StepsTheRawOptimizerTwice(TinyClassifier):
    """Manual optimization stepping the optimizer itself (not through ``self.optimizers()``'s wrapper)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers(use_pl_optimizer=False)
        for _ in range(2):
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
            opt.step()


def test_dpsgd_refuses_a_second_optimizer_at_set_up_and_only_in_its_run(log_dir):
    model = TwoOptimizers()
    fm = FederatedLightningModule(model)
    with pytest.raises(ConfigError, match="a second DP optimizer would release every batch twice"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, plugins=[DPSGD(noise_multiplier=1.0)]).fit(fm, tiny_data())
    assert model.steps == 0  # refused before any client trained
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=2, local_steps=2)
    trainer.fit(fm, tiny_data())  # the rule went with the DPSGD run
    assert model.steps == 2 * 2 * 2 and len(trainer.history) == 1


def test_dpsgd_counts_the_steps_of_its_optimizer_however_it_is_stepped(log_dir):
    with pytest.raises(ConfigError, match="more than once on one batch"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, plugins=[DPSGD(noise_multiplier=1.0)]).fit(
            StepsTheRawOptimizerTwice(), tiny_data())
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=1, local_steps=2)
    trainer.fit(StepsTheRawOptimizerTwice(), tiny_data())  # without DP-SGD, two steps per batch are the module's own
    assert len(trainer.history) == 1


@pytest.mark.parametrize("kw,match", [(dict(gradient_clip_val=0.5), "gradient_clip_val=0.5: DPSGD clips every record"),
                                      (dict(accumulate_grad_batches=2), "accumulate_grad_batches=2: DPSGD's accountant")])
def test_dpsgd_refuses_local_loop_settings_before_it_changes_the_model(log_dir, kw, match):
    model = TinyClassifier()
    model.norm = torch.nn.BatchNorm1d(4)  # a layer fix_model would replace
    with pytest.raises(ConfigError, match=match):
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, plugins=[DPSGD(noise_multiplier=1.0, fix_model=True)],
                      **kw).fit(model, tiny_data())
    assert type(model.norm) is torch.nn.BatchNorm1d  # the module as the user built it


class ClipsWithTorch(TinyClassifier):
    """A ``configure_gradient_clipping`` that clips the batch gradient with torch directly."""

    def __init__(self, max_norm=1e-3):
        super().__init__(lr=1.0)
        self.max_norm = max_norm

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_norm_(self.parameters(), self.max_norm)


def test_dpsgd_refuses_a_configure_gradient_clipping_that_clips_with_torch_before_the_step(log_dir):
    model = ClipsWithTorch()
    start = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"model.configure_gradient_clipping='changes p.grad': DP-SGD clips every "
                                          r"record's gradient.*Fix: remove the clipping.*max_grad_norm"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, plugins=[DPSGD(noise_multiplier=1.0)]).fit(
            model, tiny_data())
    assert all(torch.equal(p.detach(), s) for p, s in zip(model.parameters(), start))  # refused before any step
    # a bound that no gradient reaches is refused too: torch writes p.grad whatever the norm
    with pytest.raises(ConfigError, match="configure_gradient_clipping"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=1, plugins=[DPSGD(noise_multiplier=1.0)]).fit(
            ClipsWithTorch(max_norm=1e9), tiny_data())
    # without DP-SGD the override clips, as under lightning.Trainer: one step of lr 1 moves by at most max_norm
    model = ClipsWithTorch()
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    quiet_trainer(log_dir, rounds=1, clients_per_round=1, local_steps=1).fit(model, tiny_data())
    moved = (torch.cat([p.detach().flatten() for p in model.parameters()]) - start).norm()
    assert 0 < moved <= 1e-3 * (1 + 1e-5)
