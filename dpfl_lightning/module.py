"""FederatedLightningModule: the user's LightningModule, unchanged, trained as many clients.

The wrapped module's parameters are views into ONE flat fp32 buffer (``working``), and the global
model lives in a second flat buffer (``global_params``). A client starts with
``working.copy_(global_params)``, trains by calling the module's own ``training_step`` and hooks in
Lightning's order, and its update is ``working - global_params``: two vector operations, no
``parameters_to_vector`` copies and no ``lightning.Trainer`` per client.

Lightning's per-batch order (automatic optimization), which :meth:`fit_client` follows:

1. ``on_before_batch_transfer`` -> ``transfer_batch_to_device`` -> ``on_after_batch_transfer``
2. ``on_train_batch_start`` (returning ``-1`` ends the client's local training)
3. ``optimizer_step(epoch, batch_idx, optimizer, closure)``; the closure runs ``training_step``,
   ``on_before_zero_grad``, ``optimizer_zero_grad``, ``on_before_backward``, ``backward``,
   ``on_after_backward``, then the plugins' and the module's ``on_before_optimizer_step``
4. ``on_train_batch_end``; step-interval LR schedulers step.

With manual optimization the module's ``training_step`` drives its optimizers itself
(``self.optimizers()``, ``self.manual_backward``); plugin ``on_before_optimizer_step`` hooks run as
optimizer step pre-hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from dpfl_lightning.errors import ConfigError
from dpfl_lightning.logged_metrics import LoggedMetrics

Batch = Any
StepHook = Callable[[torch.optim.Optimizer], None]


def is_lightning_module(obj: Any) -> bool:
    """True for ``lightning.LightningModule`` and ``pytorch_lightning.LightningModule`` alike."""
    return isinstance(obj, nn.Module) and any(c.__name__ == "LightningModule" for c in type(obj).__mro__)


def _lightning_base(module: nn.Module) -> type:
    return next(c for c in type(module).__mro__ if c.__name__ == "LightningModule")


def is_overridden(module: nn.Module, name: str) -> bool:
    """True when the module's class defines ``name`` itself instead of inheriting Lightning's."""
    base = _lightning_base(module)
    return getattr(type(module), name, None) is not getattr(base, name, None)


def batch_size_of(batch: Batch) -> int:
    if type(batch) is tuple and batch and type(batch[0]) is torch.Tensor and batch[0].dim():
        return batch[0].shape[0]  # the common case, without recursion
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
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
               "optimizer_zero_grad", "on_before_backward", "backward", "on_after_backward", "on_before_optimizer_step")


@dataclass
class _Scheduler:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1


def parse_optimizers(conf: Any) -> tuple[list[torch.optim.Optimizer], list[_Scheduler]]:
    """Read what ``configure_optimizers`` returned (every form Lightning accepts)."""
    if conf is None:
        raise ConfigError("model.configure_optimizers", None, "returned no optimizer", "return a torch.optim.Optimizer")
    if isinstance(conf, torch.optim.Optimizer):
        return [conf], []
    if isinstance(conf, dict):
        conf = [conf]
    if isinstance(conf, (list, tuple)) and len(conf) == 2 and isinstance(conf[0], (list, tuple)):
        opts, scheds = list(conf[0]), list(conf[1]) if isinstance(conf[1], (list, tuple)) else [conf[1]]
        return opts, [_as_scheduler(s) for s in scheds]
    optimizers: list[torch.optim.Optimizer] = []
    schedulers: list[_Scheduler] = []
    for item in conf:
        if isinstance(item, torch.optim.Optimizer):
            optimizers.append(item)
        elif isinstance(item, dict) and "optimizer" in item:
            optimizers.append(item["optimizer"])
            if item.get("lr_scheduler") is not None:
                schedulers.append(_as_scheduler(item["lr_scheduler"]))
        else:
            raise ConfigError("model.configure_optimizers", type(item).__name__, "returned an unsupported value",
                              "return an Optimizer, a list of them, (optimizers, schedulers) or a dict")
    return optimizers, schedulers


def _as_scheduler(item: Any) -> _Scheduler:
    if isinstance(item, dict):
        return _Scheduler(item["scheduler"], item.get("interval", "epoch"), int(item.get("frequency", 1)))
    return _Scheduler(item)


class _FabricShim:
    """What the wrapped module reaches through ``self.fabric`` / ``self.trainer`` while we drive it.

    ``LightningModule.backward`` / ``manual_backward`` call ``fabric.backward`` and
    ``self.optimizers()`` reads ``_fabric_optimizers``; ``self.trainer.X`` resolves to these
    attributes, so ``self.trainer.current_epoch`` is the current round.
    """

    def __init__(self, logged: LoggedMetrics) -> None:
        self._logged = logged
        self.current_epoch = 0
        self.global_step = 0
        self.global_rank = 0
        self.local_rank = 0
        self.world_size = 1
        self.is_global_zero = True
        self.logger = None
        self.loggers: list[Any] = []
        self.device = torch.device("cpu")

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        tensor.backward(*args, **kwargs)

    def log_dict(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._logged.log_dict(metrics)

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        self._logged.log(name, value)


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
        self._shim = _FabricShim(self.logged)
        self._ready = False
        self.device = torch.device("cpu")

    # ------------------------------------------------------------------ set-up
    def setup(self, device: torch.device, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        """Move to ``device``, lay the parameters over one flat buffer and attach the shims."""
        m = self.inner
        m.to(device)
        self.device = device
        params = list(m.parameters())
        if not params:
            raise ConfigError("model", type(m).__name__, "has no parameters", "give the model trainable parameters")
        bad = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
        if bad:
            raise ConfigError("model", type(m).__name__, f"has parameters of dtype {', '.join(bad)}",
                              "use float32 parameters (call model.float()); the global model is one fp32 buffer")
        running = [n for n, mod in m.named_modules()
                   if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats]
        if running:
            raise ConfigError("model", running, "BatchNorm running statistics are computed from each client's data "
                              "and are not federated here, so evaluation would use their initial values",
                              "use GroupNorm or LayerNorm, or BatchNorm(track_running_stats=False)")
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
        self.global_params = self.working.clone()
        self._buffers0 = {k: b.detach().clone() for k, b in m.named_buffers()}

        shim = self._shim
        shim.global_rank, shim.world_size, shim.local_rank = rank, world_size, local_rank
        shim.is_global_zero = rank == 0
        shim.device = device
        m.fabric = shim  # LightningModule stores a weakref proxy; self._shim keeps it alive
        m.log = self.logged.log  # instance attributes shadow LightningModule.log / log_dict
        m.log_dict = self.logged.log_dict
        self._automatic = bool(getattr(m, "automatic_optimization", True))
        self._transfer_hooks = any(
            is_overridden(m, h) for h in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
        )
        self._overridden = {h: is_overridden(m, h) for h in _STEP_HOOKS}
        self._has_val = is_overridden(m, "validation_step")
        self._has_test = is_overridden(m, "test_step")
        self._ready = True

    def teardown(self) -> None:
        """Detach the shims; the wrapped module keeps the final global parameters."""
        m = self.inner
        self.load_global()
        for name in ("log", "log_dict"):
            m.__dict__.pop(name, None)
        m._fabric = None
        m._fabric_optimizers = []

    @property
    def num_parameters(self) -> int:
        return self.working.numel()

    @property
    def parameter_slices(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every parameter of the wrapped module in the flat buffers."""
        return list(self._slices)

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
        self.working.copy_(self.global_params)
        if self._buffers0:
            for k, b in self.inner.named_buffers():
                if k in self._buffers0:
                    b.copy_(self._buffers0[k])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped module's ``state_dict`` at the global parameters."""
        self.load_global()
        return self.inner.state_dict()

    # ------------------------------------------------------------------ local training
    def _transfer(self, batch: Batch) -> Batch:
        m = self.inner
        if not self._transfer_hooks:
            return batch if self.device.type == "cpu" else _move(batch, self.device)
        batch = m.on_before_batch_transfer(batch, 0)
        batch = m.transfer_batch_to_device(batch, self.device, 0)
        return m.on_after_batch_transfer(batch, 0)

    def make_optimizers(self, lr_factor: float = 1.0) -> tuple[list[torch.optim.Optimizer], list[_Scheduler]]:
        """Fresh local optimizers from ``configure_optimizers``, learning rates times ``lr_factor``."""
        opts, scheds = parse_optimizers(self.inner.configure_optimizers())
        if self._automatic and len(opts) != 1:
            raise ConfigError("model.configure_optimizers", f"{len(opts)} optimizers",
                              "automatic optimization trains with exactly one optimizer",
                              "return one optimizer or set self.automatic_optimization = False")
        if lr_factor != 1.0:
            for opt in opts:
                for group in opt.param_groups:
                    group["lr"] *= lr_factor
                    if "initial_lr" in group:
                        group["initial_lr"] *= lr_factor
            for s in scheds:
                if hasattr(s.scheduler, "base_lrs"):
                    s.scheduler.base_lrs = [b * lr_factor for b in s.scheduler.base_lrs]
        return opts, scheds

    def fit_client(
        self,
        batches: Iterable[tuple[int, int, Batch]],
        round_idx: int = 0,
        lr_factor: float = 1.0,
        before_optimizer_step: StepHook | None = None,
        wrap_optimizer: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
    ) -> ClientRun:
        """Train the module from its current parameters on one client's ``(epoch, batch_idx, batch)``
        stream. The caller loads the global model first and reads ``working`` afterwards.
        ``wrap_optimizer`` replaces each fresh local optimizer (e.g. by a DP-SGD optimizer)."""
        m = self.inner
        shim = self._shim
        shim.current_epoch = round_idx
        opts, scheds = self.make_optimizers(lr_factor)
        if wrap_optimizer is not None:
            opts = [wrap_optimizer(o) for o in opts]
        lr = float(opts[0].param_groups[0]["lr"])
        handles = []
        if not self._automatic:
            m._fabric_optimizers = opts
            for opt in opts:
                handles.append(opt.register_step_pre_hook(_pre_hook(before_optimizer_step, m)))
        steps = samples = 0
        epoch_now = None
        transfer = self._transfer_hooks or self.device.type != "cpu"
        logged = self.logged
        ov = self._overridden
        closure = _Closure(m, opts[0], before_optimizer_step, ov) if self._automatic else None
        try:
            for epoch, batch_idx, batch in batches:
                if epoch != epoch_now:
                    if epoch_now is not None and scheds:
                        _step_schedulers(scheds, "epoch", epoch_now + 1)
                    epoch_now = epoch
                if transfer:
                    batch = self._transfer(batch)
                n = batch_size_of(batch)
                logged.current_batch_size = n
                if ov["on_train_batch_start"] and m.on_train_batch_start(batch, batch_idx) == -1:
                    break
                if closure is not None:
                    closure.batch, closure.batch_idx, closure.epoch = batch, batch_idx, epoch
                    if ov["optimizer_step"]:
                        m.optimizer_step(epoch, batch_idx, opts[0], closure)
                    else:
                        opts[0].step(closure=closure)
                    out = closure.output
                else:
                    out = m.training_step(batch, batch_idx)
                if ov["on_train_batch_end"]:
                    m.on_train_batch_end(out, batch, batch_idx)
                steps += 1
                samples += n
                if scheds:
                    _step_schedulers(scheds, "step", steps)
            shim.global_step += steps
        finally:
            for h in handles:
                h.remove()
        return ClientRun(steps=steps, samples=samples, lr=lr)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch], stage: str = "validation") -> dict[str, tuple[float, float, str]]:
        """Run ``validation_step`` (or ``test_step``) over ``batches`` at the current parameters;
        returns what ``self.log`` recorded, as sums for merging."""
        m = self.inner
        step = m.validation_step if stage == "validation" else m.test_step
        was_training = m.training
        m.eval()
        getattr(m, f"on_{stage}_epoch_start")()
        self.logged.reset()
        for batch_idx, batch in enumerate(batches):
            batch = self._transfer(batch)
            self.logged.current_batch_size = batch_size_of(batch)
            getattr(m, f"on_{stage}_batch_start")(batch, batch_idx)
            out = step(batch, batch_idx)
            getattr(m, f"on_{stage}_batch_end")(out, batch, batch_idx)
        getattr(m, f"on_{stage}_epoch_end")()
        m.train(was_training)
        return self.logged.results()


