"""Collects what the wrapped module records with ``self.log`` / ``self.log_dict``.

Values are kept as (weighted sum, weight) per name so that the sums of many clients, many batches
and many ranks combine into one mean per round. ``torchmetrics.Metric`` objects are kept by
reference and computed once at the end of the stage (then reset), as Lightning does.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch

try:  # torchmetrics is a dependency, but keep the import local to this module
    from torchmetrics import Metric
except ImportError:  # pragma: no cover
    Metric = ()  # type: ignore[assignment,misc]

_REDUCERS = ("mean", "sum", "max", "min")


def _no_distributed() -> bool:
    return False


def _reducer_name(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str):
        name = reduce_fx
    else:
        name = getattr(reduce_fx, "__name__", "mean")
    if name not in _REDUCERS:
        raise ValueError(f"self.log(reduce_fx={reduce_fx!r}) is not supported; use one of {_REDUCERS}")
    return name


class LoggedMetrics:
    """What ``self.log`` recorded since the last :meth:`reset`.

    ``batch_size`` is the weight of a value under the ``mean`` reducer; when the module does not
    pass it, the size of the batch being processed is used (set by the caller).
    """

    def __init__(self) -> None:
        self.current_batch_size = 1
        # Whether the hook logging now is per batch of training (training_step, batch hooks), where
        # Lightning's defaults are on_step=True, on_epoch=False; elsewhere on_step=False, on_epoch=True.
        self.step_level = False
        self.reset()

    def reset(self) -> None:
        for metric in getattr(self, "_metrics", {}).values():
            metric.reset()  # what was not computed is dropped, not carried into the next stage
        self._values: dict[str, list[tuple[Any, float]]] = {}
        self._reducers: dict[str, str] = {}
        self._metrics: dict[str, Any] = {}
        self._forks: dict[str, str] = {}  # "<name>_epoch" -> name

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Same signature as ``LightningModule.log``; distributed options are ignored (the trainer
        reduces across ranks itself)."""
        if logger is False:
            return
        on_step = self.step_level if on_step is None else on_step
        on_epoch = (not self.step_level) if on_epoch is None else on_epoch
        if not on_step and not on_epoch:
            raise ValueError(f"self.log({name!r}, on_step=False, on_epoch=False) records nothing (lightning.Trainer "
                             "refuses it too); set on_step or on_epoch")
        if on_step and on_epoch:  # Lightning forks the name: the epoch (here: round) value is also "<name>_epoch"
            self._forks[f"{name}_epoch"] = name
        if type(value) is torch.Tensor and reduce_fx == "mean" and name in self._values:  # the per-step fast path
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) needs a single-element tensor, got shape {tuple(value.shape)}")
            weight = float(batch_size if batch_size is not None else self.current_batch_size)
            if weight:
                self._values[name].append((value.detach(), weight))
            return
        if isinstance(value, Metric):
            # The trainer merges ranks itself; a torch.distributed sync inside compute() would wait
            # for ranks that are not evaluating.
            value.distributed_available_fn = _no_distributed
            self._metrics[name] = value
            return
        if isinstance(value, Mapping):
            raise ValueError(f"self.log({name!r}, ...) got a dict; use self.log_dict instead")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) needs a single-element tensor, got shape {tuple(value.shape)}")
            value = value.detach()
        elif not isinstance(value, numbers.Number):
            raise ValueError(f"self.log({name!r}, ...) got a {type(value).__name__}; log numbers, tensors or Metrics")
        self._reducers.setdefault(name, _reducer_name(reduce_fx))
        weight = float(batch_size if batch_size is not None else self.current_batch_size)
        if weight == 0:  # an empty batch (Poisson sampling) contributes nothing to a mean
            return
        self._values.setdefault(name, []).append((value, weight))

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)

    def results(self) -> dict[str, tuple[float, float, str]]:
        """``{name: (reduced value * weight, weight, reducer)}`` for merging; Metrics are computed
        and reset here."""
        out: dict[str, tuple[float, float, str]] = {}
        for name, entries in self._values.items():
            reducer = self._reducers[name]
            vals = _stack([v for v, _ in entries])
            weights = torch.tensor([w for _, w in entries], dtype=torch.float64)
            if reducer == "mean":
                out[name] = (float((vals * weights).sum()), float(weights.sum()), reducer)
            elif reducer == "sum":
                out[name] = (float(vals.sum()), 1.0, reducer)
            elif reducer == "max":
                out[name] = (float(vals.max()), 1.0, reducer)
            else:
                out[name] = (float(vals.min()), 1.0, reducer)
        for name, metric in self._metrics.items():
            value = metric.compute()
            metric.reset()
            weight = 1.0
            out[name] = (float(torch.as_tensor(value).double()), weight, "mean")
        for fork, name in self._forks.items():
            if name in out:
                out[fork] = out[name]
        self.reset()
        return out


def _stack(values: list[Any]) -> torch.Tensor:
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack([v.reshape(()) for v in values]).to("cpu", torch.float64)
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def merge(parts: list[dict[str, tuple[float, float, str]]]) -> dict[str, float]:
    """Combine :meth:`LoggedMetrics.results` of several clients or ranks into final values."""
    acc: dict[str, tuple[float, float, str]] = {}
    for part in parts:
        for name, (value, weight, reducer) in part.items():
            if name not in acc:
                acc[name] = (value, weight, reducer)
                continue
            v0, w0, _ = acc[name]
            if reducer in ("mean", "sum"):
                acc[name] = (v0 + value, w0 + weight, reducer)
            elif reducer == "max":
                acc[name] = (max(v0, value), 1.0, reducer)
            else:
                acc[name] = (min(v0, value), 1.0, reducer)
    return {name: (v / w if r == "mean" and w > 0 else v) for name, (v, w, r) in acc.items()}
