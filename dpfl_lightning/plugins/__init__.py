"""Plugins: one per file, each a :class:`FederatedCallback`."""

from dpfl_lightning.contexts import ClientContext, ServerContext, SetupContext
from dpfl_lightning.payload import Aggregate, Segment
from dpfl_lightning.plugins.adaptive_clipping import AdaptiveClip
from dpfl_lightning.plugins.base import FederatedCallback
from dpfl_lightning.plugins.clipping import UpdateClipping
from dpfl_lightning.plugins.dpsgd import DPSGD
from dpfl_lightning.plugins.fedexp import FedEXP
from dpfl_lightning.plugins.gaussian_noise import GaussianNoise
from dpfl_lightning.plugins.normalization import UpdateNormalization
from dpfl_lightning.plugins.privacy_ledger import PrivacyLedger
from dpfl_lightning.plugins.privunit_randomizer import PrivUnitRandomizer
from dpfl_lightning.plugins.scaffnew import ScaffNew
from dpfl_lightning.plugins.scaffold import SCAFFOLD
from dpfl_lightning.plugins.sensitivity import SensitivityBound
from dpfl_lightning.plugins.server_optimizer import ServerOptimizer

__all__ = [
    "AdaptiveClip",
    "Aggregate",
    "FedEXP",
    "PrivUnitRandomizer",
    "SCAFFOLD",
    "ScaffNew",
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
