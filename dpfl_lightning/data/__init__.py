"""Federated data: :class:`FederatedDataModule`, partitioners, built-in sources that need no
download (:class:`Digits` from scikit-learn, paper 001's :class:`SyntheticLogistic`, paper 003's
:class:`QuadraticClients`, paper 002's :class:`SyntheticLinearRegression`) and loaders for files already on disk (:class:`NpzFile`, MNIST /
Fashion-MNIST IDX files, CIFAR-10 python batches).

May import: ``module`` (what a LightningDataModule is), ``federated``, the foundation (``errors``,
``rng``, ``problems``). Plugins, executors and the run read data; data never reads them.
"""

from dpfl_lightning.data.digits import Digits
from dpfl_lightning.data.files import NpzFile
from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.data.partition import PARTITIONS, partition
from dpfl_lightning.data.synthetic import (QuadraticClients, SyntheticLinearRegression, SyntheticLogistic,
                                          linear_regression_problem, linear_regression_target, quadratic_problem,
                                          synthetic_logistic)
from dpfl_lightning.data.vision import CIFAR10, MNIST, FashionMNIST

__all__ = [
    "CIFAR10",
    "MNIST",
    "PARTITIONS",
    "FashionMNIST",
    "Digits",
    "FederatedDataModule",
    "NpzFile",
    "QuadraticClients",
    "SyntheticLinearRegression",
    "SyntheticLogistic",
    "linear_regression_problem",
    "linear_regression_target",
    "partition",
    "quadratic_problem",
    "synthetic_logistic",
]
