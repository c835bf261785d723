"""Logging and console: W&B offline/disabled, resumed CSV and W&B runs, progress output, the
end-of-run summary and the command-line help."""

import csv
import glob
import io
import json
import os
import re
import struct
import subprocess
import sys
import time

import pytest
import yaml
from rich.console import Console

from dpfl_lightning.cli import command as cli
from dpfl_lightning.tracking.loggers import (
    RoundProgress,
    WandbLogger,
    log_privacy_settings,
    make_loggers,
    metrics_line,
    print_privacy_lines,
    summary_rows,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but \t and \n: escapes, \r, ...


# ---------------------------------------------------------------------------------------- helpers
def wandb_records(path):
    """The records of an offline run file (``run-<id>.wandb``): W&B's LevelDB-style log of
    protobuf ``Record`` messages in 32 KiB blocks, each chunk with a 7-byte header
    (checksum, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    records = []
    for raw in out:
        rec = pb.Record()
        rec.ParseFromString(raw)
        records.append(rec)
    return records


def finished_wandb_records(path, timeout=30.0):
    """The records of a finished run's file, once its ``exit`` record is there: W&B's service writes
    the file asynchronously, and ``finish()`` can return before it has (2 of 40 runs here found only
    the 7-byte header right after ``finish()``, and the whole file 250 ms later)."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:
            records = wandb_records(path)
        except (AssertionError, DecodeError, struct.error):  # read while a record was half-written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"no exit record in {path} after {timeout} s"
        time.sleep(0.05)


def wandb_history(path):
    rows, config, run_ids = [], {}, []
    for rec in finished_wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            rows.append({**row, "_step": rec.history.step.num})
        elif kind == "run":
            run_ids.append(rec.run.run_id)
            config.update({c.key: json.loads(c.value_json) for c in rec.run.config.update})
        elif kind == "config":
            config.update({c.key: json.loads(c.value_json) for c in rec.config.update})
    return rows, config, run_ids


def _log_rounds(loggers, rounds, value):
    for r in rounds:
        for lg in loggers:
            lg.log_metrics({"round": float(r), "val_acc": value(r), "epsilon": 0.5 * r}, step=r)
            lg.save()


def _finish(loggers):
    for lg in loggers:
        lg.finalize("success")


CONFIG = {"trainer": {"rounds": 4, "seed": 3}, "model": {"class_path": "m.M", "init_args": {"lr": 0.1}}}


# ---------------------------------------------------------------------------------------- W&B and CSV
def test_offline_wandb_run_lands_in_the_run_directory_with_the_logged_keys(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    wb = WandbLogger(mode="offline", project="p", tags=["t"])
    loggers = make_loggers(str(tmp_path / "runs"), "demo", [wb], config=CONFIG)
    log_privacy_settings(loggers, {"accountant": "rdp", "delta": 1e-5})
    _log_rounds(loggers, [1, 2, 3], lambda r: 0.1 * r)
    _finish(loggers)
    run_dir = loggers[0].log_dir
    assert run_dir == str(tmp_path / "runs" / "demo" / "version_0")
    with open(os.path.join(run_dir, "wandb_run_id")) as f:
        run_id = f.read().strip()
    (run_file,) = glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))
    rows, config, ids = wandb_history(run_file)
    assert ids == [run_id]
    assert [r["val_acc"] for r in rows] == pytest.approx([0.1, 0.2, 0.3])
    assert [r["trainer/global_step"] for r in rows] == [1, 2, 3]
    assert [r["_step"] for r in rows] == [1, 2, 3]  # W&B's step is the round
    # the configuration under the command-line option names, and the privacy settings
    assert config["trainer.rounds"] == 4 and config["model.init_args.lr"] == 0.1
    assert config["privacy.accountant"] == "rdp"
    assert not glob.glob(str(tmp_path / "wandb"))  # nothing in the working directory
    assert os.environ["WANDB_MODE"] == "disabled"  # the process's setting is left alone (conftest sets it)
    with open(os.path.join(run_dir, "hparams.yaml")) as f:
        assert yaml.safe_load(f)["privacy"]["delta"] == 1e-5
    err = capfd.readouterr().err
    assert "anonymous" not in err  # W&B's deprecation warning, caused by an argument nobody set
    assert "Run history" not in err and "Run summary" not in err  # W&B's sparklines
    assert f"wandb sync {os.path.dirname(run_file)}" in err
    # syncable: wandb's own sync command recognises the directory as a run to upload
    proc = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", os.path.dirname(run_file)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "WANDB_MODE": "offline"},
                          check=False)
    assert f"run-{run_id}.wandb" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_disabled_wandb_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    wb = WandbLogger(mode="auto")
    assert wb.mode == "disabled"
    loggers = make_loggers(str(tmp_path / "runs"), "demo", [wb], config=CONFIG)
    _log_rounds(loggers, [1, 2], lambda r: 0.5)
    _finish(loggers)
    files = sorted(os.path.relpath(p, tmp_path) for p in glob.glob(str(tmp_path / "**"), recursive=True)
                   if os.path.isfile(p))
    assert files == [os.path.join("runs", "demo", "version_0", f) for f in ("hparams.yaml", "metrics.csv")]


