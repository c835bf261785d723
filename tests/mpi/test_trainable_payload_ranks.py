"""Under two ranks, a run with a frozen base (a LoRA-like model) is bit-identical to one process; a
private run's payload, and so each rank's all-reduce, holds the adapter's entries only, a run
without DP sends the whole update (zero at frozen entries)."""

import os

import pytest
import torch

from dpfl_lightning.algorithms import DPFedAvg
from dpfl_lightning.plugins import ServerOptimizer, UpdateClipping
from helpers import quiet_trainer, tiny_data
from test_trainable_payload import LoRANet, adapter_count


def _fit(log_dir, communicator, plugins):
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=7, communicator=communicator, seed=0, **plugins)
    model = LoRANet()
    base = [p.detach().clone() for p in model.base_parameters()]
    module = trainer.fit(model, tiny_data(num_clients=15))
    assert all(torch.equal(p, q) for p, q in zip(model.base_parameters(), base))  # frozen: bit-identical
    return trainer, module


@pytest.mark.parametrize("plugins", [
    lambda: {"algorithm": DPFedAvg(clip=0.5, noise_multiplier=0.4, placement="distributed")},
    lambda: {"plugins": [UpdateClipping(0.5), ServerOptimizer("sgd", lr=1.0, momentum=0.5)]},
], ids=["dp_distributed", "clip_momentum"])
def test_two_ranks_bit_identical_to_one_with_a_frozen_base(shared_tmp, comm, plugins):
    two, m2 = _fit(os.path.join(shared_tmp, "two"), "auto", plugins())
    assert two.world_size == 2
    private = "algorithm" in plugins()
    sent = adapter_count(m2.inner) if private else sum(p.numel() for p in m2.inner.parameters())
    assert two.aggregator.layout.segment("update").size == sent
    one, m1 = _fit(os.path.join(shared_tmp, f"one{comm.Get_rank()}"), "local", plugins())
    assert torch.equal(m2.global_params, m1.global_params)
    everyone = comm.allgather(m2.global_params.numpy().tobytes())
    assert everyone[0] == everyone[1]
