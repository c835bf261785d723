"""Plugins: one per file, each a :class:`FederatedCallback`."""

from dpfl_lightning.contexts import ClientContext, ServerContext, SetupContext
from dpfl_lightning.payload import Aggregate, Segment
from dpfl_lightning.plugins.base import FederatedCallback
from dpfl_lightning.plugins.clipping import UpdateClipping
from dpfl_lightning.plugins.dpsgd import DPSGD
from dpfl_lightning.plugins.gaussian_noise import GaussianNoise
from dpfl_lightning.plugins.normalization import UpdateNormalization
from dpfl_lightning.plugins.privacy_ledger import PrivacyLedger
from dpfl_lightning.plugins.sensitivity import SensitivityBound
from dpfl_lightning.plugins.server_optimizer import ServerOptimizer

__all__ = [
    "Aggregate",
    "ClientContext",
    "DPSGD",
    "FederatedCallback",
    "GaussianNoise",
    "PrivacyLedger",
    "Segment",
    "SensitivityBound",
    "ServerContext",
    "ServerOptimizer",
    "SetupContext",
    "UpdateClipping",
    "UpdateNormalization",
]