def test_resumed_run_appends_to_its_csv_and_continues_its_wandb_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = str(tmp_path / "runs")
    # first start: rounds 1..4 logged, but the last checkpoint was at round 2 (then the job died)
    first = make_loggers(runs, "demo", [WandbLogger(mode="offline")], config=CONFIG)
    _log_rounds(first, [1, 2, 3, 4], lambda r: 0.1 * r)
    _finish(first)
    first_id = first[1].run_id
    time.sleep(1.1)  # W&B names offline directories by the second they start in
    # resumed from round 2: rounds 3..5 again, with other values
    second = make_loggers(runs, "demo", [WandbLogger(mode="offline")], resume_round=2, config=CONFIG)
    _log_rounds(second, [3, 4, 5], lambda r: 1.0 + r)
    _finish(second)
    assert second[0].log_dir == first[0].log_dir  # same version_0, no version_1
    assert second[1].run_id == first_id
    path = os.path.join(first[0].log_dir, "metrics.csv")
    with open(path) as f:
        text = f.read()
    assert text.count("val_acc") == 1  # one header
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [int(float(r["round"])) for r in rows] == [1, 2, 3, 4, 5]
    assert [float(r["val_acc"]) for r in rows] == pytest.approx([0.1, 0.2, 4.0, 5.0, 6.0])
    parts = sorted(glob.glob(os.path.join(first[0].log_dir, "wandb", f"offline-run-*-{first_id}")))
    assert len(parts) == 2  # both starts, one W&B run id: `wandb sync --id <id> <both>` uploads one run
    rows1, _, _ = wandb_history(os.path.join(parts[0], f"run-{first_id}.wandb"))
    rows2, _, ids2 = wandb_history(os.path.join(parts[1], f"run-{first_id}.wandb"))
    assert [r["_step"] for r in rows1] == [1, 2, 3, 4]
    # the resumed start continues W&B's steps (offline, W&B would restart _step at 0) and does not log
    # rounds 3 and 4 a second time: synced, the run has every round once
    assert ids2 == [first_id] and [(r["_step"], r["trainer/global_step"]) for r in rows2] == [(5, 5)]
    assert rows2[0]["val_acc"] == pytest.approx(6.0)


def test_a_new_run_gets_a_new_version_and_wandb_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = str(tmp_path / "runs")
    a = make_loggers(runs, "demo", [WandbLogger(mode="offline")])
    b = make_loggers(runs, "demo", [WandbLogger(mode="offline")])
    assert os.path.basename(a[0].log_dir) == "version_0" and os.path.basename(b[0].log_dir) == "version_1"
    assert a[1].run_id != b[1].run_id
    assert a[1]._wandb_init["name"] == "demo" and a[1]._wandb_init["resume"] == "allow"
    assert "anonymous" not in a[1]._wandb_init and a[1]._wandb_init["settings"].quiet


def _record_kinds(path):
    return {r.WhichOneof("record_type") for r in finished_wandb_records(path)}


def test_a_dp_run_turns_wandb_timing_channels_off(tmp_path, monkeypatch):
    """System statistics (sampled every 0.1 s here) and system metadata reach an ordinary W&B run;
    a DP run's has neither, and no console capture."""
    monkeypatch.chdir(tmp_path)
    kinds = {}
    for private in (False, True):
        wb = WandbLogger(mode="offline", settings={"x_stats_sampling_interval": 0.1})
        loggers = make_loggers(str(tmp_path / "runs"), f"private={private}", [wb], config=CONFIG)
        if private:
            log_privacy_settings(loggers, {"accountant": "rdp", "delta": 1e-5})
        for r in (1, 2, 3):
            time.sleep(0.4)
            _log_rounds(loggers, [r], lambda r: 0.5)
        _finish(loggers)
        (path,) = glob.glob(os.path.join(loggers[0].log_dir, "wandb", "offline-run-*", "*.wandb"))
        kinds[private] = _record_kinds(path)
        assert wb.timing_protected is private
    assert {"stats", "environment"} <= kinds[False]
    assert not {"stats", "environment", "output_raw", "output"} & kinds[True]
    assert "history" in kinds[True]


