"""``dpfl report``: plots and a table whose numbers are those of the runs' CSV logs."""

import csv
import os
import re
import statistics

import numpy as np
import pytest
import yaml

from dpfl_lightning.cli import command as cli
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.tracking.report import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


MODELS = "epsilon_client_distributed_models"
EPSILONS = {"epsilon": {"guarantee": "client_distributed", "granularity": "client", "audience": "server",
                        "towards": "towards the server", "delta": 1e-6},
            MODELS: {"guarantee": "client_distributed_models", "granularity": "client", "audience": "models",
                     "towards": "towards anyone who sees the models but not who took part", "delta": 1e-6}}


def _config(algorithm, c, seed, run_name):
    return {"seed_everything": seed,
            "trainer": {"rounds": 6, "seed": seed, "run_name": run_name, "log_dir": "/somewhere",
                        "algorithm": {"class_path": f"dpfl_lightning.algorithms.{algorithm}",
                                      "init_args": {"clip" if algorithm == "DPFedAvgClipLR" else "scale": c}}},
            "model": {"class_path": "dpfl_lightning.models.MLPClassifier", "init_args": {"lr": 0.1}},
            "data": {"class_path": "dpfl_lightning.data.Digits", "init_args": {"num_clients": 20, "seed": seed}},
            "privacy": {"delta": 1e-6, "epsilons": EPSILONS}}


def _rows(rng, seed):
    rows = []
    for r in range(1, 7):
        row = {"round": r, "clients": 5.0, "epsilon": 0.3 * r + 0.01 * seed, MODELS: 0.1 * r, "round_time_s": 0.1}
        if r % 2 == 0:
            row.update(val_acc=float(rng.random()), val_loss=float(rng.random()))
        if r == 6:
            row.update(test_acc=float(rng.random()), test_loss=float(rng.random()))
        rows.append(row)
    return rows


@pytest.fixture
def runs_dir(tmp_path):
    """Two algorithms x two C x three seeds; validation every 2 rounds, test after the last; two
    epsilons (towards the server, towards whoever sees the models). One configuration and seed was
    run twice before (an older run, with other values): it must not count as a fourth seed."""
    rng = np.random.default_rng(0)
    root = str(tmp_path / "runs")
    _write_run(root, "DPFedAvgClipLR_50_s0_before", _config("DPFedAvgClipLR", 50.0, 0, "before"), _rows(rng, 0))
    os.utime(os.path.join(root, "DPFedAvgClipLR_50_s0_before", "version_0", "metrics.csv"), (1e9, 1e9))
    for algorithm in ("DPFedAvgClipLR", "DPNormFedAvg"):
        for c in (50.0, 100.0):
            for seed in (0, 1, 2):
                name = f"{algorithm}_{c:g}_s{seed}"
                _write_run(root, name, _config(algorithm, c, seed, name), _rows(rng, seed))
    return root


@pytest.fixture
def drawn(monkeypatch):
    """The axis labels and title of every figure saved (through matplotlib's own savefig)."""
    import matplotlib.figure

    seen = {}
    save = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kwargs):
        ax = fig.axes[0]
        seen[os.path.basename(str(path))] = (ax.get_xlabel(), ax.get_ylabel(), ax.get_title(),
                                             [ln.get_label() for ln in ax.get_lines()])
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return seen


def _expected(root):
    """Final test_acc and epsilon per configuration, straight from the CSV files."""
    groups = {}
    for name in sorted(os.listdir(root)):
        if name.endswith("_before"):
            continue  # the older run of a seed that was run again
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


