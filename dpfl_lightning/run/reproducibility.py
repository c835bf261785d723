"""What makes a run reproducible from its configuration, whichever front door built it.

Everything random *inside* a run is keyed by ``(seed, round, client, purpose)``
(:mod:`dpfl_lightning.rng`). The one thing the trainer does not draw is the model's initial
weights: the user builds the model, from torch's global generator, before the trainer exists. As
with Lightning, seed that generator first::

    import lightning as L
    L.seed_everything(0)                       # what `dpfl fit` does with trainer.seed
    model = MyLitModel()
    FederatedTrainer(seed=0, ...).fit(model, data)

``dpfl fit`` calls ``lightning.seed_everything(trainer.seed)`` before it builds anything, so the
same configuration and seed give the same model in Python and on the command line. The trainer
never re-initialises a user's weights; :func:`warn_if_unseeded` says so when the generator was not
seeded with the run's seed. :func:`python_config` records what a Python run was built from (the
model's and the data module's classes and settings) the way the command line's YAML does.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Any

import torch

_PLAIN = (int, float, str, bool, type(None))


def warn_if_unseeded(seed: int) -> bool:
    """Warn (and return ``True``) when torch's global generator, from which a model's initial weights
    come, was not seeded with ``seed``: the model then differs from run to run and from ``dpfl fit``
    with the same configuration."""
    initial = torch.initial_seed()
    if initial == seed:
        return False
    warnings.warn(f"trainer.seed={seed}, but torch's global random generator, from which the model's initial "
                  f"weights come, was seeded with {initial}: this model differs from the one `dpfl fit` builds with "
                  f"the same configuration (and, unseeded, from run to run). Fix: call "
                  f"lightning.seed_everything({seed}) before building the model", UserWarning, stacklevel=3)
    return True


def class_path(cls: type) -> str:
    """The shortest import path of ``cls`` (``dpfl_lightning.data.Digits``, not ``...data.digits.Digits``)."""
    parts = cls.__module__.split(".")
    for i in range(1, len(parts) + 1):
        module = ".".join(parts[:i])
        try:
            if getattr(importlib.import_module(module), cls.__qualname__, None) is cls:
                return f"{module}.{cls.__qualname__}"
        except ImportError:  # pragma: no cover - a parent that cannot be imported on its own
            continue
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def init_args(obj: Any) -> dict[str, Any]:
    """The arguments of ``obj``'s constructor that it keeps as public attributes of the same name
    (plain values only; a wrapped LightningDataModule as its class path and hyperparameters)."""
    out: dict[str, Any] = {}
    for name, p in inspect.signature(type(obj).__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or not hasattr(obj, name):
            continue
        value = getattr(obj, name)
        if _plain(value):
            out[name] = list(value) if isinstance(value, tuple) else value
        elif hasattr(value, "hparams"):  # a LightningModule or LightningDataModule
            out[name] = {"class_path": class_path(type(value)), "init_args": dict(value.hparams)}
    return out


def python_config(trainer_hparams: dict[str, Any], model: Any, data: Any) -> dict[str, Any]:
    """The configuration of a run built in Python, laid out as the command line's YAML: ``trainer``,
    ``model`` (class path, saved hyperparameters) and ``data`` (class path, settings)."""
    return {"trainer": trainer_hparams,
            "model": {"class_path": class_path(type(model)), "init_args": dict(getattr(model, "hparams", {}) or {})},
            "data": {"class_path": class_path(type(data)), "init_args": init_args(data)}}
