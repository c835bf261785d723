"""dpfl_lightning: differentially private federated learning on ordinary Lightning modules.

The names below load on first use (PEP 562), so ``import dpfl_lightning`` (every rank, every sweep
job, ``dpfl --help``) does not import torch, Lightning, Opacus or the accountants before a run needs
them.
"""

from __future__ import annotations

from dpfl_lightning.errors import ConfigError, NonFiniteUpdateError, ReleaseWriteError
from dpfl_lightning.lazy import exports
from dpfl_lightning.moved import install as _install_moved_paths

__version__ = "0.1.0"

_LAZY = {
    "FederatedDataModule": "dpfl_lightning.data.module",
    "FederatedLightningModule": "dpfl_lightning.module",
    "FederatedTrainer": "dpfl_lightning.trainer",
}

__all__ = ["ConfigError", "FederatedDataModule", "FederatedLightningModule", "FederatedTrainer",
           "NonFiniteUpdateError", "ReleaseWriteError", "__version__"]

__getattr__, __dir__ = exports("dpfl_lightning", _LAZY, globals())
_install_moved_paths()  # old import paths of modules that moved into packages keep working, with a warning
