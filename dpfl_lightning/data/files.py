"""Data from a ``.npz`` file on disk: arrays ``x_train``, ``y_train`` and optionally ``x_test``,
``y_test`` and ``client_train`` (the client id of each training row, for data already split by
client).

The file is read with ``allow_pickle=False``: a ``.npz`` holding object arrays (pickles, which can
run code when loaded) is refused, as is anything that is not a readable ``.npz`` archive of
numeric arrays. Every such problem is one :class:`~dpfl_lightning.errors.ConfigError` naming
``data.path``.
"""

from __future__ import annotations

import os
import warnings
import zipfile
import zlib

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import ConfigError, require

_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip archive (an empty one starts with its end record)
_NPY_MAGIC = b"\x93NUMPY"
_FIX = "point data.path at an .npz file written by numpy.savez or savez_compressed with numeric arrays"


def _why(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class NpzFile(FederatedDataModule):
    """Arrays from ``path``; partitioned like any dataset unless ``client_train`` is in the file.

    Args:
        path: the ``.npz`` file (``numpy.savez``): ``x_train``, ``y_train`` (integer labels
            ``0..num_classes-1``), optionally ``x_test``, ``y_test``, ``client_train``.
        num_classes: the number of classes, if known; labels outside ``0..num_classes-1`` are
            refused at set-up (the CLI also checks them against the model's ``num_classes``).

    The other arguments are :class:`~dpfl_lightning.data.FederatedDataModule`'s.
    """

    def __init__(self, path: str, num_clients: int = 100, partition: str = "iid", alpha: float = 0.5,
                 shards_per_client: int = 2, iid_fraction: float = 0.0, client_test_fraction: float = 0.0,
                 seed: int = 0, eval_batch_size: int = 1024, num_classes: int | None = None) -> None:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError("data.path", path, "no such file", "point data.path at an existing .npz file")
        require(num_classes is None or (isinstance(num_classes, int) and num_classes >= 1), "data.num_classes",
                num_classes, "must be a positive integer", "set the number of classes, or leave it unset")
        super().__init__(num_clients=num_clients, partition=partition, alpha=alpha, shards_per_client=shards_per_client,
                         iid_fraction=iid_fraction, client_test_fraction=client_test_fraction, seed=seed,
                         eval_batch_size=eval_batch_size)
        self.path = path
        self.num_classes = num_classes
        if num_classes is not None:
            self.expect_labels(num_classes, "data.num_classes")

    def _source_setting(self) -> tuple[str, str]:
        return "data.path", self.path

    def _error(self, problem: str, fix: str = _FIX) -> ConfigError:
        return ConfigError("data.path", self.path, problem, fix)

    def _read(self) -> dict[str, np.ndarray]:
        """Every array of the archive, read now (a truncated member fails here, not mid-training)."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(8)
        except OSError as e:
            raise self._error(f"cannot read the file ({_why(e)})") from e
        if head.startswith(_NPY_MAGIC):
            raise self._error("is a single .npy array, not an .npz archive of named arrays",
                              "save the arrays with numpy.savez(path, x_train=..., y_train=...)")
        if not head.startswith(_ZIP_MAGIC):
            what = "empty" if not head else "not an .npz archive (no zip header)"
            raise self._error(f"is {what}")
        try:
            with np.load(self.path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        except ValueError as e:
            if "pickle" in str(e).lower() or "object arrays" in str(e).lower():
                raise self._error("holds an object (pickled) array, which is never loaded from a data file",
                                  "save plain numeric arrays (numpy.savez with int/float arrays)") from e
            raise self._error(f"is not a valid .npz archive ({_why(e)})") from e
        except (OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError, RuntimeError) as e:
            raise self._error(f"is truncated or corrupt ({type(e).__name__}: {_why(e)})") from e

    def _labels(self, arrays: dict[str, np.ndarray], name: str, n: int) -> torch.Tensor:
        y = arrays[name]
        if y.ndim != 1 or len(y) != n:
            raise self._error(f"{name} has shape {list(y.shape)}, expected [{n}] (one label per row of "
                              f"x_{name[2:]})", "save one integer label per example")
        if y.dtype == np.bool_:
            y = y.astype(np.int64)
        if np.issubdtype(y.dtype, np.floating):
            if not np.all(np.isfinite(y)) or not np.all(y == np.round(y)):
                raise self._error(f"{name} holds non-integer labels ({y.dtype})", "save integer class labels")
            y = y.astype(np.int64)
        if not np.issubdtype(y.dtype, np.integer):
            raise self._error(f"{name} has dtype {y.dtype}, not integer labels", "save integer class labels")
        if y.size and int(y.min()) < 0:
            raise self._error(f"{name} has negative labels (min {int(y.min())})", "save labels 0..num_classes-1")
        return torch.from_numpy(y.astype(np.int64))

    def _features(self, arrays: dict[str, np.ndarray], name: str) -> torch.Tensor:
        x = arrays[name]
        if x.ndim < 1 or not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
            raise self._error(f"{name} has dtype {x.dtype} and shape {list(x.shape)}, not numeric features",
                              "save a numeric array with one row per example")
        return torch.from_numpy(np.ascontiguousarray(x)).float()

    def load(self):
        f = self._read()
        missing = [k for k in ("x_train", "y_train") if k not in f]
        if missing:
            raise self._error(f"the file has no array(s) {missing}",
                              "save x_train and y_train (and optionally x_test, y_test, client_train)")
        x = self._features(f, "x_train")
        train = TensorDataset(x, self._labels(f, "y_train", len(x)))
        test = None
        if "x_test" in f and "y_test" in f:
            xt = self._features(f, "x_test")
            test = TensorDataset(xt, self._labels(f, "y_test", len(xt)))
        clients = None
        if "client_train" in f:
            ids = f["client_train"]
            if ids.ndim != 1 or len(ids) != len(x) or not np.issubdtype(ids.dtype, np.integer):
                raise self._error(f"client_train has dtype {ids.dtype} and shape {list(ids.shape)}, expected "
                                  f"{len(x)} integer client ids", "save one integer client id per row of x_train")
            found = np.unique(ids)
            if not np.array_equal(found, np.arange(len(found))):  # ids with no rows: say how clients are numbered
                warnings.warn(f"data.path={self.path}: client_train holds {len(found)} distinct ids, not 0..{len(found) - 1}: "
                              f"the run's client i is the i-th smallest id ({found[0]} .. {found[-1]}; ids without a "
                              "row have no client)", UserWarning, stacklevel=2)
            clients = [torch.from_numpy(np.flatnonzero(ids == c)) for c in found]
        return train, test, clients
