"""Nothing a DP run writes depends on one client's data, except the released, accounted values: the
same configuration on two neighbouring datasets (client 3's data differs: a marker record, one more
record with NaN, a record with a huge loss, fewer records, one more record) writes the same warnings,
console, files and checkpoints (:mod:`neighbours`): also which keys it says it withheld, whether it
releases a scheduled learning rate, and DP-SGD's default delta."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from dpfl_lightning import FederatedDataModule, FederatedTrainer
from dpfl_lightning.plugins import AdaptiveClip, DPSGD, GaussianNoise, PrivacyLedger, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import TinyClassifier
from neighbours import differences, written

CLIENTS, RECORDS, MARKER = 4, 10, 1000.0


def _tensors(seed: int = 0, n: int = CLIENTS * RECORDS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 10, generator=g), torch.arange(n) % 10


def _data(change: str | None) -> FederatedDataModule:
    """Four clients of ten records and a separate test set; ``change`` alters client 3's data
    (``records=n``: three clients of 12 records and client 3 of ``n``)."""
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
    elif change and change.startswith("records="):  # client 3 holds this many records, the others 12
        x, y = _tensors(2, 60)  # (enough records for every client)
        clients = [list(range(c * 12, (c + 1) * 12)) for c in range(3)] + [list(range(36, 36 + int(change[8:])))]
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


def _fit(model_cls, change, plugins=None, callbacks=None, **kw):
    def fit(log_dir: str) -> None:
        chosen = plugins() if plugins else [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)]
        settings = dict(log_dir=log_dir, run_name="nb", rounds=3, local_epochs=1, batch_size=4, num_threads=1,
                        enable_progress_bar=False, enable_summary=True, checkpoint_every=1, final_checkpoint=True,
                        seed=0, plugins=chosen, callbacks=callbacks() if callbacks else None)
        trainer = FederatedTrainer(**{**settings, **kw})
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


class SmallClientFlag(FederatedCallback):
    """A user's plugin that logs a key, undeclared, only in a round where a client held fewer records
    than the others: which keys a run meets can depend on one client's data (as a module's
    ``if (y == 9).any(): self.log("saw_nine", ...)`` would)."""

    def __init__(self):
        self.small = False

    def on_client_end(self, *, client):
        self.small |= client.num_samples < RECORDS

    def on_round_end(self, *, server, metrics):
        if self.small:
            metrics["small_client_seen"] = 1.0


class StepSchedule(TinyClassifier):
    """A learning rate stepped every optimizer step (``interval="step"``), which LearningRateMonitor logs."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_keys_logged_on_one_neighbour_only_are_named_from_the_code_alike(tmp_path):
    """The release notes do not name the withheld keys a run met in training: a key logged only where
    client 3 holds fewer records would say so. What they name is read from the plugin's code at set-up
    (an undeclared key its on_round_end writes), so both neighbours say the same, met or not."""
    plugins = lambda: [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0), SmallClientFlag()]  # noqa: E731
    a, b = _compare(tmp_path, TinyClassifier, (None, "fewer"), plugins=plugins)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
    assert "withheld from the logs" in a.stderr
    said = [w for w in a.warnings if "SmallClientFlag logs 'small_client_seen'" in w]
    assert len(said) == 1 and said == [w for w in b.warnings if "SmallClientFlag logs" in w]


def test_whether_learning_rates_are_released_follows_the_settings_not_the_client_sizes(tmp_path):
    """Under local_epochs a step-interval learning rate follows the clients' sizes (the reference
    client's steps per round): whether ``lr-SGD`` is released may not depend on client 3 holding
    fewer records than the others."""
    a, b = _compare(tmp_path, StepSchedule, (None, "fewer"), callbacks=lambda: [LearningRateMonitor("epoch")])
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
    columns = a.files[os.path.join("nb", "version_0", "metrics.csv")]["columns"]
    assert "lr-SGD" not in columns, columns  # withheld: the sizes are not public


def test_learning_rates_under_local_steps_are_released(tmp_path):
    """With local_steps every client takes the same public number of steps: the scheduled learning rate
    is a function of the settings, and a DP run releases it on both neighbours."""
    a, b = _compare(tmp_path, StepSchedule, (None, "fewer"), callbacks=lambda: [LearningRateMonitor("epoch")],
                    local_epochs=None, local_steps=2)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
    assert "lr-SGD" in a.files[os.path.join("nb", "version_0", "metrics.csv")]["columns"]


@pytest.mark.parametrize("ledger", [None, 0.095], ids=["default-delta", "given-delta"])
def test_dpsgd_delta_does_not_follow_a_client_size(tmp_path, ledger):
    """Record-level DP: client 3 holds 10 records on one neighbour and 11 on the other (the smallest
    client's count crosses a power of ten, 0.1/10 and 0.1/11, and 1/11 < 0.095 < 1/10). Every batch
    holds all of a client's records (batch_size 12), so the accounted steps and rates are the same;
    the default delta, the privacy line, hparams.yaml, and whether a given delta is refused must be too."""
    plugins = lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)] + (  # noqa: E731
        [PrivacyLedger(delta=ledger)] if ledger else [])
    a, b = _compare(tmp_path, TinyClassifier, ("records=10", "records=11"), plugins=plugins, batch_size=12)
    assert a.error is None and b.error is None, (a.error, b.error)
    found = differences(a, b)
    # Known and left: the ledger checkpoints the record counts its accountant uses (each client's
    # sampling rate B/n and steps per epoch), to refuse a resume under other releases.
    counts = [d for d in found if "/plugins/PrivacyLedger/releases" in d and "'records': 10" in d]
    assert [d for d in found if d not in counts] == []
    assert f"delta={ledger or 1e-6:g}" in a.stderr, a.stderr


@pytest.mark.parametrize("callbacks", [None, lambda: [ModelCheckpoint(save_top_k=-1)]], ids=["run-checkpoints",
                                                                                           "model-checkpoint"])
def test_global_step_does_not_follow_the_largest_client(tmp_path, callbacks):
    """Under local_epochs the reference client's steps per round are the largest client's batches: client
    3 holds 12 or 13 records at batch 4 (3 or 4 batches, the others 3), which would write global_step
    9 or 12 after three rounds into every checkpoint, and name ModelCheckpoint's files (``step=9``).
    A DP run writes the rounds done: a function of the settings."""
    a, b = _compare(tmp_path, TinyClassifier, ("records=12", "records=13"), callbacks=callbacks)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
    final = a.files[os.path.join("nb", "version_0", "checkpoints", "final.ckpt")]
    assert (final["epoch"], final["global_step"]) == (3, 3)


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
