"""Nothing a DP run writes depends on one client's data, except the released, accounted values: the
same configuration on two neighbouring datasets (client 3's data differs: a marker record, one more
record with NaN, a record with a huge loss, fewer records, one more record) writes the same warnings,
console, files and checkpoints (:mod:`neighbours`): also which keys it says it withheld, whether it
releases a scheduled learning rate, and DP-SGD's default delta. What a client computes from its size
(the run's length a OneCycleLR is sized by, DP-SGD's sampling rate and epsilon) is checked with a
neighbour one client smaller and one larger (:mod:`dpfl_lightning.federated.public_sizes`)."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from dpfl_lightning import FederatedDataModule, FederatedTrainer
from dpfl_lightning.plugins import AdaptiveClip, DPSGD, GaussianNoise, PrivacyLedger, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import TinyClassifier, torch_lrs
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
    (lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)], {"records_per_client": RECORDS}),
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
    client's count crosses a power of ten, 0.1/10 and 0.1/11, and 1/11 < 0.095 < 1/10). The default
    delta, the privacy line, hparams.yaml, the ledger's checkpointed releases, and whether a given
    delta is refused must not differ."""
    plugins = lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)] + (  # noqa: E731
        [PrivacyLedger(delta=ledger)] if ledger else [])
    a, b = _compare(tmp_path, TinyClassifier, ("records=10", "records=11"), plugins=plugins, batch_size=12,
                    records_per_client=12)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
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


# ---------------------------------------------------------------- what a client computes from its size
ROUNDS, BATCH, PUBLIC = 3, 4, 12  # _data("records=n"): three clients of 12 records, client 3 of n


class SizedOneCycle(TinyClassifier):
    """A warm-up to the end of training, as a user writes it: ``OneCycleLR`` over
    ``estimated_stepping_batches``, stepped once per epoch (round); its validation logs what
    ``self.trainer`` says of the run's length (released evaluation metrics)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, cycle_momentum=False,
                                                    total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("shape_total_steps", float(self.trainer.estimated_stepping_batches))
        self.log("shape_batches", float(self.trainer.num_training_batches))
        self.log("shape_global_step", float(self.global_step))


def _central(z: float = 5.0):
    return lambda: [UpdateClipping(1.0), GaussianNoise(noise_multiplier=z)]


def _rows(w):
    return w.files[os.path.join("nb", "version_0", "metrics.csv")]["rows"]


def _one_cycle_lrs(total_steps: int, rounds: int) -> list[float]:
    """torch's OneCycleLR, stepped once per round: the learning rate at the start of each round."""
    return torch_lrs(lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, cycle_momentum=False,
                                                                     total_steps=total_steps), rounds)


@pytest.mark.parametrize("neighbour", ["records=11", "records=13"], ids=["one-smaller", "one-larger"])
def test_a_learning_rate_sized_by_the_run_length_follows_the_public_records(tmp_path, neighbour):
    """Client 3 holds 12 records, or one fewer, or one more (13 records are 4 batches of 4: the largest
    client's steps per round would grow from 3 to 4). With ``records_per_client=12`` every client's
    local epoch is 3 batches: ``estimated_stepping_batches``, ``num_training_batches``, the evaluation's
    ``global_step`` and the OneCycleLR learning rate that LearningRateMonitor logs are those of 12
    records on both neighbours (central noise, z = 5)."""
    a, b = _compare(tmp_path, SizedOneCycle, ("records=12", neighbour), plugins=_central(),
                    callbacks=lambda: [LearningRateMonitor("epoch")], records_per_client=PUBLIC, rounds=ROUNDS,
                    batch_size=BATCH)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
    rows = [r for r in _rows(a) if r.get("lr-SGD")]
    assert [float(r["lr-SGD"]) for r in rows] == pytest.approx(_one_cycle_lrs(ROUNDS * 3, ROUNDS), rel=1e-6)
    shapes = [(float(r["shape_total_steps"]), float(r["shape_batches"]), float(r["shape_global_step"]))
              for r in _rows(a) if r.get("shape_batches")]
    assert shapes == [(9.0, 3.0, 3.0 * (r + 1)) for r in range(ROUNDS)]


