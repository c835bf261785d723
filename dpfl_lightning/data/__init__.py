"""Federated data: :class:`FederatedDataModule`, partitioners and built-in sources that need no
download (:class:`Digits` from scikit-learn, paper 001's :class:`SyntheticLogistic`, paper 003's
:class:`QuadraticClients`, and :class:`NpzFile` for arrays on disk)."""

from dpfl_lightning.data.digits import Digits
from dpfl_lightning.data.files import NpzFile
from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.data.partition import PARTITIONS, partition
from dpfl_lightning.data.synthetic import QuadraticClients, SyntheticLogistic, quadratic_problem, synthetic_logistic

__all__ = [
    "PARTITIONS",
    "Digits",
    "FederatedDataModule",
    "NpzFile",
    "QuadraticClients",
    "SyntheticLogistic",
    "partition",
    "quadratic_problem",
    "synthetic_logistic",
]
