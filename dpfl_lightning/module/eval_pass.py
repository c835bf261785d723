"""Evaluation inside a run: ``validation_step`` / ``test_step`` over a dataset at the current
parameters, with Lightning's evaluation hooks around it and each submodule's train/eval mode
restored afterwards (as Lightning's ``_ModuleMode`` does)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from dpfl_lightning.module.batches import Batch, batch_size_of
from dpfl_lightning.module.introspect import is_overridden


class Evaluation:
    """Evaluates the wrapped module of ``fm`` (a :class:`~dpfl_lightning.module.FederatedLightningModule`)."""

    def __init__(self, fm: Any) -> None:
        self.fm = fm
        self.all_modules: list[nn.Module] | None = None  # the module tree (reset when it is laid out)

    def modes(self) -> list[bool]:
        """Every submodule's train/eval mode (what Lightning's evaluation loop captures)."""
        if self.all_modules is None:
            self.all_modules = list(self.fm.inner.modules())
        return [mod.training for mod in self.all_modules]

    def restore_modes(self, modes: list[bool]) -> None:
        for mod, mode in zip(self.all_modules, modes):
            mod.training = mode

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], stage: str = "validation") -> dict[str, tuple[float, float, str]]:
        """Run ``validation_step`` (or ``test_step``) over ``batches`` at the current parameters, with
        Lightning's evaluation hooks around it; returns what ``self.log`` recorded, as sums for merging."""
        fm = self.fm
        m, shim, logged, loop = fm.inner, fm.trainer_shim, fm.logged, fm.client_loop
        step = m.validation_step if stage == "validation" else m.test_step
        flag = "validating" if stage == "validation" else "testing"
        modes = self.modes()
        fm.schedules.outside_client(shim.current_epoch + 1)
        setattr(shim, flag, True)
        context = loop.forward_context
        try:
            if stage == "validation":  # as lightning.Trainer releases the gradients before validating in fit
                m.on_validation_model_zero_grad()
            if is_overridden(m, f"on_{stage}_model_eval"):
                getattr(m, f"on_{stage}_model_eval")()
            else:
                m.eval()
            logged.reset()
            getattr(m, f"on_{stage}_start")()
            getattr(m, f"on_{stage}_epoch_start")()
            for batch_idx, batch in enumerate(batches):
                batch = loop.transfer(batch)
                logged.current_batch_size = batch_size_of(batch)
                getattr(m, f"on_{stage}_batch_start")(batch, batch_idx)
                with context():
                    out = step(batch, batch_idx)
                getattr(m, f"on_{stage}_batch_end")(out, batch, batch_idx)
            getattr(m, f"on_{stage}_epoch_end")()
            getattr(m, f"on_{stage}_end")()
        finally:
            setattr(shim, flag, False)
            if is_overridden(m, f"on_{stage}_model_train"):
                getattr(m, f"on_{stage}_model_train")()
            else:
                self.restore_modes(modes)  # each submodule's own mode, as Lightning's _ModuleMode does
        return logged.results()
