"""Under two ranks, a correlated-noise run (cyclic groups, the factor computed on every rank with one
thread, the noise keyed by round) is bit-identical to one process."""

import os

import pytest
import torch

from dpfl_lightning.plugins import CorrelatedNoise, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, tiny_data


def _fit(log_dir, communicator, strategy, cache):
    cn = CorrelatedNoise(strategy, noise_multiplier=0.8, cache_dir=cache)
    trainer = quiet_trainer(log_dir, rounds=5, sampling="cyclic", clients_per_round=6, communicator=communicator,
                            seed=3, plugins=[UpdateClipping(0.5), cn])
    return trainer, trainer.fit(TinyClassifier(), tiny_data(num_clients=15))


@pytest.mark.parametrize("strategy", ["banded", "blt", "tree"])
def test_two_ranks_bit_identical_to_one(shared_tmp, comm, strategy):
    two, m2 = _fit(os.path.join(shared_tmp, "two"), "auto", strategy, os.path.join(shared_tmp, "cache2"))
    assert two.world_size == 2
    rank = comm.Get_rank()
    one, m1 = _fit(os.path.join(shared_tmp, f"one{rank}"), "local", strategy, os.path.join(shared_tmp, f"cache{rank}"))
    assert torch.equal(m2.global_params, m1.global_params)
    everyone = comm.allgather(m2.global_params.numpy().tobytes())
    assert everyone[0] == everyone[1]
    assert two.epsilon() == one.epsilon()
