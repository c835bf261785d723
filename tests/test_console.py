"""What a fit prints on an 80-column terminal: each epsilon with its delta and audience (progress line
and summary), a signal's notice and the resume command wrapped to the width and printed after the
progress bar has stopped (never a bar drawn again below them), W&B's upload command with its paths
whole on lines of their own.

A terminal is simulated with rich's own switches (``TTY_COMPATIBLE=1``, ``COLUMNS=80``): the run's
consoles then draw the live bar into the captured stderr, cursor movements included; the tests read
the screen's lines with the escape sequences removed."""

import os
import re
import signal

import pytest

from dpfl_lightning.tracking.loggers import metrics_line, sync_hint
from dpfl_lightning.plugins import GaussianNoise, PrivacyLedger, UpdateClipping
from dpfl_lightning.plugins.callback import FederatedCallback
from dpfl_lightning.run.preemption import Preempted
from helpers import TinyClassifier, quiet_trainer, tiny_data

WIDTH = 80
NOTE = "(delta=1e-4, towards anyone who sees the models)"
BAR = re.compile(r"^round\s+\d+/\d+\b.*(━|eta)")  # a frame of the live bar (not a plain progress line)


class SignalAt(FederatedCallback):
    """Sends this process ``signum`` at the end of round ``at`` (before the bar shows that round)."""

    def __init__(self, signum: int, at: int) -> None:
        self.signum, self.at = signum, at

    def on_round_end(self, *, server, metrics) -> None:
        if server.round_idx + 1 == self.at:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def terminal(monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.setenv("NO_COLOR", "1")


def _screen(text: str) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "\n")
    return [ln.rstrip() for ln in text.splitlines() if ln.strip()]


def _fits(lines: list[str]) -> list[str]:
    """The lines wider than the terminal, but for one word alone on its line (a path to copy)."""
    return [ln for ln in lines if len(ln) > WIDTH and len(ln.split()) > 1]


def _trainer(log_dir, *extra, rounds=3, **kw):
    plugins = [UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0), PrivacyLedger(delta=1e-4), *extra]
    return quiet_trainer(log_dir, rounds=rounds, clients_per_round=4, plugins=plugins, run_name="run",
                         enable_progress_bar=True, **kw)


def _summary_cells(lines: list[str]) -> dict[str, str]:
    """``metric -> value`` of the summary table, a value wrapped over several lines joined again."""
    rows: dict[str, str] = {}
    last = None
    for ln in lines:
        cells = [c.strip() for c in ln.split("│")[1:-1]]
        if len(cells) != 2:
            continue
        if cells[0]:
            last = cells[0]
            rows[last] = cells[1]
        elif last is not None:
            rows[last] += " " + cells[1]
    return rows


def test_the_progress_and_the_summary_show_epsilon_with_its_delta_and_audience(tmp_path, capfd, terminal):
    trainer = _trainer(str(tmp_path), enable_summary=True)
    trainer.fit(TinyClassifier(), tiny_data())
    lines = _screen(capfd.readouterr().err)
    assert not _fits(lines), _fits(lines)
    eps = f"{trainer.history[-1]['epsilon']:.4g}"
    assert any(ln.startswith(f"epsilon={eps} {NOTE}") or f"  epsilon={eps} {NOTE}" in ln for ln in lines), lines
    table = _summary_cells(lines)
    assert table["epsilon"] == f"{eps} {NOTE}"


def test_plain_progress_lines_show_epsilon_with_its_delta_and_audience(tmp_path, capfd):
    trainer = _trainer(str(tmp_path))
    trainer.fit(TinyClassifier(), tiny_data())
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("round 3/3  ") and f"epsilon={trainer.history[-1]['epsilon']:.4g} {NOTE}  " in last


def test_a_tiny_epsilon_keeps_its_significant_digits():
    line = metrics_line({"epsilon": 1e-6, "epsilon_client_local": 2.5e-7}, notes={"epsilon": NOTE})
    assert line == f"epsilon=1e-06 {NOTE}  epsilon_client_local=2.5e-07"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_the_stop_notices_wrap_and_come_after_the_stopped_bar(tmp_path, capfd, terminal, sig):
    trainer = _trainer(str(tmp_path), SignalAt(sig, at=2), rounds=5)
    with pytest.raises(Preempted):
        trainer.fit(TinyClassifier(), tiny_data())
    lines = _screen(capfd.readouterr().err)
    assert not _fits(lines), _fits(lines)
    stop = next(i for i, ln in enumerate(lines) if ln.startswith("preempted:"))
    assert [ln for ln in lines[stop:] if BAR.match(ln)] == []  # the bar is not drawn again below
    assert any(BAR.match(ln) for ln in lines[:stop])  # (it was live when the signal came)
    assert lines[stop + 1].startswith("checkpoint written to") or "checkpoint written to" in lines[stop]
    assert any(ln.startswith("resume with:") for ln in lines[stop:])
    if sig == signal.SIGINT:  # the Ctrl-C notice: above the live bar, wrapped between words
        first = next(i for i, ln in enumerate(lines) if ln.startswith("interrupt: the run stops"))
        assert first < stop
        said = " ".join(ln.strip() for ln in lines[first:first + 2])
        assert "interrupt: the run stops after this round, with a checkpoint (Ctrl-C again to stop at once)" in said


def test_the_wandb_upload_command_keeps_every_path_whole_on_a_line_of_its_own():
    dirs = ["/scratch/" + "a_long_directory_name/" * 4 + f"wandb/offline-run-2026112{i}_084909-4l31idht" for i in (1, 2)]
    for shown in (dirs[:1], dirs):
        lines = sync_hint("4l31idht", shown).splitlines()
        assert lines[0] == "wandb: offline run saved; upload it with:"
        for d in shown:
            (line,) = [ln for ln in lines if d in ln]
            assert line.strip().rstrip(" \\").split()[-1] == d  # the path ends its line, unbroken
            assert line.strip().startswith(("wandb sync", d))
        assert all(len(ln) <= WIDTH for ln in lines if not any(d in ln for d in shown))
    # the command still runs as one (the continuation lines end with a backslash)
    assert sync_hint("4l31idht", dirs).replace(" \\\n", " ").splitlines()[1].split() == \
        ["wandb", "sync", "--id", "4l31idht", *dirs]
