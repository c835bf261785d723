"""FederatedLightningModule: the user's LightningModule, unchanged, trained as many clients.

The wrapped module's parameters are views into ONE flat fp32 buffer (``working``), and the global
model lives in a second flat buffer (``global_params``). A client starts with
``working.copy_(global_params)``, trains by calling the module's own ``training_step`` and hooks in
Lightning's order, and its update is ``working - global_params``: two vector operations, no
``parameters_to_vector`` copies and no ``lightning.Trainer`` per client.

While a run lasts, ``self.trainer`` of the wrapped module is a small stand-in for
``lightning.Trainer`` (:class:`_TrainerShim`): ``current_epoch`` is the round, ``global_step``
and ``estimated_stepping_batches`` count one client's optimizer steps, ``self.optimizers()``,
``self.lr_schedulers()``, ``self.manual_backward``, ``self.clip_gradients``,
``self.toggle_optimizer`` work as under Lightning. What each of these means in a federated run is
written down in :mod:`dpfl_lightning.lightning_compat`.

Lightning's per-batch order (automatic optimization), which :meth:`fit_client` follows:

1. ``on_before_batch_transfer`` -> ``transfer_batch_to_device`` -> ``on_after_batch_transfer``
   (a LightningDataModule's own versions take precedence, as in Lightning)
2. ``on_train_batch_start`` (returning ``-1`` ends the client's local training)
3. ``optimizer_step(epoch, batch_idx, optimizer, closure)``; the closure runs ``training_step``,
   ``on_before_zero_grad``, ``optimizer_zero_grad``, ``on_before_backward``, ``backward``,
   ``on_after_backward``; then the plugins' and the module's ``on_before_optimizer_step`` and
   ``configure_gradient_clipping`` run before the parameters change. With
   ``accumulate_grad_batches=k`` only every ``k``-th batch (and the last of a local epoch) steps.
4. ``on_train_batch_end``; step-interval LR schedulers step.

``on_train_epoch_start`` / ``on_train_epoch_end`` run once per client per round, around all of its
local epochs. With manual optimization the module's ``training_step`` drives its optimizers itself
(``self.optimizers()``, ``self.manual_backward``); the plugins' ``on_before_optimizer_step`` runs
inside every ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from dpfl_lightning import optimizer_calls
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.logged_metrics import LoggedMetrics
from dpfl_lightning.schedule import (RoundEnd, ScheduleCursor, ended_as, hyperparameters, merge_end,
                                     step_scheduler)

Batch = Any
StepHook = Callable[[torch.optim.Optimizer], None]


def is_lightning_module(obj: Any) -> bool:
    """True for ``lightning.LightningModule`` and ``pytorch_lightning.LightningModule`` alike."""
    return isinstance(obj, nn.Module) and any(c.__name__ == "LightningModule" for c in type(obj).__mro__)


def _lightning_base(module: Any, base: str = "LightningModule") -> type | None:
    return next((c for c in type(module).__mro__ if c.__name__ == base), None)


def is_overridden(module: Any, name: str, base: str = "LightningModule") -> bool:
    """True when the object's class defines ``name`` itself instead of inheriting it from Lightning's
    ``base`` class (an object without that base overrides whatever it has)."""
    cls = _lightning_base(module, base)
    if cls is None:
        return callable(getattr(module, name, None))
    return getattr(type(module), name, None) is not getattr(cls, name, None)


def batch_size_of(batch: Batch) -> int:
    if type(batch) is tuple and batch and type(batch[0]) is torch.Tensor and batch[0].dim():
        return batch[0].shape[0]  # the common case, without recursion
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, Mapping) and batch:
        return batch_size_of(next(iter(batch.values())))
    return 1


def _move(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _move(v, device) for k, v in batch.items()}
    return batch


_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "optimizer_step", "on_before_zero_grad",
               "optimizer_zero_grad", "on_before_backward", "backward", "on_after_backward", "on_before_optimizer_step",
               "configure_gradient_clipping", "lr_scheduler_step")
_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
_SCHEDULER_KEYS = {"scheduler", "name", "interval", "frequency", "reduce_on_plateau", "monitor", "strict"}


# ---------------------------------------------------------------------------------------- configure_optimizers
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
    return cfg


def _with_grad(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with gradients enabled, as ``optimizer.step(closure)`` runs its closure
    (entering ``torch.enable_grad()`` when they already are, as in training, costs ~3 us a step)."""
    if torch.is_grad_enabled():
        return fn(*args)
    with torch.enable_grad():
        return fn(*args)


def optimizer_steps_per_round(batches: int, batches_per_epoch: int, accumulate: int) -> int:
    """Optimizer steps of ``batches`` local batches taken in passes of ``batches_per_epoch``, when every
    ``accumulate``-th batch of a pass, and the last one, step (Lightning's accumulation rule)."""
    if accumulate <= 1:
        return batches
    per_epoch = max(batches_per_epoch, 1)
    full, rest = divmod(batches, per_epoch)
    return full * math.ceil(per_epoch / accumulate) + math.ceil(rest / accumulate)


# ---------------------------------------------------------------------------------------- loop settings


@dataclass
class LoopSettings:
    """The trainer settings that shape every client's local loop (and what ``self.trainer`` shows)."""

    rounds: int = 1
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    precision: str = "32-true"
    eval_every: int = 1
    steps_reference: int = 0  # optimizer steps per round of the reference (largest) client
    log_dir: str | None = None


