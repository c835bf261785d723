"""The ``dpfl`` command: YAML layout, overrides, --print_config, resume, W&B offline, one-line parse
errors, a LightningDataModule under data:, the saved config.yaml, validate / test / predict."""

import csv
import glob
import os
import re
import textwrap

import pytest
import yaml

from dpfl_lightning.cli import command as cli
from dpfl_lightning.run import checkpoint_format as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
SMALL = ["--trainer.rounds", "3", "--trainer.clients_per_round", "10", "--trainer.enable_progress_bar", "false",
         "--trainer.num_threads", "1", "--trainer.eval_every", "1"]


def _metrics(log_dir):
    (path,) = glob.glob(os.path.join(log_dir, "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


def test_quickstart_config_runs_and_logs(tmp_path):
    log_dir = str(tmp_path / "runs")
    cli.main(["fit", "--config", QUICKSTART, *SMALL, "--trainer.log_dir", log_dir])
    rows = _metrics(log_dir)
    assert [int(float(r["round"])) for r in rows if r.get("round")] == [1, 2, 3]
    assert all(float(r["val_acc"]) >= 0 for r in rows if r.get("val_acc"))
    (hp,) = glob.glob(os.path.join(log_dir, "**", "hparams.yaml"), recursive=True)
    with open(hp) as f:
        logged = yaml.safe_load(f)
    assert logged["trainer"]["rounds"] == 3  # the resolved config, overrides included
    assert logged["model"]["class_path"] == "dpfl_lightning.models.MLPClassifier"


def test_print_config_resolves_overrides(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", QUICKSTART, "--model.init_args.lr", "0.05", "--print_config"])
    assert exit_info.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["model"]["init_args"]["lr"] == 0.05
    assert cfg["trainer"]["algorithm"]["class_path"] == "dpfl_lightning.algorithms.DPFedAvg"


def test_resume_from_the_command_line(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cli.main(["fit", "--config", QUICKSTART, *SMALL, "--trainer.rounds", "4", "--trainer.checkpoint_every", "2",
              "--trainer.log_dir", a])
    ckpts = sorted(glob.glob(os.path.join(a, "**", "round-*.ckpt"), recursive=True))
    assert [os.path.basename(p) for p in ckpts] == ["round-000002.ckpt", "round-000004.ckpt"]
    cli.main(["fit", "--config", QUICKSTART, *SMALL, "--trainer.rounds", "4", "--trainer.log_dir", b,
              "--ckpt_path", ckpts[0]])  # LightningCLI's name (--resume is the same)
    full = ckpt.load(ckpts[1])
    rows = _metrics(b)
    assert [int(float(r["round"])) for r in rows if r.get("round")] == [3, 4]
    assert float(rows[-1]["val_acc"]) == pytest.approx(full["history"][-1]["val_acc"])


def test_wandb_offline_logger_from_yaml(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    wb = tmp_path / "wb.yaml"
    wb.write_text(yaml.safe_dump({"trainer": {"loggers": [{"class_path": "dpfl_lightning.tracking.loggers.WandbLogger",
                                                           "init_args": {"mode": "offline", "project": "p",
                                                                         "tags": ["t"], "save_dir": str(tmp_path)}}]}}))
    cli.main(["fit", "--config", QUICKSTART, "--config", str(wb), *SMALL, "--trainer.log_dir", str(tmp_path / "runs")])
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*"))


def test_auto_wandb_mode_without_key(monkeypatch, tmp_path):
    from dpfl_lightning.tracking.loggers import resolve_wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert resolve_wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("auto") == "disabled"


@pytest.mark.parametrize("config", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_every_shipped_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", config, "--print_config"])
    assert exit_info.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]


def test_resume_reports_changed_settings(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cli.main(["fit", "--config", QUICKSTART, *SMALL, "--trainer.rounds", "2", "--trainer.checkpoint_every", "1",
              "--trainer.log_dir", a])
    (first,) = glob.glob(os.path.join(a, "**", "round-000001.ckpt"), recursive=True)
    capsys.readouterr()
    cli.main(["fit", "--config", QUICKSTART, *SMALL, "--trainer.rounds", "2", "--trainer.log_dir", b,
              "--model.init_args.lr", "0.05", "--trainer.algorithm.init_args.clip", "2.0", "--resume", first])
    out = capsys.readouterr().out
    assert "model.init_args.lr: 0.5 -> 0.05" in out and "clip: 1.0 -> 2.0" in out
    assert "trainer.rounds" not in out and "log_dir" not in out


# ---------------------------------------------------------------------------------------- parse errors
@pytest.fixture
def broken_files(tmp_path):
    (tmp_path / "unknown_key.yaml").write_text("trainer:\n  roundz: 3\n")
    (tmp_path / "syntax.yaml").write_text("trainer:\n  rounds: [3\n")
    (tmp_path / "bad_class.yaml").write_text("trainer:\n  plugins:\n    - class_path: dpfl_lightning.plugins.UpdateClippin\n")
    (tmp_path / "unknown_plugin.yaml").write_text("trainer:\n  plugins:\n    - class_path: dpfl_lightning.plugins.Denoiser\n")
    (tmp_path / "wrong_type.yaml").write_text("trainer:\n  clients_per_round: ten\n")
    (tmp_path / "nan.yaml").write_text("trainer:\n  plugins:\n    - class_path: dpfl_lightning.plugins.GaussianNoise\n"
                                       "      init_args: {noise_multiplier: nan}\n")
    return tmp_path


@pytest.mark.parametrize("args,needles", [
    (["--trainer.roundz", "3"], ["trainer.roundz=3: not a trainer option", "did you mean trainer.rounds?"]),
    (["--trainer.rounds", "abc"], ["trainer.rounds=abc: not an int"]),
    (["--model", "MLPClasifier"], ["model=MLPClasifier: no such class", "did you mean MLPClassifier?"]),
    (["--model.init_args.lrr", "0.1"], ["model.init_args.lrr: MLPClassifier has no argument lrr",
                                        "did you mean model.init_args.lr?"]),
    (["--trainer.algorithm.init_args.clipp", "2"], ["did you mean trainer.algorithm.init_args.clip?"]),
    (["--trainer.max_epochs", "3"], ["trainer.max_epochs=3: FederatedTrainer has no max_epochs", "trainer.rounds"]),
    (["--trainer.devices", "2"], ["trainer.devices=2", "mpiexec -n N"]),
    (["--data", "mypkg.MyDataModule"], ["data=mypkg.MyDataModule: cannot import it", "PYTHONPATH"]),
    (["--config", "{dir}/missing.yaml"], ["--config {dir}/missing.yaml: no such file"]),
    (["--config", "{dir}/syntax.yaml"], ["--config {dir}/syntax.yaml: not valid YAML at line 3"]),
    (["--config", "{dir}/unknown_key.yaml"], ["trainer.roundz (in a --config file)", "did you mean trainer.rounds?"]),
    (["--config", "{dir}/bad_class.yaml"], ["did you mean dpfl_lightning.plugins.UpdateClipping?"]),
    # a class that exists but is no LightningModule: say so, and how to wrap a plain nn.Module
    (["--model", "torch.nn.Linear"], ["model=torch.nn.Linear: a plain torch.nn.Module, not a LightningModule",
                                      "Fix: wrap it", "dpfl_lightning.models.SupervisedModule",
                                      "net: {class_path: torch.nn.Linear"]),
    # an unknown plugin with no close name: the plugins there are, by class path
    (["--config", "{dir}/unknown_plugin.yaml"], ["trainer.plugins=dpfl_lightning.plugins.Denoiser: no such class",
                                                 "Fix: use one of", "dpfl_lightning.plugins.UpdateClipping",
                                                 "dpfl_lightning.plugins.GaussianNoise", "dpfl_lightning.plugins.DPSGD"]),
    (["--data", "dpfl_lightning.plugins.GaussianNoise"], ["data=dpfl_lightning.plugins.GaussianNoise: GaussianNoise "
                                                          "is not a data module", "dpfl_lightning.data.Digits"]),
    # a wrong type, in a file or on the command line: the key, the value and the type wanted
    (["--config", "{dir}/wrong_type.yaml"], ["trainer.clients_per_round=ten: expected int or null",
                                             "Fix: give an int or null"]),
    (["--trainer.clients_per_round", "ten"], ["trainer.clients_per_round=ten: expected int or null"]),
    # NaN is a float to YAML and argparse alike: the setting must be finite
    (["--config", "{dir}/nan.yaml"], ["noise_multiplier=nan: must be a finite number", "Fix: give a finite float"]),
    (["--trainer.algorithm.init_args.noise_multiplier", "nan"], [
        "trainer.algorithm.init_args.noise_multiplier=nan: must be a finite number", "Fix: give a finite float"]),
    (["--trainer.algorithm.init_args.clip=-inf"], ["trainer.algorithm.init_args.clip=-inf: must be a finite"]),
])
def test_a_bad_command_line_is_one_line_with_the_closest_valid_name(args, needles, broken_files, capsys):
    args = [a.replace("{dir}", str(broken_files)) for a in args]
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", QUICKSTART, *args])
    assert info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpfl: error: fit: "), captured.err
    assert "usage:" not in captured.err and not captured.out
    for needle in needles:
        assert needle.replace("{dir}", str(broken_files)) in lines[0]


def test_a_model_file_whose_own_import_fails_is_reported_with_its_error(tmp_path, monkeypatch, capsys):
    # the file is there: its own import of a missing package fails, not the directory it is in
    (tmp_path / "brokenmodels.py").write_text("import lightning\n\nimport no_such_package_here\n\n\n"
                                              "class Model(lightning.LightningModule):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", QUICKSTART, "--model", "brokenmodels.Model"])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dpfl: error: fit: model=brokenmodels.Model: importing brokenmodels fails in its own code")
    assert f"{tmp_path / 'brokenmodels.py'} line 3: ModuleNotFoundError: No module named 'no_such_package_here'" in line
    assert "Fix: correct brokenmodels.py" in line and "PYTHONPATH" not in line


def test_a_misspelled_subcommand_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["fitt"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == "dpfl: error: fitt: no such command. Fix: did you mean fit?"


# ---------------------------------------------------------------------------------------- a LightningDataModule
LDM = textwrap.dedent("""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    class BlobsDataModule(L.LightningDataModule):
        def __init__(self, n: int = 300, batch_size: int = 16):
            super().__init__()
            self.n, self.batch_size = n, batch_size

        def setup(self, stage=None):
            g = torch.Generator().manual_seed(0)
            y = torch.randint(0, 3, (self.n,), generator=g)
            x = torch.randn(self.n, 8, generator=g) + y[:, None].float()
            self.train, self.test = TensorDataset(x[:200], y[:200]), TensorDataset(x[200:], y[200:])

        def train_dataloader(self):
            return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

        def test_dataloader(self):
            return DataLoader(self.test, batch_size=50)
""")


def _user_run(tmp_path, monkeypatch, *extra):
    """``data:`` a LightningDataModule of the user's own module, in the working directory."""
    (tmp_path / "userdata.py").write_text(LDM)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "trainer": {"rounds": 2, "clients_per_round": 5, "batch_size": 16, "enable_progress_bar": False,
                    "enable_summary": False, "test_after_fit": True, "num_threads": 1, "log_dir": "runs"},
        "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                  "init_args": {"in_features": 8, "hidden": [], "num_classes": 3}},
        "data": {"class_path": "userdata.BlobsDataModule", "init_args": {"batch_size": 16}},
        "split": {"num_clients": 20, "partition": "dirichlet", "alpha": 0.5}}))
    monkeypatch.chdir(tmp_path)
    parser = cli.build_parser()
    return cli.run_fit(parser, cli.parse(parser, ["fit", "-c", "run.yaml", *extra]))


def test_a_lightning_datamodule_under_data_is_split_as_split_says(tmp_path, monkeypatch, capsys):
    trainer = _user_run(tmp_path, monkeypatch)
    assert type(trainer.data.datamodule).__name__ == "BlobsDataModule"
    assert trainer.data.num_clients == 20 and trainer.data.partition == "dirichlet"
    assert "test_acc" in trainer.history[-1]
    # ... and the trained run tests under lightning.Trainer from its directory alone
    capsys.readouterr()
    cli.main(["test", "--ckpt_path", "runs/dpfl"])
    out = capsys.readouterr().out
    m = re.search(r"test_acc\s*│\s*([0-9.]+)", out)
    assert m and float(m.group(1)) == pytest.approx(trainer.history[-1]["test_acc"], abs=1e-6)


def test_split_options_with_a_federated_data_module_are_refused(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", QUICKSTART, "--split.num_clients", "7"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "split.num_clients=7" in err and "data.init_args.num_clients" in err


# ---------------------------------------------------------------------------------------- saved config, stages
def test_the_saved_config_reruns_the_run_exactly(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cli.main(["fit", "-c", QUICKSTART, *SMALL, "--seed_everything", "5", "--model.init_args.lr", "0.3",
              "--trainer.log_dir", a])
    (saved,) = glob.glob(os.path.join(a, "quickstart", "version_0", "config.yaml"))
    with open(saved) as f:
        config = yaml.safe_load(f)
    assert config["seed_everything"] == 5 and config["model"]["init_args"]["lr"] == 0.3
    assert "ckpt_path" not in config and "config" not in config
    cli.main(["fit", "--config", saved, "--trainer.log_dir", b])
    first, second = _metrics(a), _metrics(b)
    keys = ["round", "epsilon", "val_acc", "val_loss", "test_acc"]
    assert [[r.get(k) for k in keys] for r in first] == [[r.get(k) for k in keys] for r in second]
    # the run's hparams.yaml holds its privacy settings too, which fit would refuse: config.yaml is the one
    with open(os.path.join(a, "quickstart", "version_0", "hparams.yaml")) as f:
        assert "privacy" in yaml.safe_load(f)


def test_validate_test_and_predict_a_trained_run(tmp_path, capsys):
    log_dir = str(tmp_path / "runs")
    cli.main(["fit", "-c", QUICKSTART, *SMALL, "--trainer.log_dir", log_dir])
    last = _metrics(log_dir)[-1]
    run_dir = os.path.join(log_dir, "quickstart")
    final = os.path.join(run_dir, "version_0", "checkpoints", "final.ckpt")
    config = os.path.join(run_dir, "version_0", "config.yaml")
    capsys.readouterr()
    for args, key in ((["test", "--ckpt_path", run_dir], "test_acc"),
                      (["test", "-c", config, "--ckpt_path", final], "test_acc"),
                      (["validate", "--ckpt_path", os.path.join(run_dir, "version_0")], "val_acc")):
        cli.main(args)
        printed = capsys.readouterr()
        out = printed.out
        m = re.search(key + r"\s*│\s*([0-9.]+)", out)
        assert m and float(m.group(1)) == pytest.approx(float(last[key]), abs=1e-6), (args, out)
        with open(os.path.join(run_dir, "version_0", "hparams.yaml")) as f:  # the statement fit logged and printed
            statement = yaml.safe_load(f)["privacy"]["guarantees"]
        assert [f"privacy: {line}" for line in statement] == printed.err.splitlines()[1:len(statement) + 1]
    out = str(tmp_path / "pred.pt")
    cli.main(["predict", "--ckpt_path", run_dir, "--out", out])
    import torch

    logits = torch.cat(torch.load(out))
    assert logits.shape == (360, 10)  # the digits test set: inputs only went to the default predict_step


def test_under_wandb_agent_a_run_without_a_wandb_logger_gets_one(tmp_path, monkeypatch):
    from dpfl_lightning.tracking.loggers import WandbLogger

    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    parser = cli.build_parser()
    cfg = cli.parse(parser, ["fit", "-c", QUICKSTART, *SMALL, "--trainer.rounds", "1", "--trainer.loggers", "[]",
                             "--trainer.log_dir", str(tmp_path)])
    trainer = cli.run_fit(parser, cfg)
    assert [type(lg) for lg in trainer.extra_loggers] == [WandbLogger]


def test_privacy_epsilon_splits_a_lightning_datamodule_as_fit_does(tmp_path, monkeypatch, capsys):
    # dpfl privacy epsilon on the same config as a DP fit: the plain DataModule is split by `split:`
    # (20 clients: Poisson rate 5/20), and the planned epsilon is the one the fit logs
    dp = ["--trainer.algorithm", "dpfl_lightning.algorithms.DPFedAvg", "--trainer.algorithm.clip", "1.0",
          "--trainer.algorithm.noise_multiplier", "1.5", "--trainer.sampling", "poisson"]
    trainer = _user_run(tmp_path, monkeypatch, *dp)
    capsys.readouterr()
    cli.main(["privacy", "epsilon", "-c", "run.yaml", *dp])
    out = capsys.readouterr().out
    planned = float(re.search(r"epsilon = ([0-9.]+) after 2 rounds", out).group(1))
    assert "q=0.25" in out
    assert planned == pytest.approx(trainer.history[-1]["epsilon"], abs=1e-4)
