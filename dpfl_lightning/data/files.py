"""Data from a ``.npz`` file on disk: arrays ``x_train``, ``y_train`` and optionally ``x_test``,
``y_test`` and ``client_train`` (the client id of each training row, for data already split by
client)."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import ConfigError


class NpzFile(FederatedDataModule):
    """Arrays from ``path``; partitioned like any dataset unless ``client_train`` is in the file."""

    def __init__(self, path: str, num_clients: int = 100, partition: str = "iid", alpha: float = 0.5,
                 shards_per_client: int = 2, iid_fraction: float = 0.0, client_test_fraction: float = 0.0,
                 seed: int = 0, eval_batch_size: int = 1024) -> None:
        if not os.path.isfile(path):
            raise ConfigError("data.path", path, "no such file", "point data.path at an existing .npz file")
        super().__init__(num_clients=num_clients, partition=partition, alpha=alpha, shards_per_client=shards_per_client,
                         iid_fraction=iid_fraction, client_test_fraction=client_test_fraction, seed=seed,
                         eval_batch_size=eval_batch_size)
        self.path = path

    def load(self):
        with np.load(self.path) as f:
            missing = [k for k in ("x_train", "y_train") if k not in f]
            if missing:
                raise ConfigError("data.path", self.path, f"the file has no array(s) {missing}",
                                  "save x_train and y_train (and optionally x_test, y_test, client_train)")
            train = TensorDataset(torch.from_numpy(f["x_train"]).float(), torch.from_numpy(f["y_train"]).long())
            test = None
            if "x_test" in f and "y_test" in f:
                test = TensorDataset(torch.from_numpy(f["x_test"]).float(), torch.from_numpy(f["y_test"]).long())
            clients = None
            if "client_train" in f:
                ids = f["client_train"]
                clients = [torch.from_numpy(np.flatnonzero(ids == c)) for c in np.unique(ids)]
        return train, test, clients
