"""scikit-learn's bundled handwritten digits (8x8 images, 1797 samples, 10 classes): no download."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import require


class Digits(FederatedDataModule):
    """``sklearn.datasets.load_digits`` as 64 features in [0, 1], split into train and test by
    ``test_fraction`` (stratified, seeded), the training part partitioned over clients."""

    def __init__(self, num_clients: int = 50, partition: str = "iid", alpha: float = 0.5, shards_per_client: int = 2,
                 iid_fraction: float = 0.0, test_fraction: float = 0.2, client_test_fraction: float = 0.0,
                 seed: int = 0, eval_batch_size: int = 1024) -> None:
        require(0.0 < test_fraction < 1.0, "data.test_fraction", test_fraction, "must be in (0, 1)", "set e.g. 0.2")
        super().__init__(num_clients=num_clients, partition=partition, alpha=alpha, shards_per_client=shards_per_client,
                         iid_fraction=iid_fraction, client_test_fraction=client_test_fraction, seed=seed,
                         eval_batch_size=eval_batch_size)
        self.test_fraction = test_fraction

    def load(self):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        xtr, xte, ytr, yte = train_test_split(x, y.astype(np.int64), test_size=self.test_fraction,
                                              random_state=self.seed, stratify=y)
        return (TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr)),
                TensorDataset(torch.from_numpy(xte), torch.from_numpy(yte)), None)
