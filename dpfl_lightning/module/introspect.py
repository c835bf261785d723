"""What an object is to Lightning, read from its class: whether it is a LightningModule, and which of
Lightning's hooks it overrides. The ground floor of the package: it imports nothing of
``dpfl_lightning``, so the data modules, the module package and the run all read it."""

from __future__ import annotations

from typing import Any

from torch import nn

#: the per-batch hooks of automatic optimization (Lightning's defaults are called directly, or not at all)
STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "optimizer_step", "on_before_zero_grad",
              "optimizer_zero_grad", "on_before_backward", "backward", "on_after_backward", "on_before_optimizer_step",
              "configure_gradient_clipping", "lr_scheduler_step")
#: the batch-transfer hooks (a LightningDataModule's own versions take precedence, as in Lightning)
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def is_lightning_module(obj: Any) -> bool:
    """True for ``lightning.LightningModule`` and ``pytorch_lightning.LightningModule`` alike."""
    return isinstance(obj, nn.Module) and any(c.__name__ == "LightningModule" for c in type(obj).__mro__)


def lightning_base(obj: Any, base: str = "LightningModule") -> type | None:
    """Lightning's class named ``base`` among the object's bases (``None`` when it has none)."""
    return next((c for c in type(obj).__mro__ if c.__name__ == base), None)


def is_overridden(obj: Any, name: str, base: str = "LightningModule") -> bool:
    """True when the object's class defines ``name`` itself instead of inheriting it from Lightning's
    ``base`` class (an object without that base overrides whatever it has)."""
    cls = lightning_base(obj, base)
    if cls is None:
        return callable(getattr(obj, name, None))
    return getattr(type(obj), name, None) is not getattr(cls, name, None)


def overridden(obj: Any, names: tuple[str, ...], base: str = "LightningModule") -> dict[str, bool]:
    """``{hook: is_overridden(obj, hook)}`` for every name."""
    return {h: is_overridden(obj, h, base) for h in names}
