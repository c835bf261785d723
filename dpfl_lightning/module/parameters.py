"""The flat parameter buffers: the wrapped module's parameters are views into ONE flat fp32 buffer
(``working``), and the global model lives in a second one (``global_params``). A client starts with
``working.copy_(global_params)`` and its update is ``working - global_params``: two vector
operations, no ``parameters_to_vector`` copies.

Also what the flat fp32 global model cannot hold, refused at set-up: no parameters, lazy ones,
non-fp32 ones, a parameter registered as a buffer, BatchNorm statistics that would be computed
from one client's data."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from dpfl_lightning.federated import frozen
from dpfl_lightning.errors import ConfigError

_STATS_WHY = ("BatchNorm running statistics are computed from each client's data in train mode and are not federated "
              "here, so evaluation would use their initial values")
_STATS_FIX = ("use GroupNorm or LayerNorm, or BatchNorm(track_running_stats=False); a pretrained BatchNorm kept in "
              "eval mode (.eval(), its statistics fixed) runs")


def _running_stats(m: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, mod) for n, mod in m.named_modules()
            if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats]


def _refuse_running_stats(name: str) -> Callable[..., None]:
    """A forward pre-hook on a BatchNorm whose statistics are fixed (eval mode): refuses, by name, the
    first forward in train mode, which would update them from one client's data."""
    def hook(module: nn.Module, args: Any) -> None:
        if module.training:
            raise ConfigError("model", name, f"was switched to train mode during training: {_STATS_WHY}", _STATS_FIX)
    return hook


def check_model(m: nn.Module, params: list[nn.Parameter]) -> None:
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


class FlatParameters:
    """The wrapped module's parameters laid over ``working``, and the global model ``global_params``."""

    def __init__(self) -> None:
        self.laid_out = False
        self.module: nn.Module | None = None
        self.params: list[nn.Parameter] = []
        self.slices: list[tuple[int, int]] = []  # (offset, size) of every parameter in the flat buffers
        self.working: torch.Tensor | None = None
        self.global_params: torch.Tensor | None = None
        self._buffers0: dict[str, torch.Tensor] = {}
        self._stats_hooks: list[Any] = []

    def lay_out(self, m: nn.Module, device: torch.device) -> None:
        """Check the model (already on ``device``), make its parameters views of one flat buffer,
        and take that as the global model; the buffers' values now are what every client starts from."""
        params = list(m.parameters())
        check_model(m, params)
        self._stats_hooks = [mod.register_forward_pre_hook(_refuse_running_stats(name or type(mod).__name__))
                             for name, mod in _running_stats(m)]  # each in eval mode (check_model)
        total = sum(p.numel() for p in params)
        self.working = torch.empty(total, dtype=torch.float32, device=device)
        offset = 0
        self.slices = []
        for p in params:
            n = p.numel()
            self.working[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.working[offset : offset + n].view_as(p)
            self.slices.append((offset, n))
            offset += n
        self.module, self.params = m, params
        self.laid_out = True
        self.global_params = self.working.clone()
        self._buffers0 = {k: b.detach().clone() for k, b in m.named_buffers()}

    def load_global(self) -> None:
        """Set the module's parameters to the global model and its buffers to their initial values.

        Buffers (e.g. BatchNorm running statistics) are computed from a client's data without noise,
        so they are never aggregated: each client starts from the initial buffers. Use GroupNorm or
        LayerNorm in private models.
        """
        if self.laid_out:
            self.working.copy_(self.global_params)
        else:  # after unlay the parameters have their own storage again
            with torch.no_grad():
                for p, (o, n) in zip(self.params, self.slices):
                    p.copy_(self.global_params[o : o + n].view_as(p))
        if self._buffers0:
            for k, b in self.module.named_buffers():
                if k in self._buffers0:
                    b.copy_(self._buffers0[k])

    def unlay(self) -> None:
        """The parameters at the global model, each in its own storage again (no longer views of the
        flat buffer); the BatchNorm checks removed."""
        for h in self._stats_hooks:
            h.remove()
        self._stats_hooks = []
        if self.laid_out:
            self.load_global()
            for p in self.params:
                p.data = p.data.clone()
            self.laid_out = False

    def trainable_mask(self) -> torch.Tensor:
        """A bool mask over the flat buffers: ``True`` where the parameter requires gradients now (a
        fresh tensor; see :func:`dpfl_lightning.federated.frozen.trainable_mask`)."""
        n = self.working.numel()
        mask = frozen.trainable_mask(self.params, self.slices, n, self.working.device)
        return torch.ones(n, dtype=torch.bool, device=self.working.device) if mask is None else mask