class _Strategy:
    """``self.trainer.strategy``: where ``LightningOptimizer.step`` and ``manual_backward`` land."""

    handles_gradient_accumulation = False

    def __init__(self, fm: FederatedLightningModule) -> None:
        self._fm = fm
        self._wrapped: list[LightningOptimizer] | None = None

    @property
    def _lightning_optimizers(self) -> list[LightningOptimizer]:
        """What ``self.optimizers()`` returns: the client's optimizers as ``LightningOptimizer``, built
        on first use (building one creates a class, ~10-40 us, which most clients never need)."""
        if self._wrapped is None:
            self._wrapped = []
            for o in self._fm._shim.optimizers:
                lo = LightningOptimizer(o)
                lo._strategy = self
                self._wrapped.append(lo)
        return self._wrapped

    def reset_optimizers(self) -> None:
        self._wrapped = None

    @property
    def lightning_module(self) -> nn.Module:
        return self._fm.inner

    model = lightning_module

    @property
    def root_device(self) -> torch.device:
        return self._fm.device

    @property
    def is_global_zero(self) -> bool:
        return self._fm._shim.is_global_zero

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        return self._fm._optimizer_step(optimizer, closure, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._fm._backward(closure_loss, *args, **kwargs)

    # a client trains on one rank; nothing inside the module synchronises ranks
    def barrier(self, name: str | None = None) -> None:
        return None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        return decision


class _PrecisionPlugin:
    """``self.trainer.precision_plugin``: gradient clipping as Lightning's precision plugins do it."""

    def __init__(self, fm: FederatedLightningModule) -> None:
        self._fm = fm

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: float | int = 0.0,
                       gradient_clip_algorithm: Any = "norm") -> None:
        if clip_val is None or clip_val <= 0:
            return
        if getattr(optimizer, "clips_per_record", False):
            raise ConfigError("gradient clipping", clip_val, "DP-SGD clips every record's gradient at max_grad_norm and "
                              "ignores the batch gradient, so clipping it has no effect",
                              "remove the clipping (DPSGD(max_grad_norm=...) is the bound)")
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) == "value":
            torch.nn.utils.clip_grad_value_(params, clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, clip_val)


class _TrainerShim:
    """``self.trainer`` of the wrapped module during a federated run (a stand-in for
    ``lightning.Trainer``; see :mod:`dpfl_lightning.lightning_compat` for what each attribute means)."""

    def __init__(self, fm: FederatedLightningModule) -> None:
        self.strategy = _Strategy(fm)
        self.precision_plugin = _PrecisionPlugin(fm)
        self.current_epoch = 0
        self.global_step = 0
        self.global_rank = 0
        self.local_rank = 0
        self.node_rank = 0
        self.world_size = 1
        self.num_nodes = 1
        self.num_devices = 1
        self.is_global_zero = True
        self.logger = None
        self.loggers: list[Any] = []
        self.device = torch.device("cpu")
        self.max_epochs = 1
        self.min_epochs = None
        self.max_steps = -1
        self.min_steps = None
        self.estimated_stepping_batches = 0
        self.num_training_batches = 0
        self.accumulate_grad_batches = 1
        self.gradient_clip_val: float | None = None
        self.gradient_clip_algorithm: Any = None
        self.precision = "32-true"
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[LRSchedulerConfig] = []
        self.model: nn.Module | None = None
        self.lightning_module: nn.Module | None = None
        self.datamodule: Any = None
        self.training = self.validating = self.testing = self.predicting = self.sanity_checking = False
        self.is_last_batch = False
        self.should_stop = False
        self.interrupted = False
        self.callback_metrics: dict[str, torch.Tensor] = {}
        self.logged_metrics: dict[str, torch.Tensor] = {}
        self.progress_bar_metrics: dict[str, torch.Tensor] = {}
        self.check_val_every_n_epoch = 1
        self.val_check_interval = 1.0
        self.num_sanity_val_steps = 0
        self.log_every_n_steps = 1
        self.fast_dev_run = False
        self.log_dir: str | None = None
        self.default_root_dir: str | None = None
        self.callbacks: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"self.trainer.{name} is not available in a federated run (there is no lightning.Trainer; "
                             "see dpfl_lightning.lightning_compat for what self.trainer offers)")



# ---------------------------------------------------------------------------------------- what the model may hold
def _running_stats(m: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, mod) for n, mod in m.named_modules()
            if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats]


_STATS_WHY = ("BatchNorm running statistics are computed from each client's data in train mode and are not federated "
              "here, so evaluation would use their initial values")
_STATS_FIX = ("use GroupNorm or LayerNorm, or BatchNorm(track_running_stats=False); a pretrained BatchNorm kept in "
              "eval mode (.eval(), its statistics fixed) runs")


def _refuse_running_stats(name: str) -> Callable[..., None]:
    """A forward pre-hook on a BatchNorm whose statistics are fixed (eval mode): refuses, by name, the
    first forward in train mode, which would update them from one client's data."""
    def hook(module: nn.Module, args: Any) -> None:
        if module.training:
            raise ConfigError("model", name, f"was switched to train mode during training: {_STATS_WHY}", _STATS_FIX)
    return hook


