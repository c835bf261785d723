"""The final global model as a Lightning checkpoint: ``MyModule.load_from_checkpoint(path)`` loads it.

The file is what ``lightning.Trainer.save_checkpoint(path, weights_only=True)`` writes: the
module's ``state_dict`` (at the global parameters), its saved hyperparameters
(``save_hyperparameters()``), the round as ``epoch``, a step count, Lightning's version, and whatever
the module's ``on_save_checkpoint`` adds. It holds no optimizer state (clients have none that
lasts a round), so ``lightning.Trainer.fit(ckpt_path=...)`` refuses it as weights-only;
``load_from_checkpoint`` and ``Trainer.test(model, ckpt_path=...)`` take it. The global model is
what every participant sees, so exporting it releases nothing beyond the run's guarantee.

The run's own checkpoints (``round-*.ckpt``, ``last.ckpt``) carry the same fields next to the run's
state, so ``load_from_checkpoint`` reads them too. Those of a DP run also hold the privacy ledger's
records (Python objects that torch's weights-only loading refuses): load them with
``weights_only=False`` when you trust the file, or load ``final.ckpt``.
"""

from __future__ import annotations

from typing import Any

import lightning
import torch

from dpfl_lightning.run.checkpoint_format import save_atomic


def lightning_checkpoint(model: torch.nn.Module, epoch: int, global_step: int, datamodule: Any = None) -> dict[str, Any]:
    """The checkpoint dictionary of ``model`` as it is now (call with the global parameters loaded)."""
    ckpt: dict[str, Any] = {
        "epoch": int(epoch),
        "global_step": int(global_step),
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }
    for obj in (model, datamodule):
        hparams = getattr(obj, "hparams", None) if obj is not None else None
        if hparams:
            if hasattr(obj, "_hparams_name"):
                ckpt[obj.CHECKPOINT_HYPER_PARAMS_NAME] = obj._hparams_name
            ckpt[obj.CHECKPOINT_HYPER_PARAMS_KEY] = dict(hparams)
    hook = getattr(model, "on_save_checkpoint", None)
    if callable(hook):
        hook(ckpt)
    return ckpt


def save_lightning_checkpoint(model: torch.nn.Module, path: str, epoch: int, global_step: int,
                              datamodule: Any = None) -> str:
    """Write :func:`lightning_checkpoint` atomically to ``path``; returns ``path``."""
    save_atomic(lightning_checkpoint(model, epoch, global_step, datamodule), path)
    return path