def test_report_plots_and_table_match_the_csv_logs(runs_dir, tmp_path, drawn):
    out = str(tmp_path / "report")
    result = write_report(runs_dir, out=out)
    assert result["metrics"] == ["test_acc"]  # the default: the first of test_acc, val_acc, ...
    names = sorted(os.path.basename(p) for p in result["plots"])
    # named after what they plot: test_acc is logged once, so the curve over rounds is val_acc's
    assert names == ["epsilon_client_distributed_models_vs_round.png", "epsilon_vs_round.png",
                     "test_acc_vs_epsilon.png", "test_acc_vs_epsilon_client_distributed_models.png",
                     "val_acc_vs_round.png"]
    for p in result["plots"]:
        with open(p, "rb") as f:
            data = f.read()
        assert data.startswith(PNG) and len(data) > 10_000
    assert drawn["val_acc_vs_round.png"][1] == "val_acc"
    # every epsilon axis names its guarantee: audience and delta
    assert drawn["epsilon_vs_round.png"][1] == "epsilon\n(client-level, towards the server, delta=1e-06)"
    column, *guarantee = drawn["test_acc_vs_epsilon_client_distributed_models.png"][0].split("\n")
    assert column == MODELS and all(len(ln) <= 60 for ln in guarantee)  # wrapped to stay on the image
    assert " ".join(guarantee) == "(client-level, towards anyone who sees the models but not who took part, delta=1e-06)"
    with open(result["table"]) as f:
        text = f.read()
    table = text.split("## Runs")[0]
    assert "- `epsilon`: client-level, towards the server, delta=1e-06" in table
    assert "DPFedAvgClipLR_50_s0_before (as DPFedAvgClipLR_50_s0)" in table
    rows = [_cells(ln) for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| configuration")]
    assert len(rows) == 4  # seeds (trainer.seed, data.seed, seed_everything) and run names do not split groups
    expected = _expected(runs_dir)
    for (algorithm, c), values in expected.items():
        short = "clip" if algorithm == "DPFedAvgClipLR" else "scale"
        label = f"algorithm={algorithm}, {short}={float(c):g}"
        (row,) = [r for r in rows if r[0] == label]
        repeated = " +1 repeated" if (algorithm, c) == ("DPFedAvgClipLR", "50") else ""
        assert row[1] == "3 (0, 1, 2)" + repeated and row[2] == "6"
        for col, k in ((3, 1), (5, 0)):  # epsilon, test_acc: over the three distinct seeds only
            vals = [v[k] for v in values]
            mean, std = map(float, re.fullmatch(r"(\S+) ± (\S+)", row[col]).groups())
            assert mean == pytest.approx(statistics.fmean(vals), rel=5e-4)
            assert std == pytest.approx(statistics.stdev(vals), rel=5e-2)


def test_a_configuration_run_twice_with_one_seed_is_not_averaged(tmp_path):
    root = str(tmp_path / "runs")
    for name, value in (("old", 0.2), ("new", 0.6)):
        _write_run(root, name, {"trainer": {"seed": 7}}, [{"round": 1, "suboptimality": value}])
        stamp = 1e9 if name == "old" else 2e9
        os.utime(os.path.join(root, name, "version_0", "metrics.csv"), (stamp, stamp))
    with open(write_report(root)["table"]) as f:
        text = f.read()
    assert "| all runs | 1 (7) +1 repeated | 1 | 0.6 |" in text  # the newest, not "2 seeds ± 0"
    assert "| old | all runs | 7 (repeat: not averaged) |" in text


def test_report_of_a_dp_run_names_each_guarantee(tmp_path):
    """A real run with distributed noise logs two epsilons; the report says which is which."""
    log_dir = str(tmp_path / "runs")
    cli.main(["fit", "--config", os.path.join(ROOT, "configs", "quickstart.yaml"), "--trainer.rounds", "2",
              "--trainer.algorithm.init_args.placement", "distributed", "--data.init_args.num_clients", "40",
              "--trainer.enable_progress_bar", "false", "--trainer.enable_summary", "false",
              "--trainer.loggers", "[]", "--trainer.log_dir", log_dir])
    result = write_report(log_dir)
    assert result["epsilons"] == ["epsilon", "epsilon_client_distributed_models"]
    with open(result["table"]) as f:
        text = f.read()
    assert "- `epsilon`: client-level, towards the server, delta=0.001" in text
    assert "- `epsilon_client_distributed_models`: client-level, towards anyone who sees the models" in text


def test_report_command_with_chosen_metrics(runs_dir, tmp_path, capsys):
    out = str(tmp_path / "r2")
    cli.main(["report", runs_dir, "--metric", "val_acc,val_loss", "--out", out])
    printed = capsys.readouterr().out
    assert f"| configuration | seeds | rounds | epsilon | {MODELS} | val_acc | val_loss |" in printed
    cli.main(["report", runs_dir, "--metric", "val_acc,val_loss", "--epsilon", MODELS, "--out", out + "2"])
    assert sorted(os.listdir(out + "2")) == [f"{MODELS}_vs_round.png", "summary.md", f"val_acc_vs_{MODELS}.png",
                                             "val_acc_vs_round.png", f"val_loss_vs_{MODELS}.png",
                                             "val_loss_vs_round.png"]
    with pytest.raises(ConfigError, match="not logged"):
        write_report(runs_dir, metric="nonsense", out=out)
    with pytest.raises(ConfigError, match="not logged"):
        write_report(runs_dir, epsilon="epsilon_record", out=out)


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


def test_a_mixed_directory_labels_its_configurations_briefly_and_keys_them_in_the_table(tmp_path, monkeypatch):
    """Runs of unrelated configurations differ in dozens of settings: each full label would run to
    hundreds of characters and off the image. The plots number them and cut them to 60 characters,
    the legend and the axis labels stay inside the figure, and summary.md gives every full label
    under its number."""
    import matplotlib.figure

    root = str(tmp_path / "runs")
    settings = {f"setting_{k}": k for k in range(30)}
    for i in range(3):
        config = {"trainer": {"seed": 0, "rounds": 2 + i, **{f"{k}_{i}": v for k, v in settings.items()}},
                  "model": {"class_path": f"pkg.models.Model{i}", "init_args": {f"width_{i}": 10 * i}}}
        _write_run(root, f"mixed_{i}", config, [{"round": 1, "val_acc": 0.1 * i}, {"round": 2, "val_acc": 0.2 * i}])
    outside = {}
    save = matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kwargs):
        fig.tight_layout()
        fig.canvas.draw()
        box = fig.bbox
        ax = fig.axes[0]
        parts = [ax.get_legend(), ax.xaxis.label, ax.yaxis.label, ax.title]
        outside[os.path.basename(str(path))] = [
            p.get_window_extent() for p in parts if p is not None and p.get_visible() and p.get_window_extent().width
            and not (box.x0 - 1 <= p.get_window_extent().x0 and p.get_window_extent().x1 <= box.x1 + 1)]
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    result = write_report(root, out=str(tmp_path / "report"))
    groups = result["groups"]
    assert len(groups) == 3 and all(len(g.label) > 500 for g in groups)  # what the plots must not show
    assert all(len(g.short) <= 60 for g in groups)
    assert [g.short.split(" ")[0] for g in groups] == ["[1]", "[2]", "[3]"]
    assert outside and all(v == [] for v in outside.values()), outside
    with open(result["table"]) as f:
        text = f.read()
    for g in groups:
        assert f"- {g.short.split(' ')[0]} {g.label}\n" in text  # the key: number -> the whole label
        assert f"| {g.short} |" in text and f"| {g.label} |" not in text


