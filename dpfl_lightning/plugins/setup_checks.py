"""Set-up refusals that several plugins share (control variates, adaptive server steps)."""

from __future__ import annotations

from typing import Any

import torch

from dpfl_lightning.errors import ConfigError, require


def check_uniform_weighting(owner: str, why: str, ctx: Any) -> None:
    """Refuse ``trainer.weighting="samples"`` at set-up."""
    if ctx.weighting != "uniform":
        raise ConfigError("trainer.weighting", "samples", f"{owner}: {why} (every client weighted equally)",
                          "use weighting='uniform'")


def check_raw_model_difference(owner: str, update_rule: str, ctx: Any) -> None:
    """Refuse ``trainer.normalize_update_by_lr``: the control variates' update divides the raw model
    difference by the local step sizes itself."""
    require(not ctx.normalize_update_by_lr, "trainer.normalize_update_by_lr", True,
            f"{owner}'s {update_rule} needs the raw model difference", "leave it False")


def check_plain_sgd(owner: str, optimizer: torch.optim.Optimizer) -> None:
    inner = getattr(optimizer, "original_optimizer", optimizer)
    ok = type(inner) is torch.optim.SGD and all(g.get("momentum", 0) == 0 and g.get("weight_decay", 0) == 0
                                                  for g in inner.param_groups)
    if not ok:
        raise ConfigError(owner, type(inner).__name__, "the control-variate update assumes plain SGD local steps "
                          "(no momentum, no weight decay)", "return torch.optim.SGD(params, lr=...) from "
                          "configure_optimizers")
    lrs = sorted({float(g["lr"]) for g in inner.param_groups})
    if len(lrs) > 1:
        raise ConfigError(owner, f"param group lrs {lrs}", "the control-variate update divides the whole update by "
                          "one step size", "give every parameter group the same learning rate")


def check_pairings(plugins: list, ctx: Any) -> None:
    """Let every plugin with a ``check_pairings(plugins=..., ctx=...)`` method refuse the plugins it
    cannot run beside (after every plugin's ``setup``, before calibration and the ledger)."""
    for p in plugins:
        check = getattr(p, "check_pairings", None)
        if callable(check):
            check(plugins=plugins, ctx=ctx)
