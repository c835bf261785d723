"""What the wrapped module sees as ``self.trainer`` while a run lasts: a stand-in for
``lightning.Trainer`` (:class:`TrainerShim`), its ``strategy`` (where ``LightningOptimizer.step`` and
``manual_backward`` land) and its ``precision_plugin`` (gradient clipping). What each attribute
means in a federated run is written down in :mod:`dpfl_lightning.lightning.semantics`."""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn

from dpfl_lightning.federated.public_sizes import withheld_error
from dpfl_lightning.module import optimizer_calls



def public_size_property(name: str, doc: str) -> property:
    """A shim attribute that follows the clients' sizes: read as set, but refused with
    :func:`withheld_error` where the run's sizes are not public (``sizes_withheld``)."""
    private = "_" + name

    def get(self) -> int:
        if self.sizes_withheld:
            raise withheld_error(name)
        return getattr(self, private)

    def put(self, value: int) -> None:
        setattr(self, private, value)

    return property(get, put, doc=f"{doc} (refused where they are not public).")

class ShimStrategy:
    """``self.trainer.strategy``: ``LightningOptimizer.step`` and ``manual_backward`` land in the
    client loop of ``fm`` (the :class:`~dpfl_lightning.module.FederatedLightningModule`)."""

    handles_gradient_accumulation = False

    def __init__(self, shim: TrainerShim, fm: Any) -> None:
        self.shim, self.fm = shim, fm
        self.wrapped: list[LightningOptimizer] | None = None

    @property
    def lightning_optimizers(self) -> list[LightningOptimizer]:
        """What ``self.optimizers()`` returns: the client's optimizers as ``LightningOptimizer``, built
        on first use (building one creates a class, ~10-40 us, which most clients never need)."""
        if self.wrapped is None:
            self.wrapped = []
            for o in self.shim.optimizers:
                lo = LightningOptimizer(o)
                lo._strategy = self  # how Lightning ties an optimizer to its strategy
                self.wrapped.append(lo)
        return self.wrapped

    _lightning_optimizers = lightning_optimizers  # the name LightningModule.optimizers() reads

    def reset_optimizers(self) -> None:
        self.wrapped = None

    @property
    def lightning_module(self) -> nn.Module:
        return self.fm.inner

    model = lightning_module

    @property
    def root_device(self) -> torch.device:
        return self.fm.device

    @property
    def is_global_zero(self) -> bool:
        return self.shim.is_global_zero

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        return self.fm.client_loop.optimizer_step(optimizer, closure, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.fm.client_loop.backward(closure_loss, *args, **kwargs)

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


class ShimPrecision:
    """``self.trainer.precision_plugin``: gradient clipping as Lightning's precision plugins do it
    (an optimizer may refuse it: :func:`dpfl_lightning.module.optimizer_calls.check_gradient_clipping`)."""

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: float | int = 0.0,
                       gradient_clip_algorithm: Any = "norm") -> None:
        if clip_val is None or clip_val <= 0:
            return
        optimizer_calls.check_gradient_clipping(optimizer, clip_val)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) == "value":
            torch.nn.utils.clip_grad_value_(params, clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, clip_val)


class TrainerShim:
    """``self.trainer`` of the wrapped module during a federated run (a stand-in for
    ``lightning.Trainer``; see :mod:`dpfl_lightning.lightning.semantics` for what each attribute means)."""

    def __init__(self, fm: Any) -> None:
        self.strategy = ShimStrategy(self, fm)
        self.precision_plugin = ShimPrecision()
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
        self._estimated_stepping_batches = 0
        self._num_training_batches = 0
        #: a DP run whose clients' batches per round follow their record counts: the two values above are
        #: refused (see :mod:`dpfl_lightning.federated.public_sizes`)
        self.sizes_withheld = False
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

    estimated_stepping_batches = public_size_property(
        "estimated_stepping_batches", "``rounds * S``: the optimizer steps of one client over the run")
    num_training_batches = public_size_property("num_training_batches", "The client's batches this round")

    def set_shape(self, estimated_stepping_batches: int, num_training_batches: int) -> None:
        self._estimated_stepping_batches = estimated_stepping_batches
        self._num_training_batches = num_training_batches

    def shape(self) -> tuple[int, int]:
        """``(estimated_stepping_batches, num_training_batches)`` as set (also where they are withheld)."""
        return self._estimated_stepping_batches, self._num_training_batches

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"self.trainer.{name} is not available in a federated run (there is no lightning.Trainer; "
                             "see dpfl_lightning.lightning.semantics for what self.trainer offers)")

    def clear_client(self) -> None:
        """What a client's training leaves behind, cleared (also after a failure)."""
        self.training = False
        self.is_last_batch = False
        self.optimizers = []
        self.lr_scheduler_configs = []
        self.strategy.reset_optimizers()