def test_constant_metrics_are_tabled_not_plotted_and_display_settings_never_label_a_configuration(tmp_path, drawn):
    """A DP-FedAvg sweep over lr logs its fixed clip norm and noise level every round: a plot of
    them against rounds or epsilon would be flat lines. Runs that differ in a display or logging
    setting only (progress bar, test after fit) are one configuration."""
    root = str(tmp_path / "runs")
    for lr in (0.1, 0.3):
        for seed, bar in ((0, True), (1, False)):
            config = {"trainer": {"seed": seed, "enable_progress_bar": bar, "test_after_fit": bar,
                                  "log_client_metrics": bar},
                      "model": {"init_args": {"lr": lr}}, "privacy": {"delta": 1e-6, "epsilons": EPSILONS}}
            rows = [{"round": r, "epsilon": 0.5 * r, "clip_norm": 1.0, "noise_std": 2.5,
                     "distance_to_optimum": lr / r + seed} for r in (1, 2, 3)]
            _write_run(root, f"lr{lr}_s{seed}", config, rows)
    result = write_report(root)
    assert sorted(result["metrics"]) == ["clip_norm", "distance_to_optimum", "noise_std"]  # none preferred: all, tabled
    assert sorted(drawn) == ["distance_to_optimum_vs_epsilon.png", "distance_to_optimum_vs_round.png",
                             "epsilon_vs_round.png"]
    assert sorted(os.path.basename(p) for p in result["plots"]) == sorted(drawn)
    with open(result["table"]) as f:
        text = f.read()
    assert "Not plotted (one value in every run and round): `clip_norm` = 1, `noise_std` = 2.5." in text
    assert sorted(g.label for g in result["groups"]) == ["lr=0.1", "lr=0.3"]  # two configurations, two seeds each
    assert all(len(g.counted) == 2 for g in result["groups"])
    assert "enable_progress_bar" not in text and "test_after_fit" not in text and "log_client_metrics" not in text
    # a sweep directory: its own metric by default, and a requested constant is tabled only
    sweep_dir = tmp_path / "sweep"
    os.makedirs(sweep_dir)
    os.rename(root, sweep_dir / "runs")
    (sweep_dir / "sweep.yaml").write_text(yaml.safe_dump({"metric": {"name": "distance_to_optimum",
                                                                    "goal": "minimize"}}))
    drawn.clear()
    assert write_report(str(sweep_dir))["metrics"] == ["distance_to_optimum"]
    result = write_report(str(sweep_dir), metric="noise_std", out=str(tmp_path / "r2"))
    assert [os.path.basename(p) for p in result["plots"]] == ["epsilon_vs_round.png"]
    assert "| noise_std |" in open(result["table"]).read()
