"""MNIST, Fashion-MNIST and CIFAR-10 from files already on disk (nothing is downloaded).

- :class:`MNIST` (and :class:`FashionMNIST`): the four IDX files ``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each plain
  or gzip-compressed (``.gz``), in ``root`` or in torchvision's ``root/MNIST/raw`` (Fashion-MNIST:
  ``root/FashionMNIST/raw``). Images are float32 ``[N, 1, 28, 28]`` in [0, 1].
- :class:`CIFAR10`: the "python version" batches ``data_batch_1`` .. ``data_batch_5`` and
  ``test_batch``, in ``root`` or ``root/cifar-10-batches-py``. Images are float32
  ``[N, 3, 32, 32]`` in [0, 1]. The batches are pickles, so only point ``root`` at files you trust.

Labels are int64. ``normalize=True`` standardizes each channel with the dataset's usual mean and
std. Missing files are reported when the source is built; a file with a bad header, a truncated
file or a count mismatch when it is loaded (:meth:`setup`). Both name ``data.root`` and the file.
"""

from __future__ import annotations

import gzip
import os
import pickle
import zlib

import numpy as np
import torch
from torch.utils.data import TensorDataset

from dpfl_lightning.data.module import FederatedDataModule
from dpfl_lightning.errors import ConfigError, require

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR10_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch")

# variant -> (title, torchvision sub-directory, mean, std)
_MNIST_VARIANTS = {
    "mnist": ("MNIST", os.path.join("MNIST", "raw"), (0.1307,), (0.3081,)),
    "fashion": ("Fashion-MNIST", os.path.join("FashionMNIST", "raw"), (0.2860,), (0.3530,)),
}
_CIFAR10_MEAN, _CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
_IDX_IMAGES, _IDX_LABELS = 0x00000803, 0x00000801
_NUM_CLASSES = 10


# ---------------------------------------------------------------------------------------- helpers
def _check_root(root: str, title: str) -> None:
    if not os.path.isdir(root):
        raise ConfigError("data.root", root, "no such directory",
                          f"point data.root at the directory holding the {title} files (download them there first)")


def _find(root: str, subdir: str, names: tuple[str, ...], suffixes: tuple[str, ...], title: str,
          fix: str) -> dict[str, str]:
    """The first of ``root`` and ``root/subdir`` that holds every file of ``names`` (each with one of
    ``suffixes``); a ConfigError saying what is missing where, otherwise."""
    looked = [root, os.path.join(root, subdir)]
    best: tuple[int, str, list[str]] = (-1, root, list(names))
    for d in looked:
        found, missing = {}, []
        for name in names:
            path = next((p for p in (os.path.join(d, name + s) for s in suffixes) if os.path.isfile(p)), None)
            if path is None:
                missing.append(name)
            else:
                found[name] = path
        if not missing:
            return found
        if len(found) > best[0]:
            best = (len(found), d, missing)
    where = " or ".join(looked)
    problem = f"{title} files not found in {where}"
    if best[0] > 0:
        problem += f" ({best[1]} lacks {', '.join(best[2])})"
    raise ConfigError("data.root", root, problem, fix)


def _read(path: str, root: str) -> bytes:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:  # unreadable, not gzip, truncated gzip, corrupt gzip
        why = " ".join(str(e).split()) or "truncated"
        raise ConfigError("data.root", root, f"cannot read {path} ({type(e).__name__}: {why})",
                          "re-download the file") from e


def _parse_idx(data: bytes, path: str, root: str, images: bool) -> np.ndarray:
    """An IDX file of uint8 images ``[N, rows, cols]`` or labels ``[N]``, its header checked."""
    kind, magic, ndim = ("images", _IDX_IMAGES, 3) if images else ("labels", _IDX_LABELS, 1)
    header = 4 * (1 + ndim)
    fix = "re-download the file (and check it is the one named, not another file renamed)"
    if len(data) < header:
        raise ConfigError("data.root", root, f"{path} is truncated: {len(data)} bytes, shorter than an IDX {kind} header", fix)
    got = int.from_bytes(data[:4], "big")
    if got != magic:
        raise ConfigError("data.root", root, f"{path} is not an IDX {kind} file: magic number 0x{got:08x}, "
                          f"expected 0x{magic:08x}", fix)
    dims = [int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4)]
    if dims[0] < 1 or any(d < 1 for d in dims[1:]):
        raise ConfigError("data.root", root, f"{path} has a bad header: dimensions {dims}", fix)
    size = header + int(np.prod(dims))
    if len(data) != size:
        state = "truncated" if len(data) < size else "longer than its header says"
        raise ConfigError("data.root", root, f"{path} is {state}: {'x'.join(map(str, dims))} {kind} need {size} bytes, "
                          f"the file has {len(data)}", fix)
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _check_labels(labels: np.ndarray, path: str, root: str) -> None:
    if labels.size and int(labels.max()) >= _NUM_CLASSES:
        raise ConfigError("data.root", root, f"{path} has label {int(labels.max())}, expected 0..{_NUM_CLASSES - 1}",
                          "re-download the file")


