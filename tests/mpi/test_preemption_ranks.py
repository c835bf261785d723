"""Under two ranks: a signal that reaches one rank only stops both after the same round, with one
checkpoint; resuming on two ranks reaches the model of the uninterrupted two-rank run."""

import os
import signal

import pytest
import torch

from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.run.preemption import Preempted
from helpers import TinyClassifier, quiet_trainer, tiny_data


class SignalOnOneRank(FederatedCallback):
    """Sends this process ``signum`` at the end of round ``at``, on rank ``rank`` only."""

    def __init__(self, signum: int, at: int, rank: int) -> None:
        self.signum, self.at, self.rank = signum, at, rank
        self._my_rank = 0

    def setup(self, *, ctx) -> None:
        self._my_rank = ctx.rank

    def on_round_end(self, *, server, metrics) -> None:
        if server.round_idx + 1 == self.at and self._my_rank == self.rank:
            os.kill(os.getpid(), self.signum)


def _trainer(log_dir, *extra):
    plugins = [UpdateClipping(1.0), GaussianNoise(noise_multiplier=0.5, placement="distributed"), *extra]
    return quiet_trainer(log_dir, rounds=5, clients_per_round=6, plugins=plugins, run_name="run")


@pytest.mark.parametrize("sig,rank", [(signal.SIGTERM, 1), (signal.SIGUSR1, 0)])
def test_a_signal_on_one_rank_stops_both_and_the_resumed_run_matches(shared_tmp, comm, sig, rank):
    ref = _trainer(os.path.join(shared_tmp, "ref")).fit(TinyClassifier(), tiny_data())
    trainer = _trainer(os.path.join(shared_tmp, "run"), SignalOnOneRank(sig, at=3, rank=rank))
    with pytest.raises(Preempted) as stopped:
        trainer.fit(TinyClassifier(), tiny_data())
    assert trainer.world_size == 2
    assert stopped.value.code == 128 + sig and stopped.value.rounds_done == 3
    assert comm.allgather(stopped.value.rounds_done) == [3, 3]
    assert ckpt.load(os.path.join(trainer.checkpoint_dir, "last.ckpt"))["round"] == 3
    module = _trainer(os.path.join(shared_tmp, "run")).fit(TinyClassifier(), tiny_data(), ckpt_path="last")
    assert torch.equal(module.global_params, ref.global_params)
