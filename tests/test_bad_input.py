"""Bad input: one clear line naming the setting and the fix, a non-zero exit, nothing half-written."""

import dataclasses
import glob
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from dpfl_lightning import ConfigError, FederatedDataModule, NonFiniteUpdateError
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from dpfl_lightning.federated.placement import available_cpus
from helpers import TinyClassifier, quiet_trainer, tiny_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = """
trainer:
  rounds: 2
  clients_per_round: 4
  batch_size: 4
  enable_progress_bar: false
  enable_summary: false
  num_threads: 1
  checkpoint_every: 1
  log_dir: {log_dir}
  plugins:
    - class_path: dpfl_lightning.plugins.UpdateClipping
      init_args: {{max_norm: 1.0}}
model:
  class_path: dpfl_lightning.models.MLPClassifier
  init_args: {{in_features: {dim}, hidden: [8]}}
data:
  class_path: {data_class}
  init_args: {data_args}
"""


def _write(tmp_path, data_class="dpfl_lightning.data.Digits", data_args="{num_clients: 20}", dim=64):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(BASE.format(log_dir=tmp_path / "runs", data_class=data_class, data_args=data_args, dim=dim))
    return str(cfg)


def _dpfl(*args, launcher=()):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.run([*launcher, sys.executable, "-m", "dpfl_lightning", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def _assert_clear_error(proc, setting, tmp_path, code=2):
    assert proc.returncode == code, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("dpfl: error")]
    assert len(lines) >= 1 and setting in lines[0] and "Fix:" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)  # no checkpoint, partial or not


@pytest.mark.parametrize("override,setting", [
    (["--trainer.clients_per_round", "50"], "trainer.clients_per_round"),
    (["--trainer.plugins.init_args.max_norm", "0"], "UpdateClipping.max_norm"),
    (["--data.init_args.partition", "zipf"], "data.partition"),
    (["--trainer.rounds", "0"], "trainer.rounds"),
])
def test_cli_config_errors(tmp_path, override, setting):
    _assert_clear_error(_dpfl("fit", "--config", _write(tmp_path), *override), setting, tmp_path)


@pytest.mark.parametrize("value", [".nan", ".inf", "nan"])
def test_a_non_finite_noise_multiplier_is_refused_naming_the_setting(tmp_path, capsys, value):
    # YAML's .nan / .inf are floats (the plugin refuses them); a bare nan is a string (the parser does)
    from dpfl_lightning.cli import command as cli

    path = _write(tmp_path)
    with open(path) as f:
        text = f.read().replace("      init_args: {max_norm: 1.0}\n", "      init_args: {max_norm: 1.0}\n"
                                "    - class_path: dpfl_lightning.plugins.GaussianNoise\n"
                                f"      init_args: {{noise_multiplier: {value}}}\n")
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", path])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "noise_multiplier=" in line and "must be a finite number" in line and "Fix:" in line, line
    assert ("GaussianNoise.noise_multiplier=" if value.startswith(".") else "=nan: ") in line, line
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


def test_cli_missing_data_path(tmp_path):
    cfg = _write(tmp_path, "dpfl_lightning.data.NpzFile", f"{{path: {tmp_path / 'nowhere.npz'}, num_clients: 4}}", dim=4)
    _assert_clear_error(_dpfl("fit", "--config", cfg), "data.path", tmp_path)


def test_cli_more_ranks_than_clients(tmp_path):
    path = tmp_path / "two.npz"
    np.savez(path, x_train=np.random.rand(20, 4), y_train=np.arange(20) % 2, client_train=np.arange(20) % 2)
    cfg = _write(tmp_path, "dpfl_lightning.data.NpzFile", f"{{path: {path}}}", dim=4)
    proc = _dpfl("fit", "--config", cfg, "--trainer.clients_per_round", "2", launcher=("mpiexec", "-n", "3"))
    assert proc.returncode != 0
    assert "mpiexec -n" in proc.stderr and "more ranks than clients" in proc.stderr
    assert not glob.glob(str(tmp_path / "**" / "*.ckpt"), recursive=True)


def test_cli_non_finite_update(tmp_path):
    x = np.random.rand(40, 4).astype(np.float32)
    x[5, 0] = np.inf  # client 1's data (rows 1, 5, ... belong to client 1)
    path = tmp_path / "bad.npz"
    np.savez(path, x_train=x, y_train=np.arange(40) % 2, client_train=np.arange(40) % 4)
    cfg = _write(tmp_path, "dpfl_lightning.data.NpzFile", f"{{path: {path}}}", dim=4)
    proc = _dpfl("fit", "--config", cfg)
    _assert_clear_error(proc, "client(s) [1]", tmp_path, code=1)
    assert "round 1:" in proc.stderr  # the round as the logs count it (from 1)


