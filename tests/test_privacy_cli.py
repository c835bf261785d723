"""``dpfl privacy epsilon | calibrate | plan``."""

import os
import re

import pytest

from dpfl_lightning.cli import command as cli
from dpfl_lightning.privacy import GaussianRelease, epsilon, max_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
FAST = ["--trainer.rounds", "4", "--trainer.enable_progress_bar", "false", "--trainer.num_threads", "1"]


def test_epsilon_of_a_config_equals_what_training_logs(tmp_path, capsys):
    cli.main(["privacy", "epsilon", "--config", QUICKSTART, *FAST])
    out = capsys.readouterr().out
    planned = float(re.search(r"epsilon = ([0-9.]+) after 4 rounds", out).group(1))
    assert "towards anyone who sees the models" in out and "Poisson sampling q=0.2" in out
    cli.main(["fit", "--config", QUICKSTART, *FAST, "--trainer.log_dir", str(tmp_path)])
    import csv
    import glob

    (path,) = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("epsilon")]
    assert float(rows[-1]["epsilon"]) == pytest.approx(planned, abs=1e-4)


def test_calibrate_prints_a_multiplier_that_meets_the_target(capsys):
    cli.main(["privacy", "calibrate", "--epsilon", "2", "--delta", "1e-6", "--rounds", "1000", "--clients", "1000",
              "--sampling_rate", "0.05", "--accountant", "pld"])
    z = float(re.search(r"noise_multiplier = ([0-9.]+)", capsys.readouterr().out).group(1))
    eps = epsilon(GaussianRelease(z, "poisson", 0.05), 1000, 1e-6, "pld").epsilon
    assert 1.98 <= eps <= 2.0 + 1e-3  # z is printed to 6 significant digits


def test_plan_table(capsys):
    cli.main(["privacy", "plan", "--epsilon", "3", "--delta", "1e-5", "--noise", "[2, 5]", "--local_steps", "[1, 10]",
              "--record_rate", "0.1"])
    out = capsys.readouterr().out
    for z in (2, 5):
        steps = max_steps(z, 3.0, 1e-5, 0.1)
        row = re.search(rf"│\s+{z} │\s+(\d+) │\s+(\d+) │", out)
        assert (int(row.group(1)), int(row.group(2))) == (steps, steps // 10)


def test_bad_privacy_input(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["privacy", "calibrate", "--epsilon", "-1", "--delta", "1e-6", "--rounds", "10", "--clients", "100",
                  "--sampling_rate", "0.1"])
    assert e.value.code == 2
    assert "target_epsilon" in capsys.readouterr().err


def test_plan_refuses_a_delta_that_publishes_a_record(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["privacy", "plan", "--epsilon", "3", "--delta", "0.5", "--noise", "[10]"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--delta=0.5" in err and "Fix:" in err


def test_plan_selection_says_the_delta_its_table_is_at(capsys):
    """The header named the run's own delta while the table is at --delta: both are named, the
    requested one as the table's."""
    cli.main(["privacy", "plan", "--selection", QUICKSTART, "--delta", "1e-7", "--means", "[1,2]"])
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "at --delta=1e-07" in header and "epsilon at delta=1e-07" in out
    own = re.search(r"the run's own ledger is at delta=([0-9.e-]+)", header)
    assert own and float(own.group(1)) != 1e-7


SIMULATED_SHARES = ("towards the server (simulation: the noise shares and any SecAgg masks are keyed by the logged "
                    "seed, so anyone with the seed rebuilds every share and mask: they are hidden only from someone "
                    "without the seed; the server knows who took part)")
SECURE_SHARES = "towards the server (secure aggregation hides the shares; the server knows who took part)"


@pytest.mark.parametrize("config", ["ddp_quickstart.yaml", "ddp_skellam_quickstart.yaml"])
def test_ddp_privacy_line_says_what_hides_the_shares_in_each_mode(config, capsys):
    """In a simulation the SecAgg secrets and the noise are keyed by the logged seed: the line towards the
    server says so; in secure mode (CSPRNG, unlogged secret) secure aggregation hides the shares."""
    path = os.path.join(ROOT, "configs", config)
    lines = {}
    for secure in ("false", "true"):
        cli.main(["privacy", "epsilon", "--config", path, "--trainer.secure", secure])
        lines[secure] = next(x for x in capsys.readouterr().out.splitlines() if "towards the server" in x)
    assert SIMULATED_SHARES in lines["false"] and "hides the shares" not in lines["false"]
    assert SECURE_SHARES in lines["true"] and "seed" not in lines["true"]


def test_a_simulated_ddp_fit_prints_the_simulation_line(tmp_path, capfd):
    cli.main(["fit", "--config", os.path.join(ROOT, "configs", "ddp_quickstart.yaml"), "--trainer.rounds", "1",
              "--trainer.enable_progress_bar", "false", "--trainer.num_threads", "1", "--trainer.loggers", "[]",
              "--trainer.test_after_fit", "false", "--trainer.log_dir", str(tmp_path)])
    err = capfd.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("privacy: ") and "towards the server" in x]
    assert SIMULATED_SHARES in line and "hides the shares" not in line
