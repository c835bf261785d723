"""Under two ranks: DiscreteDistributedNoise's modular sum (masks, dropouts) is bit-identical to one process."""

import os

import torch

from dpfl_lightning.plugins import DiscreteDistributedNoise, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, tiny_data


def _fit(log_dir, communicator, mechanism):
    noise = DiscreteDistributedNoise(mechanism, noise_multiplier=0.5, bits=20, dropout=0.2, min_survivors=3)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=7, communicator=communicator, seed=4,
                            plugins=[UpdateClipping(0.5), noise])
    return trainer, trainer.fit(TinyClassifier(), tiny_data(num_clients=15))


def test_discrete_noise_two_ranks_bit_identical_to_one(shared_tmp, comm):
    for mechanism in ("discrete_gaussian", "skellam"):
        two, m2 = _fit(os.path.join(shared_tmp, f"two-{mechanism}"), "auto", mechanism)
        assert two.world_size == 2
        one, m1 = _fit(os.path.join(shared_tmp, f"one-{mechanism}{comm.Get_rank()}"), "local", mechanism)
        assert torch.equal(m2.global_params, m1.global_params)
        assert [h["epsilon"] for h in two.history] == [h["epsilon"] for h in one.history]
        everyone = comm.allgather(m2.global_params.numpy().tobytes())
        assert everyone[0] == everyone[1]
