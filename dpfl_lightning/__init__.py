"""dpfl_lightning: differentially private federated learning on ordinary Lightning modules."""

from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import ConfigError, NonFiniteUpdateError
from dpfl_lightning.module import FederatedLightningModule
from dpfl_lightning.trainer import FederatedTrainer

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "FederatedDataModule",
    "FederatedLightningModule",
    "FederatedTrainer",
    "NonFiniteUpdateError",
    "__version__",
]