def _check_model(m: nn.Module, params: list[nn.Parameter]) -> None:
    """Refuse, at set-up, a model the flat fp32 global model cannot hold."""
    if not params:
        raise ConfigError("model", type(m).__name__, "has no parameters", "give the model trainable parameters")
    lazy = [n for n, p in m.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ConfigError("model", lazy[:3], "has lazy parameters whose shapes are not known yet (nn.LazyLinear "
                          "and the like)", "run the model once on an example batch before fit, or give the "
                          "layers their input sizes")
    as_buffers = [n for n, b in m.named_buffers() if any(b is p for p in params)]
    if as_buffers:  # reset to its initial value for every client (load_global), it would never train
        raise ConfigError("model", as_buffers[:3], "a parameter is also registered as a buffer",
                          "register it once: as a parameter (trained) or as a buffer (a constant)")
    bad = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if bad:
        raise ConfigError("model", type(m).__name__, f"has parameters of dtype {', '.join(bad)}",
                          "use float32 parameters (call model.float()); the global model is one fp32 buffer")
    # In eval mode (a pretrained BatchNorm, frozen) the statistics never change: they run, as under Lightning,
    # which keeps each submodule's mode; in train mode they would be computed per client and never federated.
    training = [n for n, mod in _running_stats(m) if mod.training]
    if training:
        raise ConfigError("model", training, _STATS_WHY, _STATS_FIX)


# ---------------------------------------------------------------------------------------- schedules across rounds
def _step_scheduler(m: nn.Module, cfg: LRSchedulerConfig, metric: Any, custom: bool) -> None:
    """One scheduler step as lightning.Trainer takes it: through the module's ``lr_scheduler_step``
    when it overrides it (automatic optimization), else the scheduler's own ``step``."""
    if custom:
        m.lr_scheduler_step(cfg.scheduler, metric)
    else:
        step_scheduler(cfg, metric)


@dataclass
class ClientRun:
    """What one client's local training did."""

    steps: int
    samples: int
    lr: float


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
        self._shim = _TrainerShim(self)
        self._ready = False
        self._attached = False
        self._laid_out = False
        self.device = torch.device("cpu")
        self.loop = LoopSettings()
        self.datamodule: Any = None
        self.round_metrics: dict[int, dict[str, float]] = {}  # released rows by round (ReduceLROnPlateau)
        self._cursors: dict[int, ScheduleCursor] = {}
        self.round_ends: dict[tuple[int, int], RoundEnd] = {}  # taken, by (steps per round, round)
        self._carried: set[int] = set()  # the steps per round with a round end taken
        self._client_ends: dict[int, RoundEnd | str | None] = {}
        self.notes: set[str] = set()  # what the run says differs from lightning.Trainer (once each)
        self._has_schedulers: bool | None = None
        self._scaler: Any = None
        self._autocast: tuple[str, torch.dtype] | None = None
        self._before_step: StepHook | None = None
        self._lr_factor = 1.0
        self._in_step = False
        self._all_modules: list[nn.Module] | None = None  # the module tree, for _modes
        self._stats_hooks: list[Any] = []
        self._mask: torch.Tensor | None = None
        self._mask_flags: tuple[bool, ...] | None = None
        self._dp_steps = 0
        self._overridden = {h: False for h in _STEP_HOOKS}
        self._automatic = bool(getattr(self.inner, "automatic_optimization", True))

    # ------------------------------------------------------------------ run set-up
    def configure_loop(self, settings: LoopSettings, datamodule: Any = None) -> None:
        """The trainer's settings for this run (before :meth:`prepare`)."""
        self.loop = settings
        self.datamodule = datamodule
        shim = self._shim
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
        self._cursors = {}
        self._has_schedulers = None
        self.round_metrics = {}
        self.round_ends, self._client_ends, self.notes, self._carried = {}, {}, set(), set()

    def attach(self) -> None:
        """Make ``self.trainer`` of the wrapped module (and of LightningModules inside it) the stand-in,
        and route ``self.log`` to the round's metrics."""
        m = self.inner
        shim = self._shim
        shim.model = shim.lightning_module = m
        m.trainer = shim  # LightningModule's setter also sets it on nested LightningModules
        for sub in m.modules():
            if is_lightning_module(sub):
                sub.log = self.logged.log  # instance attributes shadow LightningModule.log / log_dict
                sub.log_dict = self.logged.log_dict
        self._attached = True

    def prepare(self, stage: str = "fit") -> None:
        """Lightning's run-level set-up hooks, before the parameters are laid out: ``setup(stage)`` and
        ``configure_model()`` (layers they create are trained like any other)."""
        if not self._attached:
            self.attach()
        self.inner.setup(stage)
        self.inner.configure_model()

    def setup(self, device: torch.device, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        """Move to ``device``, lay the parameters over one flat buffer and attach the stand-in trainer."""
        if not self._attached:
            self.attach()
        m = self.inner
        m.to(device)
        self.device = device
        self._all_modules = None
        params = list(m.parameters())
        _check_model(m, params)
        self._stats_hooks = [mod.register_forward_pre_hook(_refuse_running_stats(name or type(mod).__name__))
                             for name, mod in _running_stats(m)]  # each in eval mode (_check_model)
        total = sum(p.numel() for p in params)
        self.working = torch.empty(total, dtype=torch.float32, device=device)
        offset = 0
        self._slices: list[tuple[int, int]] = []
        for p in params:
            n = p.numel()
            self.working[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.working[offset : offset + n].view_as(p)
            self._slices.append((offset, n))
            offset += n
        self._params = params
        self._mask_flags = None  # (trainable_mask of this layout)
        self._laid_out = True
        self.global_params = self.working.clone()
        self._buffers0 = {k: b.detach().clone() for k, b in m.named_buffers()}

        shim = self._shim
        shim.global_rank, shim.world_size, shim.local_rank = rank, world_size, local_rank
        shim.is_global_zero = rank == 0
        shim.device = device
        self._automatic = bool(getattr(m, "automatic_optimization", True))
        dm = self.datamodule
        self._transfer_fns = {h: (getattr(dm, h) if dm is not None and is_overridden(dm, h, "LightningDataModule")
                                  else getattr(m, h)) for h in _TRANSFER_HOOKS}
        self._transfer_hooks = any(is_overridden(m, h) for h in _TRANSFER_HOOKS) or (
            dm is not None and any(is_overridden(dm, h, "LightningDataModule") for h in _TRANSFER_HOOKS))
        self._overridden = {h: is_overridden(m, h) for h in _STEP_HOOKS}
        self._clip = self._automatic and (self._overridden["configure_gradient_clipping"]
                                          or bool(self.loop.gradient_clip_val))
        self._has_val = is_overridden(m, "validation_step")
        self._has_test = is_overridden(m, "test_step")
        self._set_precision(device)
        self._ready = True

    def _set_precision(self, device: torch.device) -> None:
        p = self.loop.precision
        self._autocast = None
        self._scaler = None
        if p == "bf16-mixed":
            self._autocast = (device.type, torch.bfloat16)
        elif p == "16-mixed":
            self._autocast = (device.type, torch.float16)
            self._scaler = torch.amp.GradScaler(device.type)

    def _forward_context(self) -> Any:
        if self._autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self._autocast[0], dtype=self._autocast[1])

    def teardown(self) -> None:
        """Leave the wrapped module as an ordinary LightningModule holding the final global parameters:
        its own parameter storage (no longer views of the flat buffer), no stand-in trainer, Lightning's
        own ``self.log``. ``lightning.Trainer`` can fit and test it afterwards."""
        m = self.inner
        for h in self._stats_hooks:
            h.remove()
        self._stats_hooks = []
        if self._laid_out:
            self.load_global()
            for p in self._params:
                p.data = p.data.clone()
            self._laid_out = False
        if self._attached:
            m.trainer = None
            for sub in m.modules():
                if is_lightning_module(sub):
                    sub.__dict__.pop("log", None)
                    sub.__dict__.pop("log_dict", None)
            m._param_requires_grad_state = {}
            self._attached = False
        self._shim.optimizers = []
        self._shim.lr_scheduler_configs = []
        self._shim.strategy.reset_optimizers()
        self._cursors = {}

    @property
    def num_parameters(self) -> int:
        return self.working.numel()

    @property
    def parameter_slices(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every parameter of the wrapped module in the flat buffers."""
        return list(self._slices)

    def trainable_mask(self) -> torch.Tensor:
        """A bool mask over the flat parameter buffers (``working``, ``global_params``): ``True`` where the
        parameter requires gradients now. Call it between clients for the state at the start of a round;
        a module's hooks may change it inside a client (a layer unfrozen in ``on_train_epoch_start`` or
        ``configure_optimizers``), so read it again after a client to see what it trained. A fresh tensor."""
        flags = tuple(p.requires_grad for p in self._params)
        if flags != self._mask_flags:
            mask = torch.zeros(self.working.numel(), dtype=torch.bool, device=self.working.device)
            for trainable, (offset, n) in zip(flags, self._slices):
                if trainable:
                    mask[offset : offset + n] = True
            self._mask, self._mask_flags = mask, flags
        return self._mask.clone()

    @property
    def parameter_list(self) -> list[torch.nn.Parameter]:
        """The wrapped module's parameters, in the order of the flat buffers."""
        return list(self._params)

    @property
    def automatic_optimization(self) -> bool:
        return self._automatic

    @property
    def overridden_step_hooks(self) -> list[str]:
        """The per-batch hooks the module overrides (Lightning's defaults are called directly)."""
        return [h for h, on in self._overridden.items() if on]

    @property
    def overridden_transfer_hooks(self) -> list[str]:
        """The batch-transfer hooks the module overrides."""
        return [h for h in _TRANSFER_HOOKS if is_overridden(self.inner, h)]

    @property
    def trainer_shim(self) -> _TrainerShim:
        """What the wrapped module sees as ``self.trainer`` while a run lasts."""
        return self._shim

    def set_round(self, round_idx: int) -> None:
        """``self.trainer.current_epoch`` of the wrapped module is the round."""
        self._shim.current_epoch = round_idx

    @property
    def has_validation_step(self) -> bool:
        return self._has_val

    @property
    def has_test_step(self) -> bool:
        return self._has_test

    def load_global(self) -> None:
        """Set the module's parameters to the global model and its buffers to their initial values.

        Buffers (e.g. BatchNorm running statistics) are computed from a client's data without noise,
        so they are never aggregated: each client starts from the initial buffers. Use GroupNorm or
        LayerNorm in private models.
        """
        if self._laid_out:
            self.working.copy_(self.global_params)
        else:  # after teardown the parameters have their own storage again
            with torch.no_grad():
                for p, (o, n) in zip(self._params, self._slices):
                    p.copy_(self.global_params[o : o + n].view_as(p))
        if self._buffers0:
            for k, b in self.inner.named_buffers():
                if k in self._buffers0:
                    b.copy_(self._buffers0[k])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's ``state_dict`` at the global parameters."""
        self.load_global()
        return self.inner.state_dict()

    def record_round(self, round_idx: int, row: Mapping[str, float]) -> None:
        """The metrics round ``round_idx`` released: what ``ReduceLROnPlateau`` monitors and what
        ``self.trainer.callback_metrics`` shows."""
        self.round_metrics[round_idx] = dict(row)
        metrics = {k: torch.tensor(float(v)) for k, v in row.items() if isinstance(v, (int, float))}
        self._shim.callback_metrics = metrics
        self._shim.logged_metrics = dict(metrics)

    # ------------------------------------------------------------------ optimizers and schedules
    def set_client_shape(self, round_idx: int, steps: int, batches: int) -> None:
        """What the module's trainer says at the start of a client's round: ``current_epoch`` is the
        round, ``global_step`` where the schedule of ``steps`` steps per round stands (``round * steps``
        unless the module's own steps moved it; see :mod:`dpfl_lightning.schedule`)."""
        shim = self._shim
        shim.current_epoch = round_idx
        shim.global_step = self.start_step(steps, round_idx)
        shim.estimated_stepping_batches = self.loop.rounds * steps
        shim.num_training_batches = batches

    def start_step(self, steps: int, round_idx: int) -> int:
        """``global_step`` at the start of ``round_idx`` for clients of ``steps`` steps per round: that of
        the last round end taken before it, plus ``steps`` per round since."""
        cur = self._cursors.get(steps)
        if cur is not None and cur.round <= round_idx:
            return self.cursor(steps, round_idx).start_step
        taken = [r for s, r in self.round_ends if s == steps and r < round_idx]
        if not taken:
            return round_idx * steps
        last = max(taken)
        return self.round_ends[(steps, last)].step + (round_idx - 1 - last) * steps

    def _configure_optimizers(self, steps: int) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
        shim = self._shim
        saved = shim.estimated_stepping_batches
        shim.estimated_stepping_batches = self.loop.rounds * steps
        try:
            opts, scheds = parse_optimizers(self.inner.configure_optimizers())
        finally:
            shim.estimated_stepping_batches = saved
        if self._automatic and len(opts) != 1:
            raise ConfigError("model.configure_optimizers", f"{len(opts)} optimizers",
                              "automatic optimization trains with exactly one optimizer",
                              "return one optimizer or set self.automatic_optimization = False")
        return opts, scheds

    def check_optimizers(self) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
        """Call ``configure_optimizers`` once, as the reference client would (refuses what cannot run)."""
        opts, scheds = self._configure_optimizers(self.loop.steps_reference)
        self._has_schedulers = bool(scheds)
        return opts, scheds

    @property
    def has_schedulers(self) -> bool:
        """Whether ``configure_optimizers`` returned LR schedulers."""
        return bool(self._has_schedulers)

    def cursor(self, steps: int, round_idx: int) -> ScheduleCursor:
        """The optimizers and schedulers of a client with ``steps`` optimizer steps per round, at the start
        of ``round_idx`` (see :mod:`dpfl_lightning.schedule`)."""
        cur = self._cursors.get(steps)
        if cur is None or cur.round > round_idx:
            opts, scheds = self._configure_optimizers(steps)
            cur = self._cursors[steps] = ScheduleCursor(
                opts, scheds, steps, self._automatic, self._cursor_step,
                lambda r, monitor: self.round_metrics.get(r, {}).get(monitor),
                lambda r: self.round_ends.get((steps, r)))
        cur.advance(round_idx)
        return cur

    def _cursor_step(self, cfg: LRSchedulerConfig, metric: Any, epoch: int, global_step: int) -> None:
        """A scheduler step of a cursor, with ``current_epoch`` and ``global_step`` showing its position
        (lightning.Trainer never steps schedulers in manual optimization, nor calls lr_scheduler_step
        there: a cursor places them by their declared interval with their own ``step``)."""
        shim = self._shim
        saved = shim.current_epoch, shim.global_step
        shim.current_epoch, shim.global_step = epoch, global_step
        try:
            _step_scheduler(self.inner, cfg, metric, self._automatic and self._overridden["lr_scheduler_step"])
        finally:
            shim.current_epoch, shim.global_step = saved

    def make_optimizers(self, steps: int = 0, round_idx: int = 0) -> tuple[list[torch.optim.Optimizer],
                                                                          list[LRSchedulerConfig], RoundEnd]:
        """Fresh local optimizers from ``configure_optimizers``, with the settings and scheduler states of
        the cursor of ``steps`` steps per round at the start of ``round_idx``; and the state the schedule
        alone would end the round in (what the client's own end is compared with)."""
        opts, scheds = self._configure_optimizers(steps)
        if scheds:
            self._has_schedulers = True
        if scheds or steps in self._carried:
            cur = self.cursor(steps, round_idx)
            if cur.copy_into(opts, scheds):
                return opts, scheds, cur.expected_end()
            self._note("structure")
        return opts, scheds, RoundEnd(self.start_step(steps, round_idx) + steps, hyperparameters(opts), [])

    # ------------------------------------------------------------------ what clients carry across rounds
    def _record_end(self, steps: int, opts: list[torch.optim.Optimizer], scheds: list[LRSchedulerConfig],
                    expected: RoundEnd) -> None:
        """A client's end of round, summed up for the round (:func:`~dpfl_lightning.schedule.merge_end`):
        only where it differs from the schedule's does its state count."""
        step = self._shim.global_step
        if ended_as(expected, step, opts, scheds):
            merge_end(self._client_ends, steps, None)
        else:
            merge_end(self._client_ends, steps, RoundEnd(step, hyperparameters(opts),
                                                         [copy.deepcopy(c.scheduler.state_dict()) for c in scheds]))

    def round_ends_of_clients(self) -> dict[int, RoundEnd | str | None]:
        """What this rank's clients of each step count did with their optimizers' state this round (see
        :func:`~dpfl_lightning.schedule.merge_end`); cleared for the next round. The run combines the ranks' and calls
        :meth:`take_round_end` (see :mod:`dpfl_lightning.schedule`)."""
        out, self._client_ends = self._client_ends, {}
        return out

    def take_round_end(self, steps: int, round_idx: int, end: RoundEnd) -> bool:
        """Continue clients of ``steps`` steps per round from ``end`` after ``round_idx``; ``False`` when
        its optimizers do not have the structure of the cursor's (nothing is taken)."""
        if not self.cursor(steps, round_idx).fits(end.groups, len(end.scheds)):
            return False
        self.round_ends[(steps, round_idx)] = end
        self._carried.add(steps)
        return True

    def schedule_state(self) -> list[dict[str, Any]]:
        """The round ends taken so far, in plain types (for the run's checkpoint)."""
        return [dict(end.as_dict(), steps=s, round=r) for (s, r), end in sorted(self.round_ends.items())]

    def load_schedule_state(self, state: list[dict[str, Any]]) -> None:
        self.round_ends = {(d["steps"], d["round"]): RoundEnd(d["step"], d["groups"], d["scheds"]) for d in state}
        self._carried = {s for s, _ in self.round_ends}
        self._cursors = {}

    def _note(self, kind: str) -> None:
        self.notes.add(kind)

    # ------------------------------------------------------------------ local training
    def _transfer(self, batch: Batch, dataloader_idx: int = 0) -> Batch:
        if not self._transfer_hooks:
            return batch if self.device.type == "cpu" else _move(batch, self.device)
        fns = self._transfer_fns
        batch = fns["on_before_batch_transfer"](batch, dataloader_idx)
        batch = fns["transfer_batch_to_device"](batch, self.device, dataloader_idx)
        return fns["on_after_batch_transfer"](batch, dataloader_idx)

    def _after_closure(self, optimizer: torch.optim.Optimizer) -> None:
        """What runs between the gradients and the parameter update (Lightning's order): the plugins'
        and the module's ``on_before_optimizer_step``, then gradient clipping."""
        if self._before_step is not None:
            self._before_step(optimizer)
        m = self.inner
        if self._overridden["on_before_optimizer_step"]:
            m.on_before_optimizer_step(optimizer)
        if self._clip:
            loop = self.loop
            if self._overridden["configure_gradient_clipping"]:
                m.configure_gradient_clipping(optimizer, gradient_clip_val=loop.gradient_clip_val,
                                              gradient_clip_algorithm=loop.gradient_clip_algorithm)
            else:
                self._shim.precision_plugin.clip_gradients(optimizer, loop.gradient_clip_val,
                                                           loop.gradient_clip_algorithm or "norm")

    def _closure_and_hooks(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any]) -> Any:
        out = closure()
        self._after_closure(optimizer)
        return out

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Every local optimizer step, automatic or manual (``LightningOptimizer.step`` lands here)."""
        if not self._automatic and getattr(optimizer, "clips_per_record", False):
            self._dp_steps += 1
            if self._dp_steps > 1:
                raise ConfigError("DPSGD", "optimizer.step()", "training_step stepped the DP-SGD optimizer more "
                                  "than once on one batch, but the accountant counts one noisy step per sampled "
                                  "batch", "step each optimizer at most once per training_step")
        factor = self._lr_factor
        saved = [g["lr"] for g in optimizer.param_groups] if factor != 1.0 else None

        def decay_lr() -> None:  # the client's lr decay applies to this step only
            if saved is not None:
                for g, lr in zip(optimizer.param_groups, saved):
                    g["lr"] = lr * factor

        self._in_step = True
        try:
            if self._scaler is not None:
                out = closure()
                self._scaler.unscale_(optimizer)
                self._after_closure(optimizer)
                if not self._automatic or out is not None:
                    decay_lr()
                    self._scaler.step(optimizer, **kwargs)
                    self._scaler.update()
            elif not kwargs and optimizer_calls.steps_directly(optimizer):
                out = _with_grad(self._closure_and_hooks, optimizer, closure)  # what step(closure) runs
                decay_lr()
                optimizer_calls.step(optimizer)
            else:
                def wrapped() -> Any:
                    out = closure()
                    self._after_closure(optimizer)
                    decay_lr()
                    return out

                out = optimizer.step(closure=wrapped, **kwargs)
            if not self._automatic:  # automatic optimization counts in the loop (also when a step is skipped)
                self._shim.global_step += 1
            return out
        finally:
            self._in_step = False
            if saved is not None:
                for g, lr in zip(optimizer.param_groups, saved):
                    g["lr"] = lr

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``manual_backward``: scale (16-mixed), ``on_before_backward``, ``backward``, ``on_after_backward``."""
        m = self.inner
        if self._scaler is not None:
            loss = self._scaler.scale(loss)
        m.on_before_backward(loss)
        m.backward(loss, *args, **kwargs)
        m.on_after_backward()
        return loss

    def _manual_pre_hook(self, optimizer: torch.optim.Optimizer) -> Callable[..., None]:
        """Plugins' step hooks for a raw optimizer stepped directly in manual optimization."""

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if not self._in_step:
                self._after_closure(optimizer)

        return hook

    def fit_client(
        self,
        batches: Iterable[tuple[int, int, Batch]],
        round_idx: int = 0,
        lr_factor: float = 1.0,
        before_optimizer_step: StepHook | None = None,
        wrap_optimizer: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
        batches_per_round: int | None = None,
        batches_per_epoch: int | None = None,
    ) -> ClientRun:
        """Train the module from its current parameters on one client's ``(epoch, batch_idx, batch)``
        stream. The caller loads the global model first and reads ``working`` afterwards.

        ``lr_factor`` multiplies the learning rate of every step (client lr decay); ``wrap_optimizer``
        replaces each fresh local optimizer (e.g. by a DP-SGD optimizer). ``batches_per_round`` (the
        client's local batches this round) and ``batches_per_epoch`` place the client's schedule: its
        optimizers, schedulers and ``self.global_step`` start where the cursor of its optimizer steps
        per round stands at ``round_idx`` (see :mod:`dpfl_lightning.schedule`), and where it ends them
        is recorded for the round (:meth:`round_ends_of_clients`)."""
        m = self.inner
        shim = self._shim
        automatic = self._automatic
        k = self.loop.accumulate_grad_batches if automatic else 1
        total = batches_per_round or 0
        per_epoch = batches_per_epoch or total
        steps_per_round = optimizer_steps_per_round(total, per_epoch, k) if automatic else total
        opts, scheds, expected = self._open_client(round_idx, steps_per_round, total, lr_factor,
                                                   before_optimizer_step, wrap_optimizer)
        lr = float(opts[0].param_groups[0]["lr"]) * lr_factor
        step_scheds = [c for c in scheds if c.interval == "step" and not c.reduce_on_plateau] if automatic else []
        handles = [] if automatic else [o.register_step_pre_hook(self._manual_pre_hook(o)) for o in opts
                                        if hasattr(o, "_optimizer_step_pre_hooks")]
        steps = samples = 0
        transfer = self._transfer_hooks or self.device.type != "cpu"
        logged = self.logged
        ov = self._overridden
        closure = _Closure(self, opts[0], k) if automatic else None
        context = self._forward_context
        mixed = self._autocast is not None
        # The submodules keep the train/eval modes the user gave them, as under lightning.Trainer
        # (>= 2.2), which does not call train() on the module before training (a frozen BatchNorm stays
        # frozen); evaluation restores every submodule's mode afterwards.
        try:
            m.on_train_epoch_start()
            logged.step_level = True
            for epoch, batch_idx, batch in batches:
                if transfer:
                    batch = self._transfer(batch)
                n = batch_size_of(batch)
                logged.current_batch_size = n
                shim.is_last_batch = steps + 1 == total
                if ov["on_train_batch_start"] and m.on_train_batch_start(batch, batch_idx) == -1:
                    break
                if closure is not None:
                    closure.batch, closure.batch_idx, closure.output = batch, batch_idx, None
                    if k == 1:
                        ends = True
                    else:
                        closure.zero = batch_idx % k == 0
                        ends = (batch_idx + 1) % k == 0 or batch_idx + 1 == per_epoch or steps + 1 == total
                    if ends:
                        self._automatic_step(opts[0], closure, round_idx, batch_idx, step_scheds)
                    else:
                        closure()
                    out = closure.output
                else:
                    self._dp_steps = 0
                    if mixed:
                        with context():
                            out = m.training_step(batch, batch_idx)
                    else:
                        out = m.training_step(batch, batch_idx)
                if ov["on_train_batch_end"]:
                    m.on_train_batch_end(_batch_outputs(out, automatic, k), batch, batch_idx)
                steps += 1
                samples += n
                if shim.should_stop:  # the module ended this client's local training
                    break
            logged.step_level = False
            m.on_train_epoch_end()
            self._record_end(steps_per_round, opts, scheds, expected)
        finally:
            self._close_client(handles)
        return ClientRun(steps=steps, samples=samples, lr=lr)

    def _open_client(self, round_idx: int, steps: int, batches: int, lr_factor: float,
                     before_optimizer_step: StepHook | None,
                     wrap_optimizer: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None,
                     ) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig], RoundEnd]:
        """A client's start: ``self.trainer`` placed, its optimizers built (and wrapped by the plugins)."""
        shim = self._shim
        self.set_client_shape(round_idx, steps, batches)
        shim.should_stop = False
        opts, scheds, expected = self.make_optimizers(steps, round_idx)
        if wrap_optimizer is not None:
            opts = [wrap_optimizer(o) for o in opts]
        shim.optimizers = opts
        shim.lr_scheduler_configs = scheds
        shim.strategy.reset_optimizers()
        self._before_step = before_optimizer_step
        self._lr_factor = lr_factor
        shim.training = True
        return opts, scheds, expected

    def _automatic_step(self, opt: torch.optim.Optimizer, closure: _Closure, round_idx: int, batch_idx: int,
                        step_scheds: list[LRSchedulerConfig]) -> None:
        """One optimizer step of automatic optimization (through the module's ``optimizer_step`` when it
        overrides it), then ``global_step`` and the step-interval schedulers."""
        m, shim = self.inner, self._shim
        if self._overridden["optimizer_step"]:
            m.optimizer_step(round_idx, batch_idx, shim.strategy._lightning_optimizers[0], closure)
        else:
            self._optimizer_step(opt, closure)
        shim.global_step += 1  # (Lightning counts the step once optimizer_step returns)
        if step_scheds:
            g = shim.global_step
            custom = self._overridden["lr_scheduler_step"]
            for cfg in step_scheds:
                if g % cfg.frequency == 0:
                    _step_scheduler(m, cfg, None, custom)

    def _close_client(self, handles: list[Any]) -> None:
        """What a client's training leaves behind is cleared, also after a failure."""
        shim = self._shim
        for h in handles:
            h.remove()
        self.logged.step_level = False
        shim.training = False
        shim.is_last_batch = False
        shim.optimizers = []
        shim.lr_scheduler_configs = []
        shim.strategy.reset_optimizers()
        self._before_step = None
        self._lr_factor = 1.0

    def _modes(self) -> list[bool]:
        """Every submodule's train/eval mode (what Lightning's evaluation loop captures)."""
        if self._all_modules is None:
            self._all_modules = list(self.inner.modules())
        return [mod.training for mod in self._all_modules]

    def _restore_modes(self, modes: list[bool]) -> None:
        for mod, mode in zip(self._all_modules, modes):
            mod.training = mode

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], stage: str = "validation") -> dict[str, tuple[float, float, str]]:
        """Run ``validation_step`` (or ``test_step``) over ``batches`` at the current parameters, with
        Lightning's evaluation hooks around it; returns what ``self.log`` recorded, as sums for merging."""
        m = self.inner
        shim = self._shim
        step = m.validation_step if stage == "validation" else m.test_step
        flag = "validating" if stage == "validation" else "testing"
        modes = self._modes()
        setattr(shim, flag, True)
        context = self._forward_context
        try:
            if stage == "validation":  # as lightning.Trainer releases the gradients before validating in fit
                m.on_validation_model_zero_grad()
            if is_overridden(m, f"on_{stage}_model_eval"):
                getattr(m, f"on_{stage}_model_eval")()
            else:
                m.eval()
            self.logged.reset()
            getattr(m, f"on_{stage}_start")()
            getattr(m, f"on_{stage}_epoch_start")()
            for batch_idx, batch in enumerate(batches):
                batch = self._transfer(batch)
                self.logged.current_batch_size = batch_size_of(batch)
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
                self._restore_modes(modes)  # each submodule's own mode, as Lightning's _ModuleMode does
        return self.logged.results()


