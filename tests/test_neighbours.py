"""Nothing a DP run writes depends on one client's data, except the released, accounted values: the
same configuration on two neighbouring datasets (client 3's data differs: a marker record, one more
record with NaN, a record with a huge loss, fewer records) writes the same warnings, console, files
and checkpoints (:mod:`neighbours`)."""

from __future__ import annotations

import os

import pytest
import torch

from dpfl_lightning import FederatedDataModule, FederatedTrainer
from dpfl_lightning.plugins import AdaptiveClip, DPSGD, GaussianNoise, UpdateClipping
from helpers import TinyClassifier
from neighbours import differences, written

CLIENTS, RECORDS, MARKER = 4, 10, 1000.0


def _tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CLIENTS * RECORDS, 10, generator=g), torch.arange(CLIENTS * RECORDS) % 10


def _data(change: str | None) -> FederatedDataModule:
    """Four clients of ten records and a separate test set; ``change`` alters client 3's data."""
    x, y = _tensors()
    x_test, y_test = _tensors(1)
    clients = [list(range(c * RECORDS, (c + 1) * RECORDS)) for c in range(CLIENTS)]
    mine = clients[3]
    if change == "marker":
        x[mine[4]] = MARKER
    elif change in ("nan", "nan+1"):
        x[clients[0][2], 1] = float("nan")  # both neighbours hold a non-finite record ...
        if change == "nan+1":
            x[mine[5], 0] = float("nan")  # ... and client 3 one more
    elif change == "huge":
        x[mine[1]] *= 1e4
    elif change == "fewer":
        clients[3] = mine[:6]
    return FederatedDataModule.from_tensors(x, y, x_test[:12], y_test[:12], client_indices=clients)


class MarkerWarmUp(TinyClassifier):
    """A warm-up in ``optimizer_step`` that depends on the batch: it halves the learning rate on a batch
    that holds the marker record (so client 3 ends its round off the schedule on one neighbour only)."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if self._batch_max > MARKER / 2:
            for pg in optimizer.param_groups:
                pg["lr"] *= 0.5

    def training_step(self, batch, batch_idx):
        self._batch_max = float(batch[0].nan_to_num().abs().max())
        return super().training_step(batch, batch_idx)


def _fit(model_cls, change, plugins=None, **kw):
    def fit(log_dir: str) -> None:
        chosen = plugins() if plugins else [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)]
        trainer = FederatedTrainer(log_dir=log_dir, run_name="nb", rounds=3, local_epochs=1, batch_size=4,
                                   num_threads=1, enable_progress_bar=False, enable_summary=True, checkpoint_every=1,
                                   final_checkpoint=True, seed=0, plugins=chosen, **kw)
        trainer.fit(model_cls(), _data(change))
    return fit


def _compare(tmp_path, model_cls, changes, **kw):
    a, b = (written(str(tmp_path / name), _fit(model_cls, change, **kw)) for name, change in zip("ab", changes))
    assert os.path.isfile(tmp_path / "a" / "nb" / "version_0" / "metrics.csv"), a.error  # the runs wrote their logs
    return a, b


@pytest.mark.parametrize("changes, kw", [
    ((None, "marker"), {}),
    (("nan", "nan+1"), {"on_nonfinite": "skip"}),
    ((None, "huge"), {}),
    ((None, "fewer"), {}),
], ids=["marker", "one-more-nan", "huge-loss", "fewer-records"])
def test_a_dp_run_writes_the_same_on_neighbouring_datasets(tmp_path, changes, kw):
    a, b = _compare(tmp_path, MarkerWarmUp, changes, **kw)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []


@pytest.mark.parametrize("plugins, kw", [
    (lambda: [AdaptiveClip(1.0), GaussianNoise(noise_multiplier=1.0)], {"clients_per_round": 2}),
    (lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)], {}),
], ids=["adaptive-clip-uniform", "dpsgd"])
def test_other_mechanisms_write_the_same_on_neighbouring_datasets(tmp_path, plugins, kw):
    a, b = _compare(tmp_path, MarkerWarmUp, (None, "marker"), plugins=plugins, **kw)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []


def test_the_harness_sees_a_difference_it_must_see(tmp_path):
    """The harness can fail: without DP nothing is withheld, and the module's logged training loss,
    written to metrics.csv, differs between the neighbours."""
    def fit(change):
        def run(log_dir):
            FederatedTrainer(log_dir=log_dir, run_name="nb", rounds=2, local_steps=2, batch_size=4, num_threads=1,
                             enable_progress_bar=False, enable_summary=False).fit(TinyClassifier(), _data(change))
        return run
    a, b = written(str(tmp_path / "a"), fit(None)), written(str(tmp_path / "b"), fit("huge"))
    found = differences(a, b)
    assert any("metrics.csv" in d and "my_train_loss" in d for d in found), found
