"""FederatedLightningModule: the user's LightningModule, unchanged, trained as many clients.

The wrapped module's parameters are views into ONE flat fp32 buffer (``working``), and the global
model lives in a second flat buffer (``global_params``; :mod:`~dpfl_lightning.module.parameters`).
A client starts with ``working.copy_(global_params)``, trains by calling the module's own
``training_step`` and hooks in Lightning's order (:mod:`~dpfl_lightning.module.loop`), and its
update is ``working - global_params``: no ``lightning.Trainer`` per client.

While a run lasts, ``self.trainer`` of the wrapped module is a small stand-in for
``lightning.Trainer`` (:mod:`~dpfl_lightning.module.trainer_shim`): ``current_epoch`` is the round,
``global_step`` and ``estimated_stepping_batches`` count one client's optimizer steps,
``self.optimizers()``, ``self.lr_schedulers()``, ``self.manual_backward``, ``self.clip_gradients``,
``self.toggle_optimizer`` work as under Lightning. What each of these means in a federated run is
written down in :mod:`dpfl_lightning.lightning.semantics`. Every client's optimizers start where one
Lightning run's schedule would stand (:mod:`~dpfl_lightning.module.replay`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.module.logged_metrics import LoggedMetrics
from dpfl_lightning.module.batches import Batch
from dpfl_lightning.module.eval_pass import Evaluation
from dpfl_lightning.module.introspect import TRANSFER_HOOKS, is_lightning_module, is_overridden
from dpfl_lightning.module.loop import ClientLoop, ClientRun, LoopSettings, StepHook, WrapOptimizer
from dpfl_lightning.module.parameters import FlatParameters
from dpfl_lightning.module.replay import OptimizerRule, ScheduleReplay
from dpfl_lightning.module.trainer_shim import TrainerShim
from dpfl_lightning.module.schedule import RoundEnd, ScheduleCursor


class FederatedLightningModule:
    """Wrap any LightningModule (or an ``nn.Module`` plus a loss) for federated training.

    Args:
        model: a ``LightningModule`` (its class is used unchanged) or a plain ``nn.Module``.
        loss_fn: required with a plain ``nn.Module``; e.g. ``torch.nn.functional.cross_entropy``.
        optimizer / lr / momentum / weight_decay: the local optimizer for a plain ``nn.Module``
            (``"sgd"`` or ``"adam"``); a LightningModule's ``configure_optimizers`` is used instead.
        task: ``"classification"`` logs accuracy next to the loss for a plain ``nn.Module``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        task: str = "classification",
    ) -> None:
        if is_lightning_module(model):
            self.inner = model
        elif isinstance(model, nn.Module):
            if loss_fn is None:
                raise ConfigError("loss_fn", None, "a plain nn.Module needs a loss function",
                                  "pass loss_fn=torch.nn.functional.cross_entropy (or wrap the model in a LightningModule)")
            from dpfl_lightning.models import SupervisedModule

            self.inner = SupervisedModule(model, loss_fn, optimizer, lr, momentum, weight_decay, task)
        else:
            raise ConfigError("model", type(model).__name__, "is not a torch module",
                              "pass a LightningModule or an nn.Module with loss_fn")
        self.logged = LoggedMetrics()
        self.attached = False  # self.trainer of the wrapped module is the stand-in
        self.device = torch.device("cpu")
        self.loop = LoopSettings()
        self.datamodule: Any = None
        self.params = FlatParameters()
        self.trainer_shim = TrainerShim(self)  # what the wrapped module sees as self.trainer while a run lasts
        self.schedules = ScheduleReplay(self)
        self.client_loop = ClientLoop(self)
        self.evaluation = Evaluation(self)
        self._has_val = self._has_test = False

    # ------------------------------------------------------------------ run set-up
    def configure_loop(self, settings: LoopSettings, datamodule: Any = None) -> None:
        """The trainer's settings for this run (before :meth:`prepare`)."""
        self.loop = settings
        self.datamodule = datamodule
        shim = self.trainer_shim
        shim.max_epochs = settings.rounds
        shim.accumulate_grad_batches = settings.accumulate_grad_batches
        shim.gradient_clip_val = settings.gradient_clip_val
        if settings.gradient_clip_algorithm is not None:
            from lightning.pytorch.utilities import GradClipAlgorithmType

            shim.gradient_clip_algorithm = GradClipAlgorithmType(settings.gradient_clip_algorithm)
        else:
            shim.gradient_clip_algorithm = None
        shim.precision = settings.precision
        shim.check_val_every_n_epoch = settings.eval_every
        shim.log_dir = shim.default_root_dir = settings.log_dir
        shim.datamodule = datamodule
        self.schedules.reset()

    def add_optimizer_rule(self, rule: OptimizerRule) -> None:
        """A rule on the optimizers ``configure_optimizers`` returns, checked at set-up
        (:meth:`check_optimizers`; it raises to refuse); a plugin adds it in its set-up, for this run."""
        self.schedules.optimizer_rules.append(rule)

    def attach(self) -> None:
        """Make ``self.trainer`` of the wrapped module (and of LightningModules inside it) the stand-in,
        and route ``self.log`` to the round's metrics."""
        m = self.inner
        shim = self.trainer_shim
        shim.model = shim.lightning_module = m
        m.trainer = shim  # LightningModule's setter also sets it on nested LightningModules
        for sub in m.modules():
            if is_lightning_module(sub):
                sub.log = self.logged.log  # instance attributes shadow LightningModule.log / log_dict
                sub.log_dict = self.logged.log_dict
        self.attached = True

    def prepare(self, stage: str = "fit") -> None:
        """Lightning's run-level set-up hooks, before the parameters are laid out: ``setup(stage)`` and
        ``configure_model()`` (layers they create are trained like any other)."""
        if not self.attached:
            self.attach()
        self.inner.setup(stage)
        self.inner.configure_model()

    def setup(self, device: torch.device, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        """Move to ``device``, lay the parameters over one flat buffer and attach the stand-in trainer."""
        if not self.attached:
            self.attach()
        m = self.inner
        m.to(device)
        self.device = device
        self.evaluation.all_modules = None
        self.params.lay_out(m, device)
        shim = self.trainer_shim
        shim.global_rank, shim.world_size, shim.local_rank = rank, world_size, local_rank
        shim.is_global_zero = rank == 0
        shim.device = device
        self.client_loop.setup(m, self.datamodule, self.loop, device)
        self._has_val = is_overridden(m, "validation_step")
        self._has_test = is_overridden(m, "test_step")

    def teardown(self) -> None:
        """Leave the wrapped module as an ordinary LightningModule holding the final global parameters:
        its own parameter storage (no longer views of the flat buffer), no stand-in trainer, Lightning's
        own ``self.log``. ``lightning.Trainer`` can fit and test it afterwards."""
        m = self.inner
        self.params.unlay()
        if self.attached:
            m.trainer = None
            for sub in m.modules():
                if is_lightning_module(sub):
                    sub.__dict__.pop("log", None)
                    sub.__dict__.pop("log_dict", None)
            m._param_requires_grad_state = {}  # what LightningModule.toggle_optimizer keeps
            self.attached = False
        shim = self.trainer_shim
        shim.optimizers = []
        shim.lr_scheduler_configs = []
        shim.strategy.reset_optimizers()
        self.schedules.cursors = {}

    # ------------------------------------------------------------------ the flat parameters
    @property
    def working(self) -> torch.Tensor:
        """The flat buffer the wrapped module's parameters are views of (a client's parameters)."""
        return self.params.working

    @property
    def global_params(self) -> torch.Tensor:
        """The flat global model."""
        return self.params.global_params

    @property
    def num_parameters(self) -> int:
        return self.params.working.numel()

    @property
    def parameter_slices(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every parameter of the wrapped module in the flat buffers."""
        return list(self.params.slices)

    @property
    def parameter_list(self) -> list[torch.nn.Parameter]:
        """The wrapped module's parameters, in the order of the flat buffers."""
        return list(self.params.params)

    def trainable_mask(self) -> torch.Tensor:
        """A bool mask over the flat parameter buffers (``working``, ``global_params``): ``True`` where the
        parameter requires gradients now. Call it between clients for the state at the start of a round;
        a module's hooks may change it inside a client (a layer unfrozen in ``on_train_epoch_start`` or
        ``configure_optimizers``), so read it again after a client to see what it trained. A fresh tensor."""
        return self.params.trainable_mask()

    def load_global(self) -> None:
        """Set the module's parameters to the global model and its buffers to their initial values
        (see :meth:`FlatParameters.load_global <dpfl_lightning.module.parameters.FlatParameters.load_global>`)."""
        self.params.load_global()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's ``state_dict`` at the global parameters."""
        self.load_global()
        return self.inner.state_dict()

    # ------------------------------------------------------------------ what the module is
    @property
    def batch_records(self) -> int:
        """The number of records in the batch being trained (or evaluated) now: the first dimension of
        its first tensor, as the local loop counts it (:func:`~dpfl_lightning.module.batches.batch_size_of`)."""
        return self.logged.current_batch_size

    @property
    def automatic_optimization(self) -> bool:
        return self.client_loop.automatic

    @property
    def overridden_step_hooks(self) -> list[str]:
        """The per-batch hooks the module overrides (Lightning's defaults are called directly)."""
        return [h for h, on in self.client_loop.overridden.items() if on]

    @property
    def overridden_transfer_hooks(self) -> list[str]:
        """The batch-transfer hooks the module overrides."""
        return [h for h in TRANSFER_HOOKS if is_overridden(self.inner, h)]

    @property
    def has_validation_step(self) -> bool:
        return self._has_val

    @property
    def has_test_step(self) -> bool:
        return self._has_test

    @property
    def scaler(self) -> Any:
        """The loss scaler of ``16-mixed`` (``None`` otherwise)."""
        return self.client_loop.scaler

    _scaler = scaler

    # ------------------------------------------------------------------ rounds, optimizers and schedules
    def set_round(self, round_idx: int) -> None:
        """``self.trainer.current_epoch`` of the wrapped module is the round."""
        self.trainer_shim.current_epoch = round_idx

    def record_round(self, round_idx: int, row: Mapping[str, float]) -> None:
        """The metrics round ``round_idx`` released: what ``ReduceLROnPlateau`` monitors and what
        ``self.trainer.callback_metrics`` shows."""
        self.schedules.round_metrics[round_idx] = dict(row)
        metrics = {k: torch.tensor(float(v)) for k, v in row.items() if isinstance(v, (int, float))}
        self.trainer_shim.callback_metrics = metrics
        self.trainer_shim.logged_metrics = dict(metrics)

    @property
    def round_metrics(self) -> dict[int, dict[str, float]]:
        """The released rows by round (what ``ReduceLROnPlateau`` monitors)."""
        return self.schedules.round_metrics

    @property
    def round_ends(self) -> dict[tuple[int, int], RoundEnd]:
        """The round ends taken, by (optimizer steps per round, round)."""
        return self.schedules.round_ends

    @property
    def notes(self) -> set[str]:
        """What the run says differs from lightning.Trainer (see :mod:`dpfl_lightning.lightning.semantics`)."""
        return self.schedules.notes

    @property
    def has_schedulers(self) -> bool:
        """Whether ``configure_optimizers`` returned LR schedulers."""
        return bool(self.schedules.seen_schedulers)

    def set_client_shape(self, round_idx: int, steps: int, batches: int) -> None:
        """See :meth:`ScheduleReplay.set_client_shape <dpfl_lightning.module.replay.ScheduleReplay.set_client_shape>`."""
        self.schedules.set_client_shape(round_idx, steps, batches)

    def start_step(self, steps: int, round_idx: int) -> int:
        """``global_step`` at the start of ``round_idx`` for clients of ``steps`` steps per round."""
        return self.schedules.start_step(steps, round_idx)

    def check_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
        """Call ``configure_optimizers`` once, as the reference client would (refuses what cannot run)."""
        return self.schedules.check_optimizers()

    def cursor(self, steps: int, round_idx: int) -> ScheduleCursor:
        """The optimizers and schedulers of a client with ``steps`` optimizer steps per round, at the start
        of ``round_idx`` (see :mod:`dpfl_lightning.module.schedule`)."""
        return self.schedules.cursor(steps, round_idx)

    def make_optimizers(self, steps: int = 0, round_idx: int = 0) -> tuple[list[torch.optim.Optimizer],
                                                                          list[LRSchedulerConfig], RoundEnd]:
        """Fresh local optimizers placed on the schedule (see :class:`~dpfl_lightning.module.replay.ScheduleReplay`)."""
        return self.schedules.make_optimizers(steps, round_idx)

    def round_ends_of_clients(self) -> dict[int, RoundEnd | str | None]:
        """What this rank's clients of each step count did with their optimizers' state this round; cleared
        for the next round. The run combines the ranks' and calls :meth:`take_round_end`."""
        return self.schedules.round_ends_of_clients()

    def take_round_end(self, steps: int, round_idx: int, end: RoundEnd) -> bool:
        """Continue clients of ``steps`` steps per round from ``end`` after ``round_idx``; ``False`` when
        its optimizers do not have the structure of the cursor's (nothing is taken)."""
        return self.schedules.take_round_end(steps, round_idx, end)

    def schedule_state(self) -> list[dict[str, Any]]:
        """The round ends taken so far, in plain types (for the run's checkpoint)."""
        return self.schedules.schedule_state()

    def load_schedule_state(self, state: list[dict[str, Any]]) -> None:
        self.schedules.load_schedule_state(state)

    # ------------------------------------------------------------------ local training and evaluation
    def fit_client(
        self,
        batches: Iterable[tuple[int, int, Batch]],
        round_idx: int = 0,
        lr_factor: float = 1.0,
        before_optimizer_step: StepHook | None = None,
        wrap_optimizer: WrapOptimizer | None = None,
        batches_per_round: int | None = None,
        batches_per_epoch: int | None = None,
    ) -> ClientRun:
        """Train the module from its current parameters on one client's ``(epoch, batch_idx, batch)``
        stream. The caller loads the global model first and reads ``working`` afterwards.

        ``lr_factor`` multiplies the learning rate of every step (client lr decay); ``wrap_optimizer``
        replaces each fresh local optimizer (e.g. by a DP-SGD optimizer). ``batches_per_round`` (the
        client's local batches this round) and ``batches_per_epoch`` place the client's schedule: its
        optimizers, schedulers and ``self.global_step`` start where the cursor of its optimizer steps
        per round stands at ``round_idx`` (see :mod:`dpfl_lightning.module.schedule`), and where it ends them
        is recorded for the round (:meth:`round_ends_of_clients`)."""
        return self.client_loop.fit_client(batches, round_idx, lr_factor, before_optimizer_step, wrap_optimizer,
                                           batches_per_round, batches_per_epoch)

    def evaluate(self, batches: Iterable[Batch], stage: str = "validation") -> dict[str, tuple[float, float, str]]:
        """Run ``validation_step`` (or ``test_step``) over ``batches`` at the current parameters, with
        Lightning's evaluation hooks around it; returns what ``self.log`` recorded, as sums for merging."""
        return self.evaluation.evaluate(batches, stage)
