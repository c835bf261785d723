"""``dpfl report``: plots and a table whose numbers are those of the runs' CSV logs."""

import csv
import os
import re
import statistics

import numpy as np
import pytest
import yaml

from dpfl_lightning import cli
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.reporting import write_report

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(root, name, config, rows, version=0):
    d = os.path.join(root, name, f"version_{version}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "hparams.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    keys = sorted({k for r in rows for k in r} | {"step"})
    with open(os.path.join(d, "metrics.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({**r, "step": r["round"]})


def _config(algorithm, c, seed, run_name):
    return {"trainer": {"rounds": 6, "seed": seed, "run_name": run_name, "log_dir": "/somewhere",
                        "algorithm": {"class_path": f"dpfl_lightning.algorithms.{algorithm}",
                                      "init_args": {"clip" if algorithm == "DPFedAvgClipLR" else "scale": c}}},
            "model": {"class_path": "dpfl_lightning.models.MLPClassifier", "init_args": {"lr": 0.1}},
            "data": {"class_path": "dpfl_lightning.data.Digits", "init_args": {"num_clients": 20, "seed": seed}}}


@pytest.fixture
def runs_dir(tmp_path):
    """Two algorithms x two C x three seeds; validation every 2 rounds, test after the last."""
    rng = np.random.default_rng(0)
    root = str(tmp_path / "runs")
    for algorithm in ("DPFedAvgClipLR", "DPNormFedAvg"):
        for c in (50.0, 100.0):
            for seed in (0, 1, 2):
                name = f"{algorithm}_{c:g}_s{seed}"
                rows = []
                for r in range(1, 7):
                    row = {"round": r, "clients": 5.0, "epsilon": 0.3 * r + 0.01 * seed, "round_time_s": 0.1}
                    if r % 2 == 0:
                        row.update(val_acc=float(rng.random()), val_loss=float(rng.random()))
                    if r == 6:
                        row.update(test_acc=float(rng.random()), test_loss=float(rng.random()))
                    rows.append(row)
                _write_run(root, name, _config(algorithm, c, seed, name), rows)
    return root


def _expected(root):
    """Final test_acc and epsilon per configuration, straight from the CSV files."""
    groups = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "version_0", "metrics.csv")
        with open(path) as f:
            rows = list(csv.DictReader(f))
        test = [float(r["test_acc"]) for r in rows if r["test_acc"]]
        eps = [float(r["epsilon"]) for r in rows if r["epsilon"]]
        algorithm, c, _ = name.split("_")
        groups.setdefault((algorithm, c), []).append((test[-1], eps[-1]))
    return groups


def _cells(row):
    return [c.strip() for c in row.strip().strip("|").split("|")]


def test_report_plots_and_table_match_the_csv_logs(runs_dir, tmp_path):
    out = str(tmp_path / "report")
    result = write_report(runs_dir, out=out)
    assert result["metrics"] == ["test_acc"]  # the default: the first of test_acc, val_acc, ...
    names = sorted(os.path.basename(p) for p in result["plots"])
    assert names == ["epsilon_vs_round.png", "test_acc_vs_epsilon.png", "test_acc_vs_round.png"]
    for p in result["plots"]:
        with open(p, "rb") as f:
            data = f.read()
        assert data.startswith(PNG) and len(data) > 10_000
    with open(result["table"]) as f:
        table = f.read().split("## Runs")[0]
    rows = [_cells(ln) for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| configuration")]
    assert len(rows) == 4  # seeds (trainer.seed and data.seed) and run names do not split groups
    expected = _expected(runs_dir)
    for (algorithm, c), values in expected.items():
        short = "clip" if algorithm == "DPFedAvgClipLR" else "scale"
        label = f"algorithm={algorithm}, {short}={float(c):g}"
        (row,) = [r for r in rows if r[0] == label]
        assert row[1] == "3 (0, 1, 2)" and row[2] == "6"
        for col, k in ((3, 1), (4, 0)):  # epsilon, test_acc
            vals = [v[k] for v in values]
            mean, std = map(float, re.fullmatch(r"(\S+) ± (\S+)", row[col]).groups())
            assert mean == pytest.approx(statistics.fmean(vals), rel=5e-4)
            assert std == pytest.approx(statistics.stdev(vals), rel=5e-2)


def test_report_command_with_chosen_metrics(runs_dir, tmp_path, capsys):
    out = str(tmp_path / "r2")
    cli.main(["report", runs_dir, "--metric", "val_acc,val_loss", "--out", out])
    printed = capsys.readouterr().out
    assert "| configuration | seeds | rounds | epsilon | val_acc | val_loss |" in printed
    assert sorted(os.listdir(out)) == ["epsilon_vs_round.png", "summary.md", "val_acc_vs_epsilon.png",
                                       "val_acc_vs_round.png", "val_loss_vs_epsilon.png", "val_loss_vs_round.png"]
    with pytest.raises(ConfigError, match="not logged"):
        write_report(runs_dir, metric="nonsense", out=out)


def test_report_without_privacy_or_known_metrics(tmp_path):
    root = str(tmp_path / "runs")
    for seed in (0, 1):
        _write_run(root, f"q{seed}", {"trainer": {"seed": seed}},
                   [{"round": r, "suboptimality": 1.0 / r + seed} for r in (1, 2, 3)])
    result = write_report(root)
    assert result["metrics"] == ["suboptimality"]
    assert [os.path.basename(p) for p in result["plots"]] == ["suboptimality_vs_round.png"]
    with open(result["table"]) as f:
        text = f.read()
    assert "| all runs | 2 (0, 1) | 3 | 0.8333 ± 0.71 |" in text
    with pytest.raises(ConfigError, match="no metrics.csv"):
        write_report(os.path.join(root, "report"))  # the report directory itself holds no runs
