"""Reading what ``configure_optimizers`` returned, counting a client's optimizer steps, and stepping
a scheduler as ``lightning.Trainer`` does."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.module.schedule import step_scheduler

_SCHEDULER_KEYS = {"scheduler", "name", "interval", "frequency", "reduce_on_plateau", "monitor", "strict"}


def parse_optimizers(conf: Any) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
    """Read what ``configure_optimizers`` returned (every form Lightning accepts) into optimizers and
    Lightning ``LRSchedulerConfig`` objects."""
    if conf is None:
        raise ConfigError("model.configure_optimizers", None, "returned no optimizer", "return a torch.optim.Optimizer")
    if isinstance(conf, torch.optim.Optimizer):
        return [conf], []
    if isinstance(conf, dict):
        conf = [conf]
    if isinstance(conf, (list, tuple)) and len(conf) == 2 and isinstance(conf[0], (list, tuple)):
        opts = list(conf[0])
        scheds = list(conf[1]) if isinstance(conf[1], (list, tuple)) else [conf[1]]
        return opts, [_as_scheduler(s) for s in scheds]
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[LRSchedulerConfig] = []
    for item in conf:
        if isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
        elif isinstance(item, dict) and "optimizer" in item:
            optimizers.append(item["optimizer"])
            if item.get("lr_scheduler") is not None:
                schedulers.append(_as_scheduler(item["lr_scheduler"], item.get("monitor")))
        else:
            raise ConfigError("model.configure_optimizers", type(item).__name__, "returned an unsupported value",
                              "return an Optimizer, a list of them, (optimizers, schedulers) or a dict")
    return optimizers, schedulers


def _as_scheduler(item: Any, monitor: str | None = None) -> LRSchedulerConfig:
    if isinstance(item, dict):
        if "scheduler" not in item:
            raise ConfigError("model.configure_optimizers", sorted(item), "an lr_scheduler dict has no 'scheduler'",
                              'return {"scheduler": sched, "interval": "epoch"}')
        extra = set(item) - _SCHEDULER_KEYS
        if extra:
            warnings.warn(f"configure_optimizers: unsupported keys in the lr scheduler dict: {sorted(extra)}",
                          RuntimeWarning, stacklevel=3)
        sched = item["scheduler"]
        cfg = LRSchedulerConfig(sched, item.get("name"), item.get("interval", "epoch"), int(item.get("frequency", 1)),
                                bool(item.get("reduce_on_plateau", isinstance(sched, ReduceLROnPlateau))),
                                item.get("monitor", monitor), bool(item.get("strict", True)))
    else:
        cfg = LRSchedulerConfig(item, reduce_on_plateau=isinstance(item, ReduceLROnPlateau), monitor=monitor)
    _check_scheduler(cfg)
    return cfg


def _check_scheduler(cfg: LRSchedulerConfig) -> None:
    name = type(cfg.scheduler).__name__
    if cfg.interval not in ("epoch", "step"):
        raise ConfigError("model.configure_optimizers", cfg.interval, f"the interval of {name} is neither 'epoch' nor "
                          "'step'", "set interval to 'epoch' (once per round) or 'step' (every local optimizer step)")
    if cfg.frequency < 1:
        raise ConfigError("model.configure_optimizers", cfg.frequency, f"the frequency of {name} must be >= 1",
                          "set frequency >= 1")
    if cfg.reduce_on_plateau and cfg.monitor is None:
        raise ConfigError("model.configure_optimizers", name, "a ReduceLROnPlateau scheduler needs the metric it "
                          "monitors (the server steps it once per round on that released metric)",
                          'return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}')
    if cfg.reduce_on_plateau and cfg.interval != "epoch":
        raise ConfigError("model.configure_optimizers", "interval='step'", f"{name} steps once per round, on a metric "
                          "the round releases, not inside a client", "set interval='epoch'")


def optimizer_steps_per_round(batches: int, batches_per_epoch: int, accumulate: int) -> int:
    """Optimizer steps of ``batches`` local batches taken in passes of ``batches_per_epoch``, when every
    ``accumulate``-th batch of a pass, and the last one, step (Lightning's accumulation rule)."""
    if accumulate <= 1:
        return batches
    per_epoch = max(batches_per_epoch, 1)
    full, rest = divmod(batches, per_epoch)
    return full * math.ceil(per_epoch / accumulate) + math.ceil(rest / accumulate)


def step_scheduler_as_lightning(m: nn.Module, cfg: LRSchedulerConfig, metric: Any, custom: bool) -> None:
    """One scheduler step as lightning.Trainer takes it: through the module's ``lr_scheduler_step``
    when it overrides it (``custom``: automatic optimization), else the scheduler's own ``step``."""
    if custom:
        m.lr_scheduler_step(cfg.scheduler, metric)
    else:
        step_scheduler(cfg, metric)