def test_without_public_records_the_run_length_is_refused_alike_on_every_neighbour(tmp_path):
    """Under local_epochs and no ``records_per_client``, ``estimated_stepping_batches`` would be the
    largest client's batches: the run is refused at set-up, with the same error on a neighbour one
    client smaller and one larger, naming the setting that fixes it."""
    runs = [written(str(tmp_path / change), _fit(SizedOneCycle, change, plugins=_central(), rounds=ROUNDS,
                                                 callbacks=lambda: [LearningRateMonitor("epoch")]))
            for change in ("records=12", "records=11", "records=13")]
    assert runs[0].error is not None and runs[0].error.startswith(
        "ConfigError: trainer.records_per_client=None: self.trainer.estimated_stepping_batches"), runs[0].error
    assert "set trainer.records_per_client=N" in runs[0].error
    assert differences(runs[0], runs[1]) == [] and differences(runs[0], runs[2]) == []


class LogsItsStep(TinyClassifier):
    """A validation_step that logs ``self.global_step`` (a released evaluation metric)."""

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("seen_global_step", float(self.global_step))


@pytest.mark.parametrize("neighbour", ["records=11", "records=13"], ids=["one-smaller", "one-larger"])
def test_evaluation_sees_the_written_step_not_the_last_client(tmp_path, neighbour):
    """Without ``records_per_client`` the clients' steps per round follow their sizes; client 3 trains
    last in every round. The evaluation after a round sees the step the run writes (its rounds), not
    client 3's ``global_step`` (``round * 3`` or ``round * 4``)."""
    a, b = _compare(tmp_path, LogsItsStep, ("records=12", neighbour), plugins=_central(1.0))
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
    assert [float(r["seen_global_step"]) for r in _rows(a) if r.get("seen_global_step")] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("neighbour", ["records=11", "records=13"], ids=["one-smaller", "one-larger"])
def test_a_step_interval_learning_rate_is_released_from_the_public_records(tmp_path, neighbour):
    """With ``records_per_client`` every client takes the same public number of steps per round under
    local_epochs: a step-interval learning rate is a function of the settings, released alike."""
    a, b = _compare(tmp_path, StepSchedule, ("records=12", neighbour), callbacks=lambda: [LearningRateMonitor("epoch")],
                    records_per_client=PUBLIC, plugins=_central(1.0))
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
    # StepLR(step_size=2, gamma=0.5) after 3 steps per round: lr 0.1 * 0.5 ** floor(3 r / 2)
    assert [float(r["lr-SGD"]) for r in _rows(a) if r.get("lr-SGD")] == pytest.approx(
        [0.1 * 0.5 ** (3 * r // 2) for r in range(3)])


def _dpsgd_epsilon(q: float, z: float, steps: int, delta: float) -> float:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

    acc = dp_rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("neighbour", ["records=9", "records=11"], ids=["one-smaller", "one-larger"])
def test_dpsgd_accounts_the_public_records_not_the_smallest_client(tmp_path, neighbour):
    """Client 3 holds 10 records, or 9, or 11 (the others 12). DP-SGD accounts every client at the
    public ``records_per_client=12``: Poisson q = 4/12 and 3 steps per local epoch, so the privacy
    line, the epsilon after every round and everything else written are the same on both neighbours,
    and the epsilon is dp_accounting's for that q and those steps."""
    plugins = lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0), PrivacyLedger(delta=1e-5)]  # noqa: E731
    a, b = _compare(tmp_path, TinyClassifier, ("records=10", neighbour), plugins=plugins, records_per_client=PUBLIC,
                    rounds=ROUNDS, batch_size=BATCH)
    assert a.error is None and b.error is None, (a.error, b.error)
    assert differences(a, b) == []
    assert f"Poisson sampling q={BATCH / PUBLIC:g}" in a.stderr, a.stderr
    eps = [float(r["epsilon"]) for r in _rows(a) if r.get("epsilon")]
    assert eps == pytest.approx([_dpsgd_epsilon(BATCH / PUBLIC, 1.0, 3 * (r + 1), 1e-5) for r in range(ROUNDS)],
                                rel=1e-9)


def test_dpsgd_without_public_records_is_refused_alike_on_every_neighbour(tmp_path):
    """Without ``records_per_client`` DP-SGD's epsilon would name the smallest client's record count
    (q = B / 9 or B / 10): refused, with the same error on every neighbour, naming the setting."""
    plugins = lambda: [DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)]  # noqa: E731
    runs = [written(str(tmp_path / change), _fit(TinyClassifier, change, plugins=plugins))
            for change in ("records=10", "records=9", "records=11")]
    assert runs[0].error is not None and runs[0].error.startswith(
        "ConfigError: trainer.records_per_client=None: DPSGD's accountant"), runs[0].error
    assert differences(runs[0], runs[1]) == [] and differences(runs[0], runs[2]) == []
