"""``dpfl sweep``: W&B sweep files run as separate ``dpfl fit`` runs, resumable, without a server."""

import csv
import glob
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import pytest
import yaml

from dpfl_lightning.cli import command as cli
from dpfl_lightning.tracking import sweep
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.tracking.report import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = ["${env}", "${interpreter}", "-m", "dpfl_lightning", "fit", "--config", "{base}", "${args}"]
BASE = {"trainer": {"rounds": 2, "clients_per_round": 4, "batch_size": 16, "enable_progress_bar": False,
                    "enable_summary": False, "test_after_fit": True,
                    "algorithm": {"class_path": "dpfl_lightning.algorithms.FedAvg"}},
        "model": {"class_path": "dpfl_lightning.models.MLPClassifier",
                  "init_args": {"in_features": 64, "hidden": [8], "num_classes": 10}},
        "data": {"class_path": "dpfl_lightning.data.Digits", "init_args": {"num_clients": 8}}}


def _write(tmp_path, parameters, method="grid", **extra):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(BASE))
    spec = {"method": method, "metric": {"name": "test_acc", "goal": "maximize"}, "program": "dpfl_lightning/__main__.py",
            "command": [c.replace("{base}", str(base)) for c in COMMAND], "parameters": parameters, **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


@pytest.fixture(autouse=True)
def _quiet_runs(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")


def test_grid_sweep_runs_each_configuration_once_and_a_rerun_skips_them(tmp_path):
    path = _write(tmp_path, {"trainer.seed": {"values": [0, 1]}, "model.init_args.lr": {"values": [0.1, 0.5]},
                             "trainer.rounds": {"value": 2}})
    out = io.StringIO()
    results = sweep.run(path, directory=str(tmp_path / "sw"), jobs=2, out=out)
    assert [r.status for r in results] == ["done"] * 4, out.getvalue()
    names = [r.name for r in results]
    assert names == ["seed=0_lr=0.1", "seed=0_lr=0.5", "seed=1_lr=0.1", "seed=1_lr=0.5"]  # constants left out
    for r in results:
        (hp,) = glob.glob(str(tmp_path / "sw" / "runs" / r.name / "version_0" / "hparams.yaml"))
        with open(hp) as f:
            cfg = yaml.safe_load(f)
        # every parameter reached the run as a command-line override
        assert cfg["trainer"]["seed"] == r.params["trainer.seed"]
        assert cfg["model"]["init_args"]["lr"] == r.params["model.init_args.lr"]
        assert cfg["trainer"]["run_name"] == r.name
        with open(tmp_path / "sw" / "done" / f"{r.name}.json") as f:
            assert json.load(f)["seconds"] > 0  # no DP: the run's duration is kept
        with open(os.path.join(os.path.dirname(hp), "metrics.csv")) as f:
            rows = [row for row in csv.DictReader(f) if row.get("test_acc")]
        assert r.metric == pytest.approx(float(rows[-1]["test_acc"]))
    assert "sweep runs" in out.getvalue() and "seed=1_lr=0.5" in out.getvalue()
    logs = sorted(glob.glob(str(tmp_path / "sw" / "logs" / "*.log")))
    mtimes = [os.path.getmtime(p) for p in logs]

    again = sweep.run(path, directory=str(tmp_path / "sw"), jobs=2, out=io.StringIO())
    assert [r.status for r in again] == ["skipped"] * 4
    assert [os.path.getmtime(p) for p in logs] == mtimes  # nothing ran again

    # the report of the sweep: one group per learning rate, mean and std over the two seeds
    report = write_report(str(tmp_path / "sw"))
    with open(report["table"]) as f:
        table = f.read()
    for lr in (0.1, 0.5):
        values = [r.metric for r in results if r.params["model.init_args.lr"] == lr]
        row = next(ln for ln in table.splitlines() if ln.startswith(f"| lr={lr} |"))
        assert f"{statistics.fmean(values):.4g} ± {statistics.stdev(values):.2g}" in row


def test_failed_run_is_reported_and_retried(tmp_path):
    path = _write(tmp_path, {"trainer.rounds": {"values": [0]}})
    results = sweep.run(path, directory=str(tmp_path / "sw"), out=io.StringIO())
    (r,) = results
    assert r.status == "failed" and r.returncode == 2
    assert "trainer.rounds" in r.message and "Fix:" in r.message  # the run's own one-line error
    with open(tmp_path / "sw" / "failed" / f"{r.name}.json") as f:
        assert json.load(f)["returncode"] == 2
    assert not os.path.exists(tmp_path / "sw" / "done" / f"{r.name}.json")
    # a rerun tries it again (shown here without running it)
    out = io.StringIO()
    (again,) = sweep.run(path, directory=str(tmp_path / "sw"), dry_run=True, out=out)
    assert again.status == "dry-run" and "--trainer.rounds=0" in out.getvalue()


def test_sweep_command_exit_status(tmp_path, capsys):
    path = _write(tmp_path, {"trainer.rounds": {"values": [1]}}, method="bayes")
    with pytest.raises(SystemExit) as info:
        cli.main(["sweep", path])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "method='bayes'" in err[0] and "wandb agent" in err[0]


@pytest.mark.parametrize("parameters,method,extra,needle", [
    ({"x": {"distribution": "beta", "a": 1, "b": 2}}, "random", {"run_cap": 2}, "not supported"),
    ({"x": {"min": 0.0, "max": 1.0}}, "grid", {}, "a grid needs value or values"),
    ({"x": {"values": [1, 2]}}, "random", {}, "needs a number of runs"),
    ({"trainer": {"parameters": {"rounds": {"value": 2}}}}, "grid", {}, "nested parameters"),
    ({"x": {"distribution": "log_uniform_values", "min": 0.0, "max": 1.0}}, "random", {"run_cap": 1}, "min > 0"),
    ({"x": {"values": []}}, "grid", {}, "non-empty list"),
    ({"x": {"values": [1]}}, "grid", {"command": ["${interpreter}", "${nonsense}"]}, "unknown macro"),
])
def test_sweep_file_errors_are_one_line(tmp_path, parameters, method, extra, needle):
    path = _write(tmp_path, parameters, method=method, **extra)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        sweep.run(path, directory=str(tmp_path / "sw"), dry_run=True, out=io.StringIO())


def test_random_sweep_draws_reproducibly_within_bounds(tmp_path):
    path = _write(tmp_path, {
        "model.init_args.lr": {"distribution": "log_uniform_values", "min": 0.01, "max": 1.0},
        "trainer.rounds": {"distribution": "int_uniform", "min": 1, "max": 3},
        "model.init_args.momentum": {"distribution": "q_uniform", "min": 0.0, "max": 0.9, "q": 0.1},
        "trainer.seed": {"values": [0, 1, 2], "probabilities": [0.2, 0.3, 0.5]},
        "model.init_args.weight_decay": {"distribution": "normal", "mu": 0.0, "sigma": 1e-4},
    }, method="random", run_cap=6)
    spec = sweep.load_sweep(path)
    a, b = sweep.configurations(spec, seed=3), sweep.configurations(spec, seed=3)
    assert a == b and len(a) == 6
    assert sweep.configurations(spec, seed=4) != a
    for c in a:
        assert 0.01 <= c["model.init_args.lr"] <= 1.0
        assert isinstance(c["trainer.rounds"], int) and 1 <= c["trainer.rounds"] <= 3
        assert abs(c["model.init_args.momentum"] * 10 - round(c["model.init_args.momentum"] * 10)) < 1e-9
        assert c["trainer.seed"] in (0, 1, 2)
    assert len(sweep.configurations(spec, count=2, seed=3)) == 2
    # every draw is a valid `dpfl fit` command line
    parser = cli.build_parser()
    for c in a:
        cmd = sweep.build_command(spec, c)
        cfg = parser.parse_args(cmd[cmd.index("fit"):])
        assert cfg.fit.model.init_args.lr == pytest.approx(c["model.init_args.lr"])


def test_command_macros_and_mpi(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_TEST_VALUE", "here")
    path = _write(tmp_path, {"trainer.seed": {"values": [1]}, "trainer.enable_summary": {"values": [True]}},
                  command=["${env}", "${interpreter}", "${program}", "x=${envvar:DPFL_TEST_VALUE}", "${args}",
                           "${args_no_hyphens}", "${args_no_boolean_flags}", "${args_json}"])
    spec = sweep.load_sweep(path)
    (params,) = sweep.configurations(spec)
    cmd = sweep.build_command(spec, params, log_dir="L", name="N")
    assert cmd[1] == sys.executable and cmd[2] == "dpfl_lightning/__main__.py"
    assert cmd[3] == "x=here"
    assert cmd[4:] == ["--trainer.seed=1", "--trainer.enable_summary=True", "trainer.seed=1",
                       "trainer.enable_summary=True", "--trainer.seed=1", "--trainer.enable_summary",
                       json.dumps(params), "--trainer.log_dir=L", "--trainer.run_name=N"]
    mpi = sweep.build_command(spec, params, mpi=2)
    assert os.path.basename(mpi[0]) in ("mpiexec", "mpirun") and mpi[1:3] == ["-n", "2"]
    assert mpi[5:7] == ["-m", "mpi4py"]  # ${interpreter}: python -m mpi4py, so a failing rank ends them all


def test_run_names(tmp_path):
    assert sweep.run_name({"trainer": {"local_steps": 2, "rounds": 40}, "trainer.seed": 1}) == \
        "local_steps=2_rounds=40_seed=1"
    assert sweep.run_name({"trainer.algorithm": {"class_path": "dpfl_lightning.algorithms.DPNormFedAvg",
                                                 "init_args": {"scale": 50.0}}, "trainer.seed": 0}) == \
        "algorithm=DPNormFedAvg_scale=50_seed=0"
    assert sweep.run_name({"trainer.seed": 1, "data.init_args.seed": 2}) == "trainer.seed=1_data.seed=2"
    long = sweep.run_name({f"model.init_args.p{i}": 0.123456789 for i in range(20)})
    assert len(long) <= sweep.MAX_NAME and re.fullmatch(r"[A-Za-z0-9._=+-]+", long)


@pytest.mark.parametrize("name", ["paper000_local_steps.yaml", "paper003_clip_vs_norm.yaml"])
def test_example_sweeps_are_valid_fit_command_lines(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # the files are written to be run from the repository root
    spec = sweep.load_sweep(os.path.join("configs", "sweeps", name))
    configs = sweep.configurations(spec)
    assert len(configs) == {"paper000_local_steps.yaml": 15, "paper003_clip_vs_norm.yaml": 12}[name]
    parser = cli.build_parser()
    for params in configs:
        cmd = sweep.build_command(spec, params, log_dir="runs", name=sweep.run_name(params))
        cfg = parser.parse_args(cmd[cmd.index("fit"):])  # parses and type-checks every override
        trainer = cfg.fit.trainer
        if name.startswith("paper000"):
            assert trainer.local_steps * trainer.rounds == 80
            assert trainer.algorithm.class_path.endswith("DPFedAvgLocal")
        else:
            assert trainer.algorithm.init_args.noise_multiplier == 9.81
            assert trainer.algorithm.init_args.placement == "distributed"  # carried over from the base


def test_configurations_differing_only_in_unsafe_characters_all_run(tmp_path):
    # "a/b" and "a-b" make the same directory-safe name: both must be kept, under distinct names
    path = _write(tmp_path, {"trainer.run_tag": {"values": ["a/b", "a-b", "a/b"]}, "trainer.seed": {"values": [0, 1]}})
    spec = sweep.load_sweep(path)
    configs = sweep.configurations(spec)
    assert len(configs) == 4  # the repeated "a/b" appears once
    names = sweep.run_names(configs, sweep.constant_parameters(spec))
    assert len(set(names)) == 4
    out = io.StringIO()
    results = sweep.run(path, directory=str(tmp_path / "sw"), dry_run=True, out=out)
    assert len(results) == 4 and len({r.name for r in results}) == 4


def test_a_missing_launcher_fails_its_run_and_the_sweep_goes_on(tmp_path):
    path = _write(tmp_path, {"trainer.seed": {"values": [0]}}, command=["/nonexistent/launcher", "${args}"])
    (r,) = sweep.run(path, directory=str(tmp_path / "sw"), out=io.StringIO())
    assert r.status == "failed" and "could not start" in r.message
    with pytest.raises(ConfigError, match="--count"):
        sweep.run(path, directory=str(tmp_path / "sw2"), count=0, out=io.StringIO())


def test_a_dp_run_leaves_no_duration_in_the_sweep_records(tmp_path):
    """How long a DP run's rounds took depends on its cohorts' data: done/*.json and the table of runs
    give no duration or end time for it."""
    dp = {"class_path": "dpfl_lightning.algorithms.DPFedAvg", "init_args": {"clip": 1.0, "noise_multiplier": 1.0}}
    path = _write(tmp_path, {"trainer.algorithm": {"values": [dp]}, "trainer.seed": {"values": [3]}})
    out = io.StringIO()
    (r,) = sweep.run(path, directory=str(tmp_path / "sw"), out=out)
    assert r.status == "done" and r.seconds is None, out.getvalue()
    with open(tmp_path / "sw" / "done" / f"{r.name}.json") as f:
        record = json.load(f)
    assert record["returncode"] == 0 and "seconds" not in record and "finished" not in record
    assert re.search(r"done \(\d+ s\)| done in ", out.getvalue()) is None
    assert sweep.is_private_run(str(tmp_path / "sw" / "runs" / r.name))


def _agent_command(spec, args, run_id):
    """The command line wandb's agent builds for one run (wandb_agent.Agent._command_run), from its
    own helpers; the agent writes ``python``, this test the running interpreter."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    command = {"args": {k: {"value": v} for k, v in args.items()}, "program": spec.get("program"), "run_id": run_id}
    chunks = sweep_utils.create_sweep_command(list(spec["command"]))
    macros = sweep_utils.create_sweep_command_args(command)
    macros.update(interpreter=[sys.executable], program=[command["program"]], env=["/usr/bin/env"])
    out = []
    for c in map(str, chunks):
        out += (macros.get(c[2:-1]) or []) if c.startswith("${") and c.endswith("}") else [c]
    return command, out


def test_shipped_sweep_runs_unchanged_under_a_wandb_agent(tmp_path):
    """One run of configs/sweeps/paper000_local_steps.yaml as `wandb agent` starts it (its command
    line, WANDB_SWEEP_ID / WANDB_RUN_ID / WANDB_SWEEP_PARAM_PATH / WANDB_DIR, W&B offline): the run
    joins the agent's W&B run and logs the sweep's metric."""
    from wandb.sdk.lib import config_util

    from test_loggers import finished_wandb_records, wandb_history

    shutil.copytree(os.path.join(ROOT, "configs"), tmp_path / "configs")  # the file's paths are relative
    with open(tmp_path / "configs" / "sweeps" / "paper000_local_steps.yaml") as f:
        spec = yaml.safe_load(f)
    run_id, sweep_id = "agentrun1", "sweep123"
    command, cmd = _agent_command(spec, {"trainer": {"local_steps": 16, "rounds": 5}, "trainer.seed": 1}, run_id)
    assert "--trainer={'local_steps': 16, 'rounds': 5}" in cmd and "--trainer.seed=1" in cmd
    param_path = str(tmp_path / "wandb" / f"sweep-{sweep_id}" / f"config-{run_id}.yaml")
    config_util.save_config_file_from_dict(param_path, command["args"])
    own = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # (an earlier test's W&B service)
    env = {**own, "WANDB_MODE": "offline", "WANDB_SWEEP_ID": sweep_id, "WANDB_RUN_ID": run_id,
           "WANDB_SWEEP_PARAM_PATH": param_path, "WANDB_DIR": str(tmp_path), "WANDB_PROJECT": spec["project"],
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "runs" / "*" / "version_0" / "wandb" / f"offline-run-*-{run_id}" / "*.wandb"))
    rows, config, ids = wandb_history(path)
    assert ids == [run_id]
    runs = [r.run for r in finished_wandb_records(path) if r.WhichOneof("record_type") == "run"]
    assert runs[0].sweep_id == sweep_id and runs[0].project == spec["project"]
    metric = spec["metric"]["name"]
    with open(glob.glob(str(tmp_path / "runs" / "*" / "version_0" / "metrics.csv"))[0]) as f:
        csv_value = [float(r[metric]) for r in csv.DictReader(f) if r.get(metric)][-1]
    assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1][metric] == pytest.approx(csv_value)
    assert config["trainer.seed"] == 1 and config["trainer.rounds"] == 5 and config["trainer.local_steps"] == 16


def test_command_macros_match_the_wandb_agent(tmp_path):
    """Every argument macro dpfl sweep fills in is what wandb's agent fills in for the same values
    (its own helper), so one sweep file gives the same command lines in both."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    params = {"trainer.seed": 2, "model.init_args.lr": 0.05, "trainer.secure": False, "trainer.enable_summary": True,
              "trainer": {"local_steps": 2, "rounds": 40},
              "trainer.algorithm": {"class_path": "dpfl_lightning.algorithms.DPFedAvg", "init_args": {"clip": 1.0}}}
    macros = ["args", "args_no_hyphens", "args_no_equals", "args_no_boolean_flags", "args_json",
              "args_append_hydra", "args_override_hydra"]
    theirs = sweep_utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})
    path = _write(tmp_path, {k: {"values": [v]} for k, v in params.items()})
    spec = sweep.load_sweep(path)
    (drawn,) = sweep.configurations(spec)
    for macro in macros:
        spec.command = ["${" + macro + "}"]
        assert sweep.build_command(spec, drawn) == theirs[macro], macro


def test_the_table_of_runs_fits_80_columns_and_loses_nothing(monkeypatch):
    """A long run name, a class with arguments, two seeds and a failure's message: in a file (a
    batch job's log) the table is 80 columns wide, and every cell's text is still all there."""
    monkeypatch.delenv("COLUMNS", raising=False)
    name = "lr=0.1_clip=1.0_noise_multiplier=2.0_seed=0_algorithm=DPFedAvg_" + "x" * 40
    message = "ConfigError: GaussianNoise.target_epsilon=1e-06: is unreachable: even noise multiplier 1e+05 gives more"
    params = {"model.init_args.lr": 0.1, "trainer.seed": 0, "data.init_args.seed": 3,
              "trainer.algorithm": {"class_path": "dpfl_lightning.algorithms.DPFedAvg",
                                    "init_args": {"clip": 1.0, "noise_multiplier": 2.0}}}
    results = [sweep.RunResult(name, params, "failed", returncode=1, message=message, metric=0.71),
               sweep.RunResult("seed=1_lr=0.5", {"model.init_args.lr": 0.5, "trainer.seed": 1}, "done",
                               seconds=12.0, metric=0.5)]
    out = io.StringIO()
    sweep.print_runs(results, "test_acc", out=out)
    lines = out.getvalue().splitlines()
    assert max(len(ln) for ln in lines) <= 80, out.getvalue()
    cells = [[c.strip() for c in ln.split("│")[1:-1]] for ln in lines if ln.startswith("│")]
    first = cells[:next(i for i, c in enumerate(cells) if c[0] == "seed=1_lr=0.5")]
    assert "".join(c[0] for c in first) == name  # folded, not cut
    status = "".join(c[2] for c in first).replace(" ", "")  # wrapped between words, folded inside one
    assert status == f"failed (exit 1): {message}".replace(" ", "")
    shown = [c[1] for c in first if c[1]]  # one parameter a line, under its shortest distinct name
    assert shown == ["lr=0.1", "trainer.seed=0", "data.seed=3", "algorithm=DPFedAvg", "clip=1.0",
                     "noise_multiplier=2.0"]
    assert first[0][3] == "0.71"