class _Closure:
    """``training_step`` + zero-grad + backward, then the before-optimizer-step hooks (one object
    per client; the loop sets ``batch``, ``batch_idx`` and ``epoch`` before every step).

    Hooks the module does not override are Lightning's no-ops, and Lightning's default
    ``optimizer_zero_grad`` / ``backward`` are ``optimizer.zero_grad()`` / ``loss.backward()``:
    those are called directly, which saves ~10 us per step on small models."""

    def __init__(self, m: nn.Module, opt: torch.optim.Optimizer, before_step: StepHook | None,
                 overridden: dict[str, bool]) -> None:
        self.m, self.opt = m, opt
        self.batch: Batch = None
        self.batch_idx = self.epoch = 0
        self.before_step = before_step
        self.output: Any = None
        self.ov = overridden

    def __call__(self) -> torch.Tensor | None:
        m, opt, ov = self.m, self.opt, self.ov
        with torch.enable_grad():
            out = m.training_step(self.batch, self.batch_idx)
            self.output = out
            loss = out["loss"] if isinstance(out, dict) else out
            if ov["on_before_zero_grad"]:
                m.on_before_zero_grad(opt)
            if ov["optimizer_zero_grad"]:
                m.optimizer_zero_grad(self.epoch, self.batch_idx, opt)
            else:
                opt.zero_grad()
            if loss is not None:
                if ov["on_before_backward"]:
                    m.on_before_backward(loss)
                if ov["backward"]:
                    m.backward(loss)
                else:
                    loss.backward()
                if ov["on_after_backward"]:
                    m.on_after_backward()
        if self.before_step is not None:
            self.before_step(opt)
        if ov["on_before_optimizer_step"]:
            m.on_before_optimizer_step(opt)
        return loss


def _pre_hook(before_step: StepHook | None, m: nn.Module) -> Callable[..., None]:
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if before_step is not None:
            before_step(opt)
        m.on_before_optimizer_step(opt)

    return hook


def _step_schedulers(scheds: list[_Scheduler], interval: str, count: int) -> None:
    """Step the schedulers of ``interval`` after the ``count``-th step or epoch (1-based)."""
    for s in scheds:
        if s.interval == interval and count % max(s.frequency, 1) == 0:
            s.scheduler.step()

