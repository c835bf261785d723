"""Frozen parameters are not part of a round's update: under every DP placement, adaptive clipping,
PrivUnit and a stateful server optimizer a frozen backbone stays bit-identical while the head
trains, the noise dimension is the trainable part's, and a layer unfrozen during training joins
from the next round on."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning as L
from dpfl_lightning.algorithms import AdaptiveClipping, DPFedAvg, LDPFedEXP
from dpfl_lightning.plugins import GaussianNoise, ServerOptimizer, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import quiet_trainer, tiny_data


class FrozenBackbone(L.LightningModule):
    """A pretrained-backbone-and-head fine-tuning model, written as a user would."""

    def __init__(self, unfreeze_at_epoch: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(10, 16)
        self.head = nn.Linear(16, 10)
        self.backbone.requires_grad_(False)
        self.unfreeze_at_epoch = unfreeze_at_epoch

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))

    def on_train_epoch_start(self):
        if self.unfreeze_at_epoch is not None and self.current_epoch >= self.unfreeze_at_epoch:
            self.backbone.requires_grad_(True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(log_dir, model, rounds=3, **kw):
    kw.setdefault("clients_per_round", 5)
    t = quiet_trainer(log_dir, rounds=rounds, **kw)
    t.fit(model, tiny_data(num_clients=10))
    return t


def _backbone(model):
    return torch.cat([model.backbone.weight.detach().reshape(-1), model.backbone.bias.detach()]).clone()


@pytest.mark.parametrize("algorithm", [
    lambda: DPFedAvg(clip=0.5, noise_multiplier=0.5),
    lambda: DPFedAvg(clip=0.5, noise_multiplier=0.5, placement="distributed"),
    lambda: DPFedAvg(clip=0.5, noise_multiplier=0.5, placement="local"),
    lambda: DPFedAvg(clip=0.5, noise_multiplier=0.5, server_momentum=0.9),
    lambda: AdaptiveClipping(noise_multiplier=0.5, count_noise=2.0, initial_clip=0.1),
    lambda: LDPFedEXP(clip=0.5, randomizer="privunit"),
], ids=["central", "distributed", "local", "server_momentum", "adaptive_clip", "privunit"])
def test_a_frozen_backbone_stays_bit_identical_under_dp(log_dir, algorithm):
    model = FrozenBackbone()
    before, head = _backbone(model), model.head.weight.detach().clone()
    _fit(log_dir, model, algorithm=algorithm())
    assert torch.equal(_backbone(model), before)  # not noised, not moved
    assert not torch.equal(model.head.weight.detach(), head)  # the head trained (and was noised)


class _Seen(FederatedCallback):
    """Records every client's update after the noise plugins."""

    order = 300

    def __init__(self):
        self.updates = []

    def on_client_end(self, *, client) -> None:
        self.updates.append(client.payload["update"].detach().clone())


def test_local_noise_covers_exactly_the_trainable_part(log_dir):
    seen = _Seen()
    model = FrozenBackbone()
    _fit(log_dir, model, rounds=1, plugins=[UpdateClipping(0.5), GaussianNoise(noise_multiplier=4.0, placement="local"),
                                            seen])
    trainable = sum(p.numel() for p in model.head.parameters())
    for u in seen.updates:  # the update holds the trainable entries only: the backbone is not sent
        assert u.numel() == trainable
        assert 4.0 * 0.5 * 0.8 < float(u.std()) < 4.0 * 0.5 * 1.2  # N(0, (z C)^2) on the trainable part


def test_a_layer_unfrozen_during_a_round_joins_from_the_next_round(log_dir):
    # unfrozen by the module in round 2 (epoch 2): trainable then, but frozen when round 2 started
    model = FrozenBackbone(unfreeze_at_epoch=2)
    before = _backbone(model)
    _fit(log_dir, model, rounds=3, algorithm=DPFedAvg(clip=0.5, noise_multiplier=0.5))
    assert torch.equal(_backbone(model), before)
    model = FrozenBackbone(unfreeze_at_epoch=2)
    _fit(log_dir, model, rounds=4, algorithm=DPFedAvg(clip=0.5, noise_multiplier=0.5))
    assert not torch.equal(_backbone(model), before)


def test_without_frozen_parameters_the_noise_is_unchanged(log_dir):
    # the frozen path is not taken when everything trains: the same bits as noising the whole vector
    model = FrozenBackbone()
    model.backbone.requires_grad_(True)
    seen = _Seen()
    _fit(log_dir, model, rounds=1, plugins=[UpdateClipping(0.5), GaussianNoise(noise_multiplier=1.0, placement="local"),
                                            seen, ServerOptimizer("sgd", lr=1.0)])
    assert all(torch.count_nonzero(u) == u.numel() for u in seen.updates)


class _FrozenNoEpochHook(FrozenBackbone):
    """The same model without the epoch hook, which the vectorised executor does not run."""

    on_train_epoch_start = L.LightningModule.on_train_epoch_start


def test_vmap_refuses_frozen_parameters_at_set_up(log_dir):
    # the vectorised step computes and applies every parameter's gradient: a frozen backbone would
    # train, so the run is refused before the first round (the sequential executor keeps it frozen)
    from dpfl_lightning import ConfigError

    model = _FrozenNoEpochHook()
    with pytest.raises(ConfigError, match=r"trainer.executor='vmap': frozen parameters \['backbone.weight', "
                                          r"'backbone.bias'\] would be trained. Fix: use executor='sequential'"):
        _fit(log_dir, model, plugins=[UpdateClipping(0.5), GaussianNoise(noise_multiplier=0.5)], executor="vmap")