@pytest.mark.parametrize("width", [80, 200])
def test_privacy_lines_wrap_between_words(width):
    line = ("client-level DP, distributed noise (GaussianNoise), towards the server (secure aggregation hides the "
            "shares; the server knows who took part); no sampling, replace-one neighbours, noise multiplier "
            "4.905; worst client's participations; pld accountant, delta=1e-06") * 2
    buf = io.StringIO()
    print_privacy_lines([line, "short"], Console(file=buf, force_terminal=True, width=width, color_system=None))
    out = buf.getvalue().splitlines()
    assert max(len(ln) for ln in out) <= width and len(out) > 2
    assert out[0].startswith("privacy: ") and out[-1] == "privacy: short"
    assert " ".join(ln.strip() for ln in out[:-1]) == f"privacy: {line}"  # no word split
    piped = io.StringIO()
    print_privacy_lines([line], Console(file=piped, force_terminal=False, width=80))
    assert piped.getvalue() == f"privacy: {line}\n"  # a log file keeps one line per entry


def test_the_privacy_line_says_why_a_noise_multiplier_differs(tmp_path, capfd):
    cli.main(["fit", "--config", os.path.join(ROOT, "configs", "quickstart.yaml"), "--trainer.rounds", "1",
              "--trainer.algorithm.init_args.placement", "distributed", "--trainer.algorithm.init_args.noise_multiplier",
              "1.0", "--data.init_args.num_clients", "40", "--trainer.enable_progress_bar", "false",
              "--trainer.loggers", "[]", "--trainer.log_dir", str(tmp_path)])
    err = capfd.readouterr().err
    assert "towards the server" in err and "noise multiplier 0.5;" in err
    assert "noise multiplier 0.5 towards the server (the mechanisms' own: 1): replace-one neighbours: a replaced " \
           "client moves the sum by up to 2C" in err
    assert "noise multiplier 1 towards anyone" not in err  # the models' guarantee uses the configured one


# ---------------------------------------------------------------------------------------- console
def _metrics(r, total):
    m = {"round": float(r), "clients": 10.0, "epsilon": 0.1 * r, "round_time_s": 0.01}
    if r % 5 == 0 or r == total:
        m.update({"val_acc": 0.5 + r / 100, "val_loss": 1.0 / r, "client_val_acc_mean": 0.4, "client_val_acc_p10": 0.2})
    return m


def test_plain_progress_has_one_line_per_evaluation_and_no_control_characters():
    buf = io.StringIO()
    progress = RoundProgress(40, 0, True, console=Console(file=buf, force_terminal=False, width=80))
    for r in range(1, 41):
        progress.update(_metrics(r, 40))
    progress.close()
    text = buf.getvalue()
    assert not CONTROL.search(text)
    shown = [int(re.match(r"round\s+(\d+)/40", ln).group(1)) for ln in text.splitlines()]
    # the first round, every 4th (40 / 10), the evaluations (every 5th) and the last
    assert shown == sorted({1, *range(4, 41, 4), *range(5, 41, 5)})
    assert "val_acc=0.9" in text.splitlines()[-1]


def test_terminal_progress_fits_80_columns():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80, color_system=None)
    progress = RoundProgress(60, 0, True, console=console)
    for r in range(1, 31):
        progress.update(_metrics(r, 60))
    progress.close()
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()).replace("\r", "\n")
    lines = [ln for ln in screen.splitlines() if ln.strip()]
    assert max(len(ln) for ln in lines) <= 80
    bar = [ln for ln in lines if ln.startswith("round 30/60")]
    assert bar, lines[-3:]
    below = lines[lines.index(bar[-1]) + 1:]
    assert below[0].startswith("val_acc=0.8  epsilon=3  val_loss=0.03333")
    shown = "  ".join(below[:2])  # wrapped between metrics onto a second line, nothing cut
    assert "…" not in shown and "client_val_acc_p10=0.2" in shown
    assert all(re.fullmatch(r"(\S+=\S+)(  \S+=\S+)*", ln) for ln in below[:2])


def test_metrics_line_order():
    line = metrics_line({"round": 3.0, "clients": 4.0, "epsilon": 1.5, "train_loss": 0.3, "val_loss": 0.5,
                         "val_acc": 0.25, "client_val_acc_mean": 0.2})
    assert line == "val_acc=0.25  epsilon=1.5  val_loss=0.5  client_val_acc_mean=0.2  train_loss=0.3"


