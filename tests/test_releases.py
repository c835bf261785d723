"""What a DP run writes down: every key that reaches the CSV log, the loggers (W&B), the console
summary, the history and the checkpoints is on the release list -- public settings, noised
statistics, evaluation of the global model, epsilon. The allowed keys are written here, by hand:
a new un-noised metric fails this test until someone decides it is a release."""

import csv
import glob
import os
import re

import pytest
from lightning.pytorch.loggers import Logger

from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.run import log_setup as trainer_module
from dpfl_lightning.algorithms import PFL, DPFedAvg, DPFedAvgLocal, DPNormFedAvg
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from helpers import TinyClassifier, quiet_trainer, tiny_data

PUBLIC = {"round", "epsilon", "noise_std", "clip_norm", "my_val_loss", "my_val_acc"}
PER_PRESET = {"central": {"snr"}, "local": set(), "distributed": {"epsilon_client_distributed_models", "snr"},
              "normfedavg": {"epsilon_client_distributed_models", "snr"}, "pfl": set()}
# set-up facts of the summary: the settings, and the executor that trained (the setting, or auto's
# choice: see tests/test_executor_auto.py and README "Executors" for what that choice reads)
SUMMARY = {"rounds", "num_clients", "ranks", "executor"}
UNACCOUNTED = {"my_train_loss", "round_time_s", "skipped_clients"}


class CaptureLogger(Logger):
    """Receives exactly what every logger (W&B included) receives."""

    def __init__(self):
        super().__init__()
        self.keys: set[str] = set()

    @property
    def name(self):
        return "capture"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.keys |= set(metrics)


PRESETS = {"central": lambda: DPFedAvg(clip=1.0, noise_multiplier=1.0, placement="central"),
           "local": lambda: DPFedAvgLocal(clip=1.0, noise_multiplier=1.0),
           "distributed": lambda: DPFedAvg(clip=1.0, noise_multiplier=1.0, placement="distributed"),
           "normfedavg": lambda: DPNormFedAvg(scale=1.0, noise_multiplier=1.0),
           "pfl": lambda: PFL(noise_multiplier=1.0)}


