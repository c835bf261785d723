"""Lightning callbacks in a federated run: they run at the round level.

``FederatedTrainer(callbacks=[...])`` takes ``lightning.pytorch.callbacks.Callback`` objects (and the
module's ``configure_callbacks()``). Each round is one epoch for them: ``on_train_epoch_start``
before the cohort trains, the validation hooks once the round's evaluation is done and its metrics
are released, ``on_train_epoch_end`` after that; ``setup`` / ``on_fit_start`` / ``on_train_start`` /
``on_train_end`` / ``on_fit_end`` / ``teardown`` once per ``fit``. The ``trainer`` they receive is a
:class:`RoundTrainer`: ``callback_metrics`` is the round's *released* row (what the run logs; in a
DP run nothing un-noised about client data), ``current_epoch`` the round, ``should_stop = True``
stops the run after the round, ``save_checkpoint`` writes a Lightning checkpoint of the global
model. What a callback logs goes into the round's row (and through the release filter).

Supported: ``ModelCheckpoint`` (monitoring a round metric; not ``every_n_train_steps`` or
``train_time_interval``), ``EarlyStopping``, ``LearningRateMonitor`` (not ``logging_interval="step"``),
``LambdaCallback`` and user callbacks that use round-level hooks only. Per-batch hooks would run
inside clients on their raw data: a callback that overrides one is refused at set-up with the
reason, as are Lightning's callbacks that need a ``lightning.Trainer``'s own loop.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, LambdaCallback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import Logger

from dpfl_lightning.errors import ConfigError


#: hooks that Lightning calls per batch (inside a client, on its raw data, in a federated run)
PER_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
                   "on_before_optimizer_step", "on_before_zero_grad", "on_validation_batch_start",
                   "on_validation_batch_end", "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start",
                   "on_predict_batch_end", "on_sanity_check_start", "on_sanity_check_end")

_SUPPORTED = (ModelCheckpoint, EarlyStopping, LearningRateMonitor, LambdaCallback)

# Lightning's own callbacks that need a lightning.Trainer's loop, and what to use instead
_HINTS = {
    "ProgressBar": "the federated trainer draws its own progress bar (enable_progress_bar)",
    "GradientAccumulationScheduler": "use FederatedTrainer(accumulate_grad_batches=...)",
    "StochasticWeightAveraging": "it averages one optimizer's trajectory across epochs; clients start fresh "
                                 "optimizers every round (average rounds with a ServerOptimizer or after training)",
    "WeightAveraging": "it averages one optimizer's trajectory across steps; clients start fresh optimizers every "
                       "round (average rounds with a ServerOptimizer or after training)",
    "BaseFinetuning": "it adds param groups to the Trainer's optimizer during training; clients build fresh optimizers "
                      "every round: unfreeze layers by self.current_epoch (the round) in on_train_epoch_start, with "
                      "an optimizer over all parameters (a frozen one has no gradient to step)",
    "Timer": "the run logs round_time_s; bound the run with rounds",
    "ModelSummary": "the federated trainer prints its own summary (enable_summary)",
    "BatchSizeFinder": "set the clients' batch size with FederatedTrainer(batch_size=...)",
    "LearningRateFinder": "tune the client learning rate outside the federated run",
    "ModelPruning": "it prunes during lightning.Trainer's epochs; prune the global model after training",
    "DeviceStatsMonitor": "it logs per training step",
    "ThroughputMonitor": "it logs per training step",
    "SpikeDetection": "it watches the training loss per step, inside clients",
    "OnExceptionCheckpoint": "use checkpoint_every (run checkpoints) or ModelCheckpoint",
    "BasePredictionWriter": "prediction runs with lightning.Trainer.predict on the exported model",
}


def _hook_overridden(cb: Callback, hook: str) -> bool:
    if hook in vars(cb):  # LambdaCallback sets the hooks it was given on the instance
        return True
    return getattr(type(cb), hook, None) is not getattr(Callback, hook, None)


def check_callbacks(callbacks: list[Any]) -> None:
    """Refuse, with the reason, every callback that cannot work at the round level."""
    from dpfl_lightning.plugins.callback import FederatedCallback

    for cb in callbacks:
        name = type(cb).__name__
        if isinstance(cb, FederatedCallback):
            raise ConfigError("trainer.callbacks", name, "is a federated plugin, not a Lightning callback",
                              "pass it in plugins=[...]")
        if not isinstance(cb, Callback):
            raise ConfigError("trainer.callbacks", name, "is not a lightning.pytorch.callbacks.Callback",
                              "pass Lightning Callback instances")
        if isinstance(cb, ModelCheckpoint):
            if getattr(cb, "_every_n_train_steps", 0) or getattr(cb, "_train_time_interval", None) is not None:
                raise ConfigError("trainer.callbacks", f"{name}(every_n_train_steps / train_time_interval)",
                                  "local training steps and their wall time belong to single clients; checkpoints "
                                  "are taken at round ends", "use every_n_epochs (rounds) or a monitored metric")
            continue
        if isinstance(cb, LearningRateMonitor):
            if cb.logging_interval == "step":
                raise ConfigError("trainer.callbacks", "LearningRateMonitor(logging_interval='step')",
                                  "the learning rate moves inside clients; the run logs once per round",
                                  "use logging_interval='epoch' (the learning rate at the start of each round)")
            continue
        if isinstance(cb, _SUPPORTED):
            pass
        elif type(cb).__module__.startswith(("lightning.pytorch.callbacks", "pytorch_lightning.callbacks")):
            hint = next((h for base, h in _HINTS.items() if any(c.__name__ == base for c in type(cb).__mro__)),
                        "it needs lightning.Trainer's own training loop")
            raise ConfigError("trainer.callbacks", name, f"cannot run at the round level of a federated run: {hint}",
                              f"remove {name}")
        per_batch = [h for h in PER_BATCH_HOOKS if _hook_overridden(cb, h)]
        if per_batch:
            raise ConfigError("trainer.callbacks", name, f"overrides {', '.join(per_batch)}, which would run per "
                              "local batch inside clients (on their raw data); callbacks of a federated run see rounds "
                              "only", "move that logic into the LightningModule's own hook, or use round-level hooks "
                              "(on_train_epoch_end, on_validation_end)")


class _CaptureLogger(Logger):
    """The logger callbacks see: what they log goes into the round's row (and through its release
    filter). Directory, name and version are the run's CSV log's, so ``ModelCheckpoint`` without a
    ``dirpath`` writes into the run directory."""

    def __init__(self, save_dir: str | None, name: str | None, version: Any) -> None:
        super().__init__()
        self._save_dir, self._name, self._version = save_dir, name, version
        self.pending: dict[str, float] = {}

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def version(self) -> Any:
        return self._version

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    def root_dir(self) -> str | None:
        return None if self._save_dir is None else os.path.join(self._save_dir, self._name or "")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.pending[key] = float(value)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def pop(self) -> dict[str, float]:
        out, self.pending = self.pending, {}
        return out


class _RoundStrategy:
    def __init__(self, run: Any) -> None:  # the run's LightningRun
        self._run = run

    @property
    def root_device(self) -> torch.device:
        return self._run.module.device

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        comm = self._run.comm
        return comm.broadcast_object(obj, root=src) if comm is not None and comm.size > 1 else obj

    def barrier(self, name: str | None = None) -> None:
        comm = self._run.comm
        if comm is not None and comm.size > 1:
            comm.barrier()

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        return decision  # every rank computes it from the same released row

    def remove_checkpoint(self, filepath: str) -> None:
        if self._run.is_global_zero and os.path.exists(filepath):
            os.remove(filepath)


class RoundTrainer:
    """What Lightning callbacks receive as ``trainer``: the round loop of a federated run (see the
    module docstring). Attributes a callback reads that a federated run cannot give raise an
    ``AttributeError`` naming them."""

    def __init__(self, run: Any, callbacks: list[Callback], loggers: list[Any]) -> None:  # run: the LightningRun
        from lightning.pytorch.trainer.states import RunningStage, TrainerFn

        self._run = run
        fed = run.settings
        first = loggers[0] if loggers else None
        where = (getattr(first, "save_dir", None) or getattr(first, "root_dir", None), getattr(first, "name", None),
                 getattr(first, "version", None)) if first is not None else (fed.log_dir, fed.run_name, None)
        self.capture = _CaptureLogger(*self.strategy_broadcast(where))
        self.loggers = [self.capture]
        self.logger = self.capture
        self.callbacks = callbacks
        self.strategy = _RoundStrategy(run)
        self.state = SimpleNamespace(fn=TrainerFn.FITTING, stage=RunningStage.TRAINING, status="running")
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, torch.Tensor] = {}
        self.current_epoch = 0
        self.sanity_checking = False
        self.fast_dev_run = False
        self.training = True
        self.validating = self.testing = self.predicting = False
        self.interrupted = False
        self.received_sigterm = False
        self.ckpt_path = None
        self.val_check_interval = 1.0
        self.check_val_every_n_epoch = fed.eval_every
        self.max_epochs = fed.rounds
        self.max_steps = -1
        self.num_nodes = 1
        self.precision = run.module.loop.precision
        self.default_root_dir = fed.log_dir
        has_val = run.module.has_validation_step and (run.data.has_val_set or run.data.has_test_set)
        self.num_val_batches = [1 if has_val else 0]
        self.num_sanity_val_steps = 0
        self.fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(
            val_loop=SimpleNamespace(_has_run=False), batch_progress=SimpleNamespace(is_last_batch=True),
            _batches_that_stepped=0))
        self._logger_connector = SimpleNamespace(should_update_logs=False)

    def strategy_broadcast(self, obj: Any) -> Any:
        comm = self._run.comm
        return comm.broadcast_object(obj, root=0) if comm is not None and comm.size > 1 else obj

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"a callback read trainer.{name}, which a federated run does not provide (callbacks run "
                             "at the round level; see dpfl_lightning.lightning.callbacks)")

    # ------------------------------------------------------------------ the run
    @property
    def lightning_module(self) -> Any:
        return self._run.module.inner

    model = lightning_module

    @property
    def datamodule(self) -> Any:
        return self._run.data.datamodule

    @property
    def global_step(self) -> int:
        """Optimizer steps of a client that took part in every round so far (the reference client); in a
        DP run whose steps per round follow the clients' data, the rounds done (see
        :meth:`~dpfl_lightning.module.replay.ScheduleReplay.written_step`): ``ModelCheckpoint`` names its
        files with it."""
        module = self._run.module
        if module.schedules.steps_private:
            return self._run.rounds_done
        return self._run.rounds_done * module.loop.steps_reference

    @property
    def is_global_zero(self) -> bool:
        return self._run.is_global_zero

    @property
    def global_rank(self) -> int:
        return self._run.comm.rank if self._run.comm is not None else 0

    @property
    def local_rank(self) -> int:
        comm = self._run.comm
        return comm.local_rank if comm is not None else 0

    @property
    def world_size(self) -> int:
        return self._run.comm.size if self._run.comm is not None else 1

    @property
    def log_dir(self) -> str | None:
        return self._run.status.csv_log_dir

    @property
    def should_stop(self) -> bool:
        return self._run.status.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        status = self._run.status
        if value and not status.should_stop:
            names = ", ".join(type(cb).__name__ for cb in self.callbacks if isinstance(cb, EarlyStopping)) or "a callback"
            status.stop(f"{names} stopped the run after round {self.current_epoch + 1}")

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._run.reference().opts

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        return self._run.reference().scheds

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def early_stopping_callbacks(self) -> list[EarlyStopping]:
        return [cb for cb in self.callbacks if isinstance(cb, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        found = self.early_stopping_callbacks
        return found[0] if found else None

    def save_checkpoint(self, filepath: str, weights_only: bool = False, storage_options: Any = None) -> None:
        """A Lightning checkpoint of the global model (weights and hyperparameters; rank 0 writes)."""
        self._run.save_lightning_checkpoint(filepath, self.current_epoch, self.global_step)

    # ------------------------------------------------------------------ called by the run
    def call(self, hook: str, *args: Any) -> None:
        pl_module = self.lightning_module
        for cb in self.callbacks:
            getattr(cb, hook)(self, pl_module, *args)

    def set_round(self, round_idx: int, row: dict[str, float] | None, evaluated: bool) -> None:
        self.current_epoch = round_idx
        self.fit_loop.epoch_loop.val_loop._has_run = evaluated
        self.fit_loop.epoch_loop._batches_that_stepped = self.global_step
        if row is not None:
            metrics = {k: torch.tensor(float(v)) for k, v in row.items() if isinstance(v, (int, float))}
            self.callback_metrics = metrics
            self.logged_metrics = dict(metrics)