def step_loss(out: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned: a tensor, a dict with a ``"loss"`` tensor, or
    ``None`` (the step is skipped); anything else is refused, as ``lightning.Trainer`` refuses it."""
    mapping = isinstance(out, Mapping)
    loss = out.get("loss") if mapping else out
    if isinstance(loss, torch.Tensor) or (loss is None and not mapping):
        return loss
    what = "a dict without a 'loss' tensor" if mapping and loss is None else f"a {type(loss).__name__} as the loss"
    raise ConfigError("training_step", type(out).__name__, f"returned {what}",
                      "return the loss tensor, a dict with the loss tensor under 'loss', or None to skip the step")


def _batch_outputs(out: Any, automatic: bool, accumulate: int) -> dict[str, Any]:
    """What Lightning passes to ``on_train_batch_end``: a dict whose ``loss`` is detached (in automatic
    optimization divided by ``accumulate_grad_batches``, as the closure's result), ``{}`` for no loss."""
    if out is None:
        return {}
    extra = dict(out) if isinstance(out, Mapping) else {"loss": out}
    loss = extra.get("loss")
    if isinstance(loss, torch.Tensor):
        extra["loss"] = (loss / accumulate).detach().clone() if automatic else loss.detach()
    return extra


class _Closure:
    """``training_step`` + zero-grad + backward (one object per client; the loop sets ``batch`` and
    ``batch_idx`` before every step, and ``zero`` under gradient accumulation).

    Hooks the module does not override are Lightning's no-ops, and Lightning's default
    ``optimizer_zero_grad`` / ``backward`` are ``optimizer.zero_grad()`` / ``loss.backward()``:
    those are called directly (``zero_grad`` through :func:`optimizer_calls.zero_grad`), which
    saves ~10 us per step on small models."""

    def __init__(self, fm: FederatedLightningModule, opt: torch.optim.Optimizer, accumulate: int) -> None:
        self.fm = fm
        self.m, self.opt = fm.inner, opt
        self.batch: Batch = None
        self.batch_idx = 0
        self.round_idx = fm._shim.current_epoch
        self.zero = True
        self.accumulate = accumulate
        self.output: Any = None
        self.ov = fm._overridden
        self.scaler = fm._scaler
        self.mixed = fm._autocast is not None

    def __call__(self) -> torch.Tensor | None:
        return _with_grad(self._run)

    def _run(self) -> torch.Tensor | None:
        m, opt, ov = self.m, self.opt, self.ov
        if self.mixed:
            with self.fm._forward_context():
                out = m.training_step(self.batch, self.batch_idx)
        else:
            out = m.training_step(self.batch, self.batch_idx)
        self.output = out
        # a loss tensor, a dict with "loss", or None (the type check first: an ABC isinstance costs ~2 us)
        loss = out if type(out) is torch.Tensor else step_loss(out)
        if loss is not None and self.accumulate > 1:
            loss = loss / self.accumulate
        if self.zero:
            if ov["on_before_zero_grad"]:
                m.on_before_zero_grad(opt)
            if ov["optimizer_zero_grad"]:
                m.optimizer_zero_grad(self.round_idx, self.batch_idx, opt)
            else:
                optimizer_calls.zero_grad(opt)
        if loss is not None:
            scaled = self.scaler.scale(loss) if self.scaler is not None else loss
            if ov["on_before_backward"]:
                m.on_before_backward(scaled)
            if ov["backward"]:
                m.backward(scaled)
            else:
                scaled.backward()
            if ov["on_after_backward"]:
                m.on_after_backward()
        return loss
