"""What a module logs with ``self.log``: mean (weighted by batch size), sum, max and min reductions,
across steps, clients and ranks."""

import pytest
import torch

from dpfl_lightning.logged_metrics import LoggedMetrics, merge
from helpers import TinyClassifier, quiet_trainer, tiny_data


def test_reductions_merge_across_parts():
    parts = []
    for values in ([3.0, -1.0], [7.0], [0.5, 2.0]):  # e.g. three clients or ranks
        lm = LoggedMetrics()
        for v in values:
            lm.current_batch_size = 2
            lm.log("peak", torch.tensor(v), reduce_fx="max")
            lm.log("low", v, reduce_fx=min)
            lm.log("total", v, reduce_fx="sum")
            lm.log("avg", v)
        parts.append(lm.results())
    out = merge(parts)
    everything = [3.0, -1.0, 7.0, 0.5, 2.0]
    assert out["peak"] == 7.0 and out["low"] == -1.0
    assert out["total"] == pytest.approx(sum(everything))
    assert out["avg"] == pytest.approx(sum(everything) / len(everything))


def test_unknown_reduction_is_refused():
    with pytest.raises(ValueError, match="reduce_fx"):
        LoggedMetrics().log("x", 1.0, reduce_fx="median")


def test_max_and_min_through_the_trainer(log_dir):
    seen = []

    class Extremes(TinyClassifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            seen.append(float(loss.detach()))
            self.log("loss_max", loss, reduce_fx="max")
            self.log("loss_min", loss, reduce_fx="min")
            return loss

    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=4, batch_size=5)
    trainer.fit(Extremes(), tiny_data())
    assert trainer.history[0]["loss_max"] == pytest.approx(max(seen))
    assert trainer.history[0]["loss_min"] == pytest.approx(min(seen))


def test_on_step_and_on_epoch_fork_the_name_as_lightning_does(log_dir):
    # lightning.Trainer logs a value logged with on_step=True and on_epoch=True as "<name>_epoch" (and
    # "<name>_step"); a ModelCheckpoint or EarlyStopping may monitor "<name>_epoch".
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Both(TinyClassifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("both", loss, on_step=True, on_epoch=True)
            return loss

    ref = Both()
    data = tiny_data()
    t = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    t.fit(ref, DataLoader(TensorDataset(*data.in_memory_tensors), batch_size=5))
    assert "both_epoch" in t.callback_metrics
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=4, batch_size=5)
    trainer.fit(Both(), data)
    assert trainer.history[0]["both_epoch"] == pytest.approx(trainer.history[0]["both"])
