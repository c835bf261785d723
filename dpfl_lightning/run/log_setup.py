"""What a fit writes for people: its loggers (the CSV log, W&B, ...) with the privacy settings of a DP
run, the console progress (each epsilon with its delta and audience) and the end-of-run summary."""

from __future__ import annotations

import os
from typing import Any

from dpfl_lightning.executor import Executor, executor_choice
from dpfl_lightning.tracking.loggers import (RoundProgress, annotated_rows, epsilon_notes, log_privacy_settings, make_loggers,
                                    print_summary, privacy_settings, summary_rows)
from dpfl_lightning.run.setup import RunSetup
from dpfl_lightning.run.status import RunStatus
from dpfl_lightning.run.settings import TrainerSettings

#: the file of a DP run's version directory that names the release kind of every metric it released
RELEASE_KINDS = "release_kinds.json"


def open_loggers(settings: TrainerSettings, extra: list[Any], run: RunSetup, status: RunStatus,
                 config: dict[str, Any], resume_round: int | None, executor: Executor | None = None) -> list[Any]:
    """Rank 0's loggers (call on rank 0 only), writing the fit's ``status.version``, with the privacy
    settings of a DP run; the hyperparameters carry ``executor_choice`` (what trains the clients, and
    for ``executor="auto"`` why: a public function of the module, plugins and settings)."""
    if executor is not None:
        config = {**config, "executor_choice": executor_choice(executor)}
    loggers = make_loggers(settings.log_dir, settings.run_name, extra, resume_round=resume_round, config=config,
                           version=status.version)
    if run.private:
        log_privacy_settings(loggers, privacy_settings(run.ctx.mechanisms, run.ledger, run.privacy_lines()))
    status.csv_log_dir = loggers[0].log_dir
    if run.private:  # which kind each released metric is (dpfl sweep's admissible selection metrics)
        run.releases.record_to(os.path.join(status.csv_log_dir, RELEASE_KINDS),
                               getattr(run.ctx.data, "test_set_from_clients", False))
    return loggers


def round_progress(settings: TrainerSettings, run: RunSetup, start: int, is_global_zero: bool,
                   signals: Any = None) -> RoundProgress:
    """The console progress of a fit (rank 0, when enabled), each epsilon shown with its delta and
    audience; given the run's :class:`~dpfl_lightning.run.preemption.SignalWatch`, a signal's notice is
    printed above the live bar and the bar is stopped before the run says how to resume."""
    progress = RoundProgress(settings.rounds, start, settings.enable_progress_bar and is_global_zero,
                             notes=epsilon_notes(run.ledger))
    if signals is not None:
        signals.watch(progress)
    return progress


def print_run_summary(settings: TrainerSettings, run: RunSetup, status: RunStatus, num_clients: int,
                      ranks: int, executor: Executor | None = None) -> None:
    """The end-of-run table (each epsilon with its delta and audience; the executor that trained the
    clients, and why) and, in a DP run, what the logs release."""
    extra = {"num_clients": num_clients, "ranks": ranks}
    if executor is not None:
        extra["executor"] = executor_choice(executor)
    rows = summary_rows(status.history, extra=extra)
    if status.stop_reason:
        rows["stopped"] = status.stop_reason
    print_summary(f"{settings.run_name}: done", annotated_rows(rows, epsilon_notes(run.ledger)))
    run.print_release_notes()
