"""Under two ranks: Lightning schedules (step, epoch, plateau) and round-level callbacks give what one
process gives."""

import os

import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

from helpers import TinyClassifier, quiet_trainer, tiny_data


class Scheduled(TinyClassifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.3)
        onecycle = torch.optim.lr_scheduler.OneCycleLR(opt, 0.5, total_steps=self.trainer.estimated_stepping_batches)
        return [opt], [{"scheduler": onecycle, "interval": "step"},
                       {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0), "monitor": "my_val_loss"}]


def _fit(log_dir, communicator, tmp):
    callbacks = [EarlyStopping(monitor="my_val_loss", patience=1), LearningRateMonitor("epoch"),
                 ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), monitor="my_val_acc", mode="max")]
    trainer = quiet_trainer(log_dir, rounds=5, clients_per_round=5, local_epochs=2, communicator=communicator, seed=3,
                            callbacks=callbacks)
    module = trainer.fit(Scheduled(), tiny_data(num_clients=9, samples=10))  # unequal local steps would differ
    return trainer, module, callbacks[2]


def test_schedules_and_callbacks_match_one_process(shared_tmp, comm):
    two, m2, ck2 = _fit(os.path.join(shared_tmp, "two"), "auto", os.path.join(shared_tmp, "two"))
    assert two.world_size == 2
    one, m1, ck1 = _fit(os.path.join(shared_tmp, f"one{comm.Get_rank()}"), "local",
                        os.path.join(shared_tmp, f"one{comm.Get_rank()}"))
    assert torch.equal(m2.global_params, m1.global_params)
    assert [h.get("lr-SGD") for h in two.history] == [h.get("lr-SGD") for h in one.history]
    assert len(two.history) == len(one.history) and two.stop_reason == one.stop_reason
    assert os.path.basename(ck2.best_model_path) == os.path.basename(ck1.best_model_path)