def _bad_client_data():
    x = torch.randn(40, 10)
    x[8] = float("nan")  # client 2 under the iid split below holds row 8
    data = FederatedDataModule.from_tensors(x, torch.arange(40) % 10, x[:8], torch.arange(8) % 10, num_clients=4,
                                            partition="iid")
    data.setup()
    bad = [c for c in range(4) if 8 in data._train_idx[c].tolist()]
    return data, bad


def test_non_finite_update_never_reaches_the_model(log_dir):
    data, bad = _bad_client_data()
    model = TinyClassifier()
    start = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(log_dir, rounds=3, plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)])
    with pytest.raises(NonFiniteUpdateError, match=re.escape("round 1: 1 client produced")):  # a DP run: not who
        trainer.fit(model, data)
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))


def test_non_finite_update_skipped_when_asked(log_dir):
    data, _ = _bad_client_data()
    trainer = quiet_trainer(log_dir, rounds=3, on_nonfinite="skip", plugins=[UpdateClipping(1.0)])
    module = trainer.fit(TinyClassifier(), data)
    assert torch.isfinite(module.global_params).all()
    assert [h["skipped_clients"] for h in trainer.history] == [1.0, 1.0, 1.0]


def test_more_threads_than_cores_warns_once_with_the_fix(log_dir):
    def run(threads):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_trainer(log_dir, rounds=1, clients_per_round=2, num_threads=threads).fit(TinyClassifier(), tiny_data())
        return [w for w in caught if "trainer.num_threads" in str(w.message)]

    (warning,) = run(available_cpus() + 1)
    assert f"at most {available_cpus()}" in str(warning.message)
    assert run(available_cpus()) == []
    torch.set_num_threads(1)


class _Lazy(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.Linear(16, 10))


class _Double(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.net = self.net.double()


class _RunningStats(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 10))


class _ParameterAsBuffer(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", self.net[0].weight)


class _NoParameters(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Identity()


@pytest.mark.parametrize("model,says,fix", [
    (_Lazy, r"model=\['net.0.weight', 'net.0.bias'\]: has lazy parameters", "run the model once on an example batch"),
    (_Double, "model='_Double': has parameters of dtype torch.float64", r"model.float\(\)"),
    (_RunningStats, r"model=\['net.1'\]: BatchNorm running statistics", "GroupNorm"),
    (_NoParameters, "model='_NoParameters': has no parameters", "trainable parameters"),
    (_ParameterAsBuffer, r"model=\['w'\]: a parameter is also registered as a buffer", "register it once"),
])
@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_models_the_global_model_cannot_hold_are_refused_at_set_up(log_dir, model, says, fix, executor):
    with pytest.raises(ConfigError, match=f"{says}.*Fix: .*{fix}") as err:
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor=executor).fit(model(), tiny_data())
    assert "\n" not in str(err.value)


class _NoLossKey(TinyClassifier):
    def training_step(self, batch, batch_idx):
        return {"my_loss": super().training_step(batch, batch_idx)}


class _FloatLoss(TinyClassifier):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return 0.5


class _NoneLoss(TinyClassifier):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return {"loss": None}  # lightning.Trainer refuses it too (None alone skips the step)


@pytest.mark.parametrize("model,says", [(_NoLossKey, "returned a dict without a 'loss' tensor"),
                                        (_NoneLoss, "returned a dict without a 'loss' tensor"),
                                        (_FloatLoss, "returned a float as the loss")])
@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_a_training_step_without_a_loss_tensor_is_refused_with_the_fix(log_dir, model, says, executor):
    with pytest.raises(ConfigError, match=f"training_step=.*{says}.*Fix: return the loss tensor"):
        quiet_trainer(log_dir, rounds=1, clients_per_round=2, executor=executor).fit(model(), tiny_data())


def test_trainer_settings_are_frozen_and_read_through_the_trainer(log_dir):
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=2)
    assert trainer.rounds == 3 and trainer.settings.rounds == 3 and trainer.sampling == "uniform"
    with pytest.raises(AttributeError, match=r"trainer.rounds: the settings are frozen .* FederatedTrainer\(rounds=...\)"):
        trainer.rounds = 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.settings.rounds = 10
    assert trainer.rounds == 3
