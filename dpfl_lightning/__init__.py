"""dpfl_lightning: differentially private federated learning on ordinary Lightning modules.

The names below load on first use (PEP 562), so ``import dpfl_lightning`` (every rank, every sweep
job, ``dpfl --help``) does not import torch, Lightning, Opacus or the accountants before a run needs
them.
"""

from __future__ import annotations

import importlib
from typing import Any

from dpfl_lightning.errors import ConfigError, NonFiniteUpdateError

__version__ = "0.1.0"

_LAZY = {
    "FederatedDataModule": "dpfl_lightning.data.module",
    "FederatedLightningModule": "dpfl_lightning.module",
    "FederatedTrainer": "dpfl_lightning.trainer",
}

__all__ = ["ConfigError", "FederatedDataModule", "FederatedLightningModule", "FederatedTrainer",
           "NonFiniteUpdateError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dpfl_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
