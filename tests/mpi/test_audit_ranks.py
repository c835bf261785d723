"""Under two ranks: canary clients (slots, directions, coins, scores) and the audit are those of one process."""

import os

import torch

from dpfl_lightning.algorithms import DPFedAvg
from dpfl_lightning.plugins.canary import CanaryClients
from helpers import TinyClassifier, quiet_trainer, tiny_data


def _fit(log_dir, communicator):
    canaries = CanaryClients(canaries=8)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=7, communicator=communicator, seed=3,
                            algorithm=DPFedAvg(clip=0.5, noise_multiplier=0.8),
                            plugins=[canaries, canaries.message_reader()])
    trainer.fit(TinyClassifier(), tiny_data(num_clients=15))
    return trainer, canaries


def test_canary_audit_does_not_depend_on_the_number_of_ranks(shared_tmp, comm):
    two, c2 = _fit(os.path.join(shared_tmp, "two"), "auto")
    assert two.world_size == 2
    one, c1 = _fit(os.path.join(shared_tmp, f"one{comm.Get_rank()}"), "local")
    assert c2.slots == c1.slots and torch.equal(c2.is_inserted, c1.is_inserted)
    for name in ("final", "rounds"):
        assert torch.equal(c2.scores[name], c1.scores[name])
    assert c2.noise["sum"][1].sum() > 0  # the noise check read the noised sum, the same under both
    assert torch.allclose(c2.noise["sum"], c1.noise["sum"], rtol=1e-6)
    assert {k: v for k, v in two.history[-1].items() if k.startswith("audit_eps")} == \
        {k: v for k, v in one.history[-1].items() if k.startswith("audit_eps")}