def test_summary_rows_totals_means_and_last_values():
    history = [{"round": 1.0, "clients": 10.0, "epsilon": 0.5, "round_time_s": 0.2},
               {"round": 2.0, "clients": 8.0, "epsilon": 0.9, "skipped_clients": 2.0, "val_acc": 0.6,
                "round_time_s": 0.4},
               {"round": 3.0, "clients": 12.0, "epsilon": 1.2, "skipped_clients": 1.0, "round_time_s": 0.3,
                "test_acc": 0.7}]
    rows = summary_rows(history, extra={"num_clients": 50, "ranks": 2})
    assert list(rows)[:4] == ["rounds", "num_clients", "ranks", "seconds/round"]
    assert rows["rounds"] == 3 and rows["seconds/round"] == pytest.approx(0.3)
    assert rows["skipped_clients (total)"] == 3.0  # the run's total, not round 3's 1
    assert rows["clients (mean)"] == pytest.approx(10.0)
    assert rows["epsilon"] == 1.2 and rows["test_acc"] == 0.7
    assert rows["val_acc (round 2)"] == 0.6


def test_piped_fit_output_is_plain(tmp_path):
    """``dpfl fit`` into a pipe (a batch job's log): no escape sequences or carriage returns, W&B
    offline without the warning and the sparkline summary."""
    cfg = tmp_path / "wb.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": {"loggers": [{"class_path": "dpfl_lightning.tracking.loggers.WandbLogger",
                                                            "init_args": {"mode": "offline"}}]}}))
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "COLUMNS": "80"}
    env.pop("WANDB_SILENT", None)
    proc = subprocess.run([sys.executable, "-m", "dpfl_lightning", "fit", "--config",
                           os.path.join(ROOT, "configs", "quickstart.yaml"), "--config", str(cfg),
                           "--trainer.rounds", "10", "--trainer.log_dir", str(tmp_path / "runs"),
                           "--data.init_args.num_clients", "40", "--trainer.clients_per_round", "8"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not CONTROL.search(out), repr(CONTROL.search(out))
    rounds = [int(m.group(1)) for m in re.finditer(r"^round\s+(\d+)/10\b", out, re.MULTILINE)]
    assert 5 in rounds and 10 in rounds  # the evaluation rounds (eval_every 5)
    assert "anonymous" not in out and "Run history" not in out


# ---------------------------------------------------------------------------------------- help
def _help(capsys, monkeypatch, *args):
    monkeypatch.setenv("COLUMNS", "100")
    try:  # the stored help returns; a parser's --help exits 0
        cli.main(list(args))
    except SystemExit as stop:
        assert stop.code in (0, None)
    return capsys.readouterr().out


def test_fit_help_is_plain_text_and_describes_every_option(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, "fit", "--help")
    for markup in ("``", ":class:", ":mod:", ":func:", ":meth:", "`~"):
        assert markup not in text, markup
    assert "model (a LightningModule):" in text and "(<class" not in text
    for name in ("MLPClassifier", "QuadraticModel"):
        assert name in text
    # every option has a description of its own, not only its type (the parser holds what --help shows)
    parser = cli.fit_parser()
    undocumented = [a.option_strings[0] for a in parser._actions
                    if a.option_strings and not (a.help or "").strip()]
    assert not undocumented
    assert not re.search(r"^  --trainer\.\S+\s*\n\s+\(type", text, re.MULTILINE)


def test_model_help_by_short_name(capsys, monkeypatch):
    text = _help(capsys, monkeypatch, "fit", "--model.help", "MLPClassifier")
    assert "--model.in_features" in text and "--model.num_classes" in text
    text = _help(capsys, monkeypatch, "fit", "--data.help", "NpzFile")
    assert "--data.num_classes" in text and "``" not in text


def test_a_preempted_run_is_marked_preempting_in_wandb(monkeypatch):
    calls = []

    class Run:  # what the W&B run records of the end of a fit
        def mark_preempting(self):
            calls.append("mark_preempting")

        def finish(self, exit_code=0):
            calls.append(("finish", exit_code))

    for status, expected in (("preempted", ["mark_preempting", ("finish", 1)]), ("success", [("finish", 0)]),
                             ("failed", [("finish", 1)])):
        calls.clear()
        wb = WandbLogger(mode="disabled")
        monkeypatch.setattr(wb, "_experiment", Run())
        wb.finalize(status)
        assert calls == expected, status
