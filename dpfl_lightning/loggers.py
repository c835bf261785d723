"""Round metrics to disk, to Weights & Biases and to the console -- from rank 0 only.

Lightning's own loggers do the writing: a ``CSVLogger`` always (``<log_dir>/<run_name>/version_N/
metrics.csv``, one row per round, and ``hparams.yaml`` with the resolved configuration), plus any
logger in ``FederatedTrainer(loggers=[...])``, e.g. :class:`WandbLogger`.
"""

from __future__ import annotations

import netrc
import os
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

WANDB_MODES = ("auto", "online", "offline", "disabled")


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])


def resolve_wandb_mode(mode: str) -> str:
    """``auto``: ``WANDB_MODE`` if set, else ``online`` with an API key and ``offline`` without."""
    if mode not in WANDB_MODES:
        raise ValueError(f"WandbLogger.mode={mode!r}: use one of {WANDB_MODES}")
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    return "online" if _has_wandb_key() else "offline"


class WandbLogger(_LightningWandbLogger):
    """Lightning's W&B logger with a ``mode`` that works on machines without network or key.

    Args:
        project / entity / name / group / tags: the W&B run's.
        mode: ``auto`` (offline when there is no API key), ``online``, ``offline`` or ``disabled``.
            Offline runs are written under ``save_dir/wandb`` and can be synced later with
            ``wandb sync``.
        save_dir: where W&B writes its files.
    """

    def __init__(self, project: str = "dpfl", entity: str | None = None, name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, mode: str = "auto", save_dir: str = ".",
                 **kwargs: Any) -> None:
        resolved = resolve_wandb_mode(mode)
        self.mode = resolved
        super().__init__(name=name, project=project, save_dir=save_dir, offline=resolved == "offline",
                         entity=entity, group=group, tags=list(tags or []), mode=resolved, **kwargs)

    def finalize(self, status: str) -> None:
        """End the W&B run too, so the next ``fit`` in this process starts its own run."""
        super().finalize(status)
        if self._experiment is not None:
            self._experiment.finish(exit_code=0 if status == "success" else 1)
            self._experiment = None


class RoundProgress:
    """A rich progress bar over rounds that shows the latest metrics (rank 0, when enabled)."""

    def __init__(self, total: int, start: int, enabled: bool, keys: list[str] | None = None) -> None:
        self.enabled = enabled
        self.keys = keys
        if not enabled:
            return
        self._progress = Progress(TextColumn("round"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
                                  console=Console(stderr=True), transient=False)
        self._task = self._progress.add_task("rounds", total=total, completed=start, metrics="")
        self._progress.start()

    def update(self, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        keys = self.keys or [k for k in metrics if k not in ("round", "time_s")]
        shown = "  ".join(f"{k}={_fmt(metrics[k])}" for k in keys if k in metrics)
        self._progress.update(self._task, advance=1, metrics=shown)

    def close(self) -> None:
        if self.enabled:
            self._progress.stop()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def summary_table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in rows.items():
        table.add_row(k, _fmt(v))
    return table


def print_summary(title: str, rows: dict[str, Any]) -> None:
    Console(stderr=True).print(summary_table(title, rows))


def make_csv_logger(log_dir: str, run_name: str) -> CSVLogger:
    return CSVLogger(save_dir=log_dir, name=run_name, flush_logs_every_n_steps=1)
