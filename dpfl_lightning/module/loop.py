"""The local loop: one client's training, calling the module's own ``training_step`` and hooks in
Lightning's order, with no ``lightning.Trainer``.

Lightning's per-batch order (automatic optimization), which :meth:`ClientLoop.fit_client` follows:

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn

from dpfl_lightning.module import optimizer_calls
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.module.batches import Batch, batch_size_of, move_batch
from dpfl_lightning.module.introspect import STEP_HOOKS, TRANSFER_HOOKS, is_overridden, overridden
from dpfl_lightning.module.optimizers import optimizer_steps_per_round, step_scheduler_as_lightning
from dpfl_lightning.module.schedule import RoundEnd

StepHook = Callable[[torch.optim.Optimizer], None]
WrapOptimizer = Callable[[torch.optim.Optimizer], torch.optim.Optimizer]


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


@dataclass
class ClientRun:
    """What one client's local training did."""

    steps: int
    samples: int
    lr: float


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


def _with_grad(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with gradients enabled, as ``optimizer.step(closure)`` runs its closure
    (entering ``torch.enable_grad()`` when they already are, as in training, costs ~3 us a step)."""
    if torch.is_grad_enabled():
        return fn(*args)
    with torch.enable_grad():
        return fn(*args)


class ClientLoop:
    """One client's local training for ``fm`` (a :class:`~dpfl_lightning.module.FederatedLightningModule`):
    its optimizer steps (where ``LightningOptimizer.step`` and ``manual_backward`` land), precision,
    gradient clipping and batch transfer."""

    def __init__(self, fm: Any) -> None:
        self.fm = fm
        self.automatic = bool(getattr(fm.inner, "automatic_optimization", True))
        self.overridden = {h: False for h in STEP_HOOKS}
        self.transfer_fns: dict[str, Callable[..., Batch]] = {}
        self.transfer_hooks = False
        self.scaler: Any = None
        self.autocast: tuple[str, torch.dtype] | None = None
        self._clip = False
        self._before_step: StepHook | None = None
        self._lr_factor = 1.0
        self._in_step = False

    def setup(self, m: nn.Module, datamodule: Any, settings: LoopSettings, device: torch.device) -> None:
        """Which of the module's (and the DataModule's) hooks run, gradient clipping and precision."""
        self.automatic = bool(getattr(m, "automatic_optimization", True))
        dm = datamodule
        self.transfer_fns = {h: (getattr(dm, h) if dm is not None and is_overridden(dm, h, "LightningDataModule")
                                 else getattr(m, h)) for h in TRANSFER_HOOKS}
        self.transfer_hooks = any(is_overridden(m, h) for h in TRANSFER_HOOKS) or (
            dm is not None and any(is_overridden(dm, h, "LightningDataModule") for h in TRANSFER_HOOKS))
        self.overridden = overridden(m, STEP_HOOKS)
        self._clip = self.automatic and (self.overridden["configure_gradient_clipping"]
                                         or bool(settings.gradient_clip_val))
        self.autocast = None
        self.scaler = None
        if settings.precision == "bf16-mixed":
            self.autocast = (device.type, torch.bfloat16)
        elif settings.precision == "16-mixed":
            self.autocast = (device.type, torch.float16)
            self.scaler = torch.amp.GradScaler(device.type)

    def forward_context(self) -> Any:
        """Autocast for ``bf16-mixed`` / ``16-mixed``, else nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast[0], dtype=self.autocast[1])

    def transfer(self, batch: Batch, dataloader_idx: int = 0) -> Batch:
        """The batch-transfer hooks (the DataModule's where it overrides them), or a plain move."""
        device = self.fm.device
        if not self.transfer_hooks:
            return batch if device.type == "cpu" else move_batch(batch, device)
        fns = self.transfer_fns
        batch = fns["on_before_batch_transfer"](batch, dataloader_idx)
        batch = fns["transfer_batch_to_device"](batch, device, dataloader_idx)
        return fns["on_after_batch_transfer"](batch, dataloader_idx)

    # ------------------------------------------------------------------ one optimizer step
    def _after_closure(self, optimizer: torch.optim.Optimizer) -> None:
        """What runs between the gradients and the parameter update (Lightning's order): the plugins'
        and the module's ``on_before_optimizer_step``, then gradient clipping."""
        if self._before_step is not None:
            self._before_step(optimizer)
        fm = self.fm
        m = fm.inner
        if self.overridden["on_before_optimizer_step"]:
            m.on_before_optimizer_step(optimizer)
        if self._clip:
            loop = fm.loop
            if self.overridden["configure_gradient_clipping"]:
                with optimizer_calls.gradient_clipping(optimizer):
                    m.configure_gradient_clipping(optimizer, gradient_clip_val=loop.gradient_clip_val,
                                                  gradient_clip_algorithm=loop.gradient_clip_algorithm)
            else:
                fm.trainer_shim.precision_plugin.clip_gradients(optimizer, loop.gradient_clip_val,
                                                                loop.gradient_clip_algorithm or "norm")

    def _closure_and_hooks(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any]) -> Any:
        out = closure()
        self._after_closure(optimizer)
        return out

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Every local optimizer step, automatic or manual (``LightningOptimizer.step`` lands here)."""
        factor = self._lr_factor
        saved = [g["lr"] for g in optimizer.param_groups] if factor != 1.0 else None

        def decay_lr() -> None:  # the client's lr decay applies to this step only
            if saved is not None:
                for g, lr in zip(optimizer.param_groups, saved):
                    g["lr"] = lr * factor

        self._in_step = True
        try:
            if self.scaler is not None:
                out = closure()
                self.scaler.unscale_(optimizer)
                self._after_closure(optimizer)
                if not self.automatic or out is not None:
                    decay_lr()
                    self.scaler.step(optimizer, **kwargs)
                    self.scaler.update()
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
            if not self.automatic:  # automatic optimization counts in the loop (also when a step is skipped)
                self.fm.trainer_shim.global_step += 1
            return out
        finally:
            self._in_step = False
            if saved is not None:
                for g, lr in zip(optimizer.param_groups, saved):
                    g["lr"] = lr

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``manual_backward``: scale (16-mixed), ``on_before_backward``, ``backward``, ``on_after_backward``."""
        m = self.fm.inner
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        m.on_before_backward(loss)
        m.backward(loss, *args, **kwargs)
        m.on_after_backward()
        return loss

    def _manual_pre_hooks(self, opts: list[torch.optim.Optimizer]) -> list[Any]:
        """Plugins' step hooks for raw optimizers stepped directly in manual optimization."""
        def pre_hook(optimizer: torch.optim.Optimizer) -> Callable[..., None]:
            def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                if not self._in_step:
                    self._after_closure(optimizer)
            return hook

        return [o.register_step_pre_hook(pre_hook(o)) for o in opts if hasattr(o, "_optimizer_step_pre_hooks")]

    # ------------------------------------------------------------------ one client
    def fit_client(self, batches: Iterable[tuple[int, int, Batch]], round_idx: int = 0, lr_factor: float = 1.0,
                   before_optimizer_step: StepHook | None = None, wrap_optimizer: WrapOptimizer | None = None,
                   batches_per_round: int | None = None, batches_per_epoch: int | None = None) -> ClientRun:
        """Train the module from its current parameters on one client's ``(epoch, batch_idx, batch)``
        stream (see :meth:`FederatedLightningModule.fit_client
        <dpfl_lightning.module.FederatedLightningModule.fit_client>`)."""
        fm = self.fm
        m, shim, logged, ov, automatic = fm.inner, fm.trainer_shim, fm.logged, self.overridden, self.automatic
        k = fm.loop.accumulate_grad_batches if automatic else 1
        total = batches_per_round or 0
        per_epoch = batches_per_epoch or total
        steps_per_round = optimizer_steps_per_round(total, per_epoch, k) if automatic else total
        opts, scheds, expected = self._open_client(round_idx, steps_per_round, total, lr_factor,
                                                   before_optimizer_step, wrap_optimizer)
        lr = float(opts[0].param_groups[0]["lr"]) * lr_factor
        step_scheds = [c for c in scheds if c.interval == "step" and not c.reduce_on_plateau] if automatic else []
        handles = [] if automatic else self._manual_pre_hooks(opts)
        starts = [] if automatic else optimizer_calls.batch_starts(opts)
        steps = samples = 0
        transfer = self.transfer_hooks or fm.device.type != "cpu"
        closure = _Closure(self, m, opts[0], k, shim.current_epoch) if automatic else None
        # The submodules keep the train/eval modes the user gave them, as under lightning.Trainer
        # (>= 2.2), which does not call train() on the module before training (a frozen BatchNorm stays
        # frozen); evaluation restores every submodule's mode afterwards.
        try:
            m.on_train_epoch_start()
            logged.step_level = True
            for epoch, batch_idx, batch in batches:
                if transfer:
                    batch = self.transfer(batch)
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
                    out = self._manual_training_step(m, batch, batch_idx, starts)
                if ov["on_train_batch_end"]:
                    m.on_train_batch_end(_batch_outputs(out, automatic, k), batch, batch_idx)
                steps += 1
                samples += n
                if shim.should_stop:  # the module ended this client's local training
                    break
            logged.step_level = False
            m.on_train_epoch_end()
            fm.schedules.record_end(steps_per_round, opts, scheds, expected)
        finally:
            self._close_client(handles)
        return ClientRun(steps=steps, samples=samples, lr=lr)

    def _open_client(self, round_idx: int, steps: int, batches: int, lr_factor: float,
                     before_optimizer_step: StepHook | None, wrap_optimizer: WrapOptimizer | None,
                     ) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig], RoundEnd]:
        """A client's start: ``self.trainer`` placed, its optimizers built (and wrapped by the plugins)."""
        fm = self.fm
        shim = fm.trainer_shim
        fm.schedules.set_client_shape(round_idx, steps, batches)
        shim.should_stop = False
        opts, scheds, expected = fm.schedules.make_optimizers(steps, round_idx)
        if wrap_optimizer is not None:
            opts = [wrap_optimizer(o) for o in opts]
        shim.optimizers = opts
        shim.lr_scheduler_configs = scheds
        shim.strategy.reset_optimizers()
        self._before_step = before_optimizer_step
        self._lr_factor = lr_factor
        shim.training = True
        return opts, scheds, expected

    def _manual_training_step(self, m: nn.Module, batch: Batch, batch_idx: int, starts: list[Any]) -> Any:
        """``training_step`` of manual optimization (the module steps its optimizers itself)."""
        for start in starts:  # the optimizers that count their steps per batch (optimizer_calls.batch_starts)
            start()
        if self.autocast is not None:
            with self.forward_context():
                return m.training_step(batch, batch_idx)
        return m.training_step(batch, batch_idx)

    def _automatic_step(self, opt: torch.optim.Optimizer, closure: _Closure, round_idx: int, batch_idx: int,
                        step_scheds: list[LRSchedulerConfig]) -> None:
        """One optimizer step of automatic optimization (through the module's ``optimizer_step`` when it
        overrides it), then ``global_step`` and the step-interval schedulers."""
        fm = self.fm
        m, shim = fm.inner, fm.trainer_shim
        if self.overridden["optimizer_step"]:
            m.optimizer_step(round_idx, batch_idx, shim.strategy.lightning_optimizers[0], closure)
        else:
            self.optimizer_step(opt, closure)
        shim.global_step += 1  # (Lightning counts the step once optimizer_step returns)
        if step_scheds:
            g = shim.global_step
            custom = self.overridden["lr_scheduler_step"]
            for cfg in step_scheds:
                if g % cfg.frequency == 0:
                    step_scheduler_as_lightning(m, cfg, None, custom)

    def _close_client(self, handles: list[Any]) -> None:
        """What a client's training leaves behind is cleared, also after a failure."""
        for h in handles:
            h.remove()
        self.fm.logged.step_level = False
        self.fm.trainer_shim.clear_client()
        self._before_step = None
        self._lr_factor = 1.0


class _Closure:
    """``training_step`` + zero-grad + backward (one object per client; the loop sets ``batch`` and
    ``batch_idx`` before every step, and ``zero`` under gradient accumulation).

    Hooks the module does not override are Lightning's no-ops, and Lightning's default
    ``optimizer_zero_grad`` / ``backward`` are ``optimizer.zero_grad()`` / ``loss.backward()``:
    those are called directly (``zero_grad`` through :func:`optimizer_calls.zero_grad`), which
    saves ~10 us per step on small models."""

    def __init__(self, loop: ClientLoop, m: nn.Module, opt: torch.optim.Optimizer, accumulate: int,
                 round_idx: int) -> None:
        self.loop = loop
        self.m, self.opt = m, opt
        self.batch: Batch = None
        self.batch_idx = 0
        self.round_idx = round_idx
        self.zero = True
        self.accumulate = accumulate
        self.output: Any = None
        self.ov = loop.overridden
        self.scaler = loop.scaler
        self.mixed = loop.autocast is not None

    def __call__(self) -> torch.Tensor | None:
        return _with_grad(self._run)

    def _run(self) -> torch.Tensor | None:
        m, opt, ov = self.m, self.opt, self.ov
        if self.mixed:
            with self.loop.forward_context():
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
