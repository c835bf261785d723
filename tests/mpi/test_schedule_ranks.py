"""Under two ranks: what clients carry across rounds (a warm-up set in optimizer_step, the clients'
agreement on it) gives what one process gives."""

import os
import warnings

import pytest
import torch

from helpers import TinyClassifier, quiet_trainer, tiny_data


class WarmUp(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.seen = []

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        for pg in optimizer.param_groups:
            pg["lr"] = min(1.0, (self.trainer.global_step + 1) / 10) * self.lr

    def on_before_optimizer_step(self, optimizer):
        self.seen.append((self.global_step, optimizer.param_groups[0]["lr"]))


class LrFromData(TinyClassifier):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        for pg in self.trainer.optimizers[0].param_groups:
            pg["lr"] = float(batch[0].abs().mean()) / 10


def _fit(log_dir, communicator, model):
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=4, local_steps=3, communicator=communicator, seed=0)
    return trainer, trainer.fit(model, tiny_data(num_clients=6))


def test_a_carried_warm_up_matches_one_process(shared_tmp, comm):
    two, m2 = _fit(os.path.join(shared_tmp, "two"), "auto", WarmUp())
    assert two.world_size == 2
    one, m1 = _fit(os.path.join(shared_tmp, f"one{comm.Get_rank()}"), "local", WarmUp())
    assert torch.equal(m2.global_params, m1.global_params)
    assert max(lr for _, lr in m2.inner.seen) > 0.05  # (the warm-up went on across rounds)


def test_clients_on_two_ranks_that_differ_are_seen_to_differ(shared_tmp, comm):
    with pytest.warns(RuntimeWarning, match="different optimizer states"):
        _, m2 = _fit(os.path.join(shared_tmp, "two"), "auto", LrFromData())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, m1 = _fit(os.path.join(shared_tmp, f"one{comm.Get_rank()}"), "local", LrFromData())
    assert torch.equal(m2.global_params, m1.global_params)