def _run(tmp_path, preset, sampling, monkeypatch, **kw):
    summaries = []
    monkeypatch.setattr(trainer_module, "print_summary", lambda title, rows: summaries.append(rows))
    capture = CaptureLogger()
    trainer = quiet_trainer(str(tmp_path), rounds=2, clients_per_round=4, sampling=sampling, loggers=[capture],
                            algorithm=PRESETS[preset](), enable_summary=True, checkpoint_every=2, **kw)
    trainer.fit(TinyClassifier(), tiny_data(num_clients=20))
    (path,) = glob.glob(os.path.join(str(tmp_path), "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        csv_keys = set(csv.DictReader(f).fieldnames) - {"step"}
    history = {k for row in trainer.history for k in row}
    saved = ckpt.load(os.path.join(trainer.checkpoint_dir, "last.ckpt"))
    saved_history = {k for row in saved["history"] for k in row}
    summary = {re.sub(r" \((total|mean|round \d+)\)$", "", k) for k in summaries[0]} - SUMMARY
    return trainer, {"csv": csv_keys, "loggers": capture.keys, "history": history, "checkpoint": saved_history,
                     "summary": summary}


@pytest.mark.parametrize("sampling", ["poisson", "uniform"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_logged_key_is_on_the_release_list(tmp_path, monkeypatch, preset, sampling):
    allowed = PUBLIC | PER_PRESET[preset] | ({"clients"} if sampling == "uniform" else set())
    _, seen = _run(tmp_path, preset, sampling, monkeypatch)
    for where, keys in seen.items():
        assert keys <= allowed, (where, sorted(keys - allowed))
        assert {"epsilon", "my_val_acc"} <= keys, where
    if sampling == "poisson":
        assert all("clients" not in keys for keys in seen.values())  # a Poisson cohort's size is not public


def test_opting_in_releases_client_statistics_and_says_they_are_unaccounted(tmp_path, monkeypatch, capsys):
    trainer, seen = _run(tmp_path, "central", "poisson", monkeypatch, log_client_metrics=True, on_nonfinite="skip")
    assert {"my_train_loss", "round_time_s", "clients", "skipped_clients"} <= seen["csv"]
    assert any("NOT accounted" in line and "my_train_loss" in line for line in trainer.run.releases.describe())


class Undeclared(FederatedCallback):
    def on_round_end(self, *, server, metrics):
        metrics["raw_statistic"] = 1.0


def test_an_undeclared_plugin_metric_is_withheld_in_a_dp_run(log_dir):
    trainer = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=[UpdateClipping(1.0),
                            GaussianNoise(noise_multiplier=1.0), Undeclared()])
    trainer.fit(TinyClassifier(), tiny_data())
    assert "raw_statistic" not in trainer.history[0]
    assert "raw_statistic" in trainer.run.releases.withheld
    assert any("timing is not covered" in line for line in trainer.run.releases.describe())
    free = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=[Undeclared()])  # no DP: no filter
    free.fit(TinyClassifier(), tiny_data())
    assert free.history[0]["raw_statistic"] == 1.0


def test_clipping_statistics_are_refused_in_a_dp_run_unless_released_knowingly(log_dir):
    from dpfl_lightning import ConfigError

    plugins = lambda: [UpdateClipping(1.0, log_norms=True), GaussianNoise(noise_multiplier=1.0)]  # noqa: E731
    with pytest.raises(ConfigError, match="raw_norm"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=plugins()).fit(TinyClassifier(), tiny_data())
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=plugins(), log_client_metrics=True)
    t.fit(TinyClassifier(), tiny_data())
    assert 0 <= t.history[0]["fraction_bounded"] <= 1 and t.history[0]["update_norm_mean"] > 0
    assert any("raw_norm" in line for line in t.run.notes)


def test_a_test_set_drawn_from_the_clients_is_stated(log_dir):
    t = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    t.fit(TinyClassifier(), tiny_data())  # SyntheticLogistic: the test set is the users' held-out records
    assert any("drawn from the clients' own data" in line for line in t.run.privacy_lines())
    from dpfl_lightning.data import Digits

    d = quiet_trainer(log_dir, rounds=1, clients_per_round=3, plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    d.fit(TinyClassifier(in_features=64), Digits(num_clients=10))
    assert not any("drawn from the clients" in line for line in d.run.privacy_lines())


def test_the_withheld_line_names_no_key_met_in_training():
    """What a DP run says it withheld is the same whichever keys training produced (a key logged under a
    data condition would say something about one client); it names the keys known at set-up."""
    from dpfl_lightning.federated.releases import MetricRelease, ReleaseList

    def lines(logged):
        releases = ReleaseList(private=True, opt_in=False)
        releases.declare(MetricRelease("update_norm_mean", "unaccounted", "UpdateClipping"),
                         MetricRelease("epsilon", "public", "PrivacyLedger"))
        kept = releases.filter(dict.fromkeys(logged, 1.0), {"epsilon": "public"})
        return kept, releases.describe()

    kept_a, a = lines(["epsilon", "round_time_s"])
    kept_b, b = lines(["epsilon", "round_time_s", "saw_nine", "update_norm_mean"])
    assert kept_a == kept_b == {"epsilon": 1.0}
    assert a == b
    withheld = [line for line in a if line.startswith("withheld from the logs")]
    assert len(withheld) == 1 and "saw_nine" not in withheld[0]
    assert "round_time_s" in withheld[0] and "update_norm_mean" in withheld[0]
    assert ReleaseList(private=False, opt_in=True).describe() == []


@pytest.mark.parametrize("step_interval, steps_are_public, kind", [
    (False, False, "public"),  # an epoch-interval schedule: a function of the round
    (True, True, "public"),  # local_steps, no accumulation: the step count is a setting
    (True, False, "unaccounted"),  # local_epochs: the step count follows the largest client's records
])
def test_a_scheduled_learning_rate_is_released_by_the_settings(step_interval, steps_are_public, kind):
    from dpfl_lightning.federated.releases import learning_rate_kind

    assert learning_rate_kind(step_interval, steps_are_public) == kind
