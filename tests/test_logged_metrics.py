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
