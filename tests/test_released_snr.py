"""The logged ``snr`` is the estimate from the noised sum that moved the model.

The expected value is computed here from the model alone: with FedAvg (server SGD, lr 1) and
uniform sampling of ``m`` clients, the global model moves by the noised sum divided by ``m``, so
``(w_{t+1} - w_t) * m`` is the noised sum, and ``sqrt(max(||s||^2 - d sigma^2, 0)) / (sigma sqrt d)``
its signal-to-noise estimate (paper 003 Fig. 3).
"""

import math

import pytest
import torch

from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import TinyClassifier, quiet_trainer, tiny_data


class GlobalModelPerRound(FederatedCallback):
    """The global model before each round and after it (public state, not a client's update)."""

    order = 10_000

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []

    def before_round(self, *, plan, server) -> None:
        self.before.append(server.global_params.detach().double().clone())

    def on_round_end(self, *, server, metrics) -> None:
        self.after.append(server.global_params.detach().double().clone())


def _snr_from_model_change(before, after, m, sigma):
    noised_sum = (after - before) * m
    d = noised_sum.numel()
    return math.sqrt(max(float(noised_sum.norm()) ** 2 - d * sigma**2, 0.0)) / (sigma * math.sqrt(d))


@pytest.mark.parametrize("placement", ["central", "distributed"])
def test_logged_snr_matches_the_noised_sum_that_moved_the_model(log_dir, placement):
    m, C, z = 5, 1.0, 0.05
    seen = GlobalModelPerRound()
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=m, seed=3,
                            plugins=[UpdateClipping(C), GaussianNoise(noise_multiplier=z, placement=placement), seen])
    trainer.fit(TinyClassifier(lr=0.5), tiny_data())
    logged = [row["snr"] for row in trainer.history]
    expected = [_snr_from_model_change(b, a, m, z * C) for b, a in zip(seen.before, seen.after)]
    assert min(expected) > 0.5  # a signal the estimate can see, so a logged 0 would fail
    assert logged == pytest.approx(expected, rel=1e-4)