def _images(x: np.ndarray, mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> torch.Tensor:
    """uint8 ``[N, C, H, W]`` -> float32 in [0, 1], standardized per channel if ``mean`` is given."""
    out = x.astype(np.float32)
    np.divide(out, 255.0, out=out)
    if mean is not None:
        shape = (1, len(mean), 1, 1)
        out -= np.asarray(mean, dtype=np.float32).reshape(shape)
        out /= np.asarray(std, dtype=np.float32).reshape(shape)
    return torch.from_numpy(out)


# ---------------------------------------------------------------------------------------- MNIST
class MNIST(FederatedDataModule):
    """MNIST (``variant="mnist"``) or Fashion-MNIST (``variant="fashion"``) from the IDX files in
    ``root`` (plain or ``.gz``; also torchvision's ``root/MNIST/raw`` or ``root/FashionMNIST/raw``):
    60k training images partitioned over clients, the 10k test images the global test set."""

    def __init__(self, root: str, num_clients: int = 100, partition: str = "iid", alpha: float = 0.5,
                 shards_per_client: int = 2, iid_fraction: float = 0.0, client_test_fraction: float = 0.0,
                 seed: int = 0, eval_batch_size: int = 1024, variant: str = "mnist", normalize: bool = False) -> None:
        require(variant in _MNIST_VARIANTS, "data.variant", variant, "unknown MNIST variant",
                f"use one of {', '.join(_MNIST_VARIANTS)}")
        root = os.fspath(root)
        title, subdir, _, _ = _MNIST_VARIANTS[variant]
        _check_root(root, title)
        self.files = _find(root, subdir, MNIST_FILES, ("", ".gz"), title,
                           f"download {title} to {root} first ({', '.join(n + '[.gz]' for n in MNIST_FILES)})")
        super().__init__(num_clients=num_clients, partition=partition, alpha=alpha, shards_per_client=shards_per_client,
                         iid_fraction=iid_fraction, client_test_fraction=client_test_fraction, seed=seed,
                         eval_batch_size=eval_batch_size)
        self.root = root
        self.variant = variant
        self.normalize = normalize

    def _source_setting(self) -> tuple[str, str]:
        return "data.root", self.root

    def _split(self, images: str, labels: str) -> tuple[np.ndarray, np.ndarray]:
        xp, yp = self.files[images], self.files[labels]
        x = _parse_idx(_read(xp, self.root), xp, self.root, images=True)
        y = _parse_idx(_read(yp, self.root), yp, self.root, images=False)
        if len(x) != len(y):
            raise ConfigError("data.root", self.root, f"{xp} has {len(x)} images but {yp} has {len(y)} labels",
                              "re-download both files")
        _check_labels(y, yp, self.root)
        return x, y

    def load(self):
        _, _, mean, std = _MNIST_VARIANTS[self.variant]
        xtr, ytr = self._split("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
        xte, yte = self._split("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
        if xtr.shape[1:] != xte.shape[1:]:
            raise ConfigError("data.root", self.root, f"training images are {xtr.shape[1]}x{xtr.shape[2]} but test images "
                              f"are {xte.shape[1]}x{xte.shape[2]}", "re-download the files")
        norm = (mean, std) if self.normalize else (None, None)
        return (TensorDataset(_images(xtr[:, None], *norm), torch.from_numpy(ytr.astype(np.int64))),
                TensorDataset(_images(xte[:, None], *norm), torch.from_numpy(yte.astype(np.int64))), None)


class FashionMNIST(MNIST):
    """Fashion-MNIST: :class:`MNIST` with ``variant="fashion"`` (same file names and format; also
    found in torchvision's ``root/FashionMNIST/raw``)."""

    def __init__(self, root: str, num_clients: int = 100, partition: str = "iid", alpha: float = 0.5,
                 shards_per_client: int = 2, iid_fraction: float = 0.0, client_test_fraction: float = 0.0,
                 seed: int = 0, eval_batch_size: int = 1024, normalize: bool = False) -> None:
        super().__init__(root, num_clients=num_clients, partition=partition, alpha=alpha,
                         shards_per_client=shards_per_client, iid_fraction=iid_fraction,
                         client_test_fraction=client_test_fraction, seed=seed, eval_batch_size=eval_batch_size,
                         variant="fashion", normalize=normalize)


# ---------------------------------------------------------------------------------------- CIFAR-10
class CIFAR10(FederatedDataModule):
    """CIFAR-10 from the "python version" batches in ``root`` or ``root/cifar-10-batches-py``
    (extracted ``cifar-10-python.tar.gz``): 50k training images partitioned over clients, the 10k
    of ``test_batch`` the global test set. The batches are pickles: load only files you trust."""

    def __init__(self, root: str, num_clients: int = 100, partition: str = "iid", alpha: float = 0.5,
                 shards_per_client: int = 2, iid_fraction: float = 0.0, client_test_fraction: float = 0.0,
                 seed: int = 0, eval_batch_size: int = 1024, normalize: bool = False) -> None:
        root = os.fspath(root)
        _check_root(root, "CIFAR-10")
        fix = f"download CIFAR-10 (python version) to {root} first ({', '.join(CIFAR10_FILES)})"
        archive = os.path.join(root, "cifar-10-python.tar.gz")
        if os.path.isfile(archive):
            fix = f"extract the archive first: tar xzf {archive} -C {root}"
        self.files = _find(root, "cifar-10-batches-py", CIFAR10_FILES, ("",), "CIFAR-10", fix)
        super().__init__(num_clients=num_clients, partition=partition, alpha=alpha, shards_per_client=shards_per_client,
                         iid_fraction=iid_fraction, client_test_fraction=client_test_fraction, seed=seed,
                         eval_batch_size=eval_batch_size)
        self.root = root
        self.normalize = normalize

    def _source_setting(self) -> tuple[str, str]:
        return "data.root", self.root

    def _batch(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        path, root = self.files[name], self.root
        fix = "re-download and extract cifar-10-python.tar.gz (the python version)"
        try:
            with open(path, "rb") as f:
                d = pickle.load(f, encoding="bytes")
        except Exception as e:  # truncated or not a pickle: EOFError, UnpicklingError, ValueError, ...
            raise ConfigError("data.root", root, f"{path} is not a CIFAR-10 batch (unpickling failed: "
                              f"{type(e).__name__})", fix) from e
        if not isinstance(d, dict):
            raise ConfigError("data.root", root, f"{path} is not a CIFAR-10 batch (holds a {type(d).__name__}, "
                              "not a dict)", fix)
        data = d.get(b"data", d.get("data"))
        labels = d.get(b"labels", d.get("labels"))
        if data is None or labels is None:
            raise ConfigError("data.root", root, f"{path} is not a CIFAR-10 batch (no 'data' and 'labels' entries)", fix)
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ConfigError("data.root", root, f"{path} holds {data.dtype} data of shape {list(data.shape)}, "
                              "expected uint8 [N, 3072]", fix)
        labels = np.asarray(labels, dtype=np.int64).reshape(-1)
        if len(labels) != len(data):
            raise ConfigError("data.root", root, f"{path} has {len(data)} images but {len(labels)} labels", fix)
        if labels.size and (labels.min() < 0 or labels.max() >= _NUM_CLASSES):
            raise ConfigError("data.root", root, f"{path} has labels outside 0..{_NUM_CLASSES - 1}", fix)
        return data, labels

    def load(self):
        train = [self._batch(n) for n in CIFAR10_FILES[:-1]]
        xte, yte = self._batch("test_batch")
        xtr = np.concatenate([x for x, _ in train])
        ytr = np.concatenate([y for _, y in train])
        norm = (_CIFAR10_MEAN, _CIFAR10_STD) if self.normalize else (None, None)
        return (TensorDataset(_images(xtr.reshape(-1, 3, 32, 32), *norm), torch.from_numpy(ytr)),
                TensorDataset(_images(xte.reshape(-1, 3, 32, 32), *norm), torch.from_numpy(yte)), None)
