"""The federated wrapper of a LightningModule, split by concern:

- :mod:`~dpfl_lightning.module.facade`: :class:`FederatedLightningModule`, what the user builds;
- :mod:`~dpfl_lightning.module.parameters`: the flat parameter buffers and what they cannot hold;
- :mod:`~dpfl_lightning.module.loop`: one client's local training in Lightning's hook order;
- :mod:`~dpfl_lightning.module.optimizers`: reading ``configure_optimizers``, counting optimizer steps;
- :mod:`~dpfl_lightning.module.replay`: each client's optimizers and schedulers placed across rounds;
- :mod:`~dpfl_lightning.module.trainer_shim`: what ``self.trainer`` shows (a stand-in for ``lightning.Trainer``);
- :mod:`~dpfl_lightning.module.eval_pass`: ``validation_step`` / ``test_step`` inside a run;
- :mod:`~dpfl_lightning.module.batches`: a batch's size and its move to a device;
- :mod:`~dpfl_lightning.module.introspect`: ``is_overridden``, ``is_lightning_module`` (imports nothing of
  ``dpfl_lightning``);
- :mod:`~dpfl_lightning.module.schedule`, :mod:`~dpfl_lightning.module.optimizer_calls` and
  :mod:`~dpfl_lightning.module.logged_metrics`: where a client's optimizers stand in one Lightning run,
  how an optimizer is called, what ``self.log`` recorded.

May import: ``federated``, ``models`` and the foundation (``errors``); never data, plugins, executors,
the run or the trainer.
"""

from dpfl_lightning.module.batches import Batch, batch_size_of
from dpfl_lightning.module.facade import FederatedLightningModule
from dpfl_lightning.module.introspect import is_lightning_module, is_overridden
from dpfl_lightning.module.loop import ClientRun, LoopSettings, StepHook, step_loss
from dpfl_lightning.module.optimizers import optimizer_steps_per_round, parse_optimizers

__all__ = [
    "Batch",
    "ClientRun",
    "FederatedLightningModule",
    "LoopSettings",
    "StepHook",
    "batch_size_of",
    "is_lightning_module",
    "is_overridden",
    "optimizer_steps_per_round",
    "parse_optimizers",
    "step_loss",
]
