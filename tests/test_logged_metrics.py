"""What a module logs with ``self.log``: mean (weighted by batch size), sum, max and min reductions,
across steps, clients and ranks."""

import pytest
import torch

from dpfl_lightning.module.logged_metrics import LoggedMetrics, merge
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
    # lightning.Trainer reports a value logged with on_step and on_epoch both in force -- given, or
    # by the hook's defaults (training_step: on_step; validation_step: on_epoch) -- also as
    # "<name>_epoch", which a ModelCheckpoint or EarlyStopping may monitor; a Metric is computed once.
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from torchmetrics.classification import MulticlassAccuracy

    class Forks(TinyClassifier):
        def __init__(self):
            super().__init__()
            self.acc = MulticlassAccuracy(num_classes=10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            self.acc(logits, y)
            self.log("both", loss, on_step=True, on_epoch=True)
            self.log("ep", loss, on_epoch=True)  # on_step by training_step's default
            self.log("plain", loss)  # on_step only: no fork
            self.log("acc", self.acc, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("vl", torch.nn.functional.cross_entropy(self(x), y), on_step=True)  # on_epoch by default

    data = tiny_data()
    loader = DataLoader(TensorDataset(*data.in_memory_tensors), batch_size=5)
    t = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    t.fit(Forks(), loader, loader)
    forked = {"both_epoch", "ep_epoch", "acc_epoch", "vl_epoch"}
    assert forked <= set(t.callback_metrics) and "plain_epoch" not in t.callback_metrics
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=4, batch_size=5, log_client_metrics=True)
    trainer.fit(Forks(), data)
    row = trainer.history[0]
    assert forked <= set(row) and "plain_epoch" not in row
    assert row["both_epoch"] == row["both"] and row["ep_epoch"] == row["ep"] and row["vl_epoch"] == row["vl"]
    assert row["acc_epoch"] == row["acc"] > 0  # computed once, not again after its reset


def test_logging_neither_per_step_nor_per_epoch_is_refused_as_in_lightning(log_dir):
    class Nowhere(TinyClassifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("x", loss, on_step=False)  # training_step's default on_epoch is False
            return loss

    with pytest.raises(ValueError, match="on_step=False, on_epoch=False"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2).fit(Nowhere(), tiny_data())
