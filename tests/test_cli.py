"""The ``dpfl`` command: YAML layout, overrides, --print_config, resume, W&B offline."""

import csv
import glob
import os

import pytest
import yaml

from dpfl_lightning import cli
from dpfl_lightning import checkpoint as ckpt

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
              "--resume", ckpts[0]])
    full = ckpt.load(ckpts[1])
    rows = _metrics(b)
    assert [int(float(r["round"])) for r in rows if r.get("round")] == [3, 4]
    assert float(rows[-1]["val_acc"]) == pytest.approx(full["history"][-1]["val_acc"])


def test_wandb_offline_logger_from_yaml(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    wb = tmp_path / "wb.yaml"
    wb.write_text(yaml.safe_dump({"trainer": {"loggers": [{"class_path": "dpfl_lightning.loggers.WandbLogger",
                                                           "init_args": {"mode": "offline", "project": "p",
                                                                         "tags": ["t"], "save_dir": str(tmp_path)}}]}}))
    cli.main(["fit", "--config", QUICKSTART, "--config", str(wb), *SMALL, "--trainer.log_dir", str(tmp_path / "runs")])
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*"))


def test_auto_wandb_mode_without_key(monkeypatch, tmp_path):
    from dpfl_lightning.loggers import resolve_wandb_mode

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
