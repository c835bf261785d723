"""MNIST / Fashion-MNIST / CIFAR-10 loaders, on tiny files written in tmp_path."""

import gzip
import os
import pickle

import numpy as np
import pytest
import torch

from dpfl_lightning import FederatedTrainer
from dpfl_lightning.data.vision import CIFAR10, MNIST, FashionMNIST
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.models import MLPClassifier

N_TRAIN, N_TEST = 20, 8


def _idx(arr: np.ndarray, magic: int) -> bytes:
    header = np.array([magic, *arr.shape], dtype=">i4").tobytes()
    return header + np.ascontiguousarray(arr, dtype=np.uint8).tobytes()


def _write(path: str, payload: bytes, gz: bool) -> None:
    if gz:
        with gzip.open(path + ".gz", "wb") as f:
            f.write(payload)
    else:
        with open(path, "wb") as f:
            f.write(payload)


def _mnist_arrays(seed=0):
    rng = np.random.default_rng(seed)
    xtr = rng.integers(0, 256, size=(N_TRAIN, 28, 28), dtype=np.uint8)
    xtr[0, 0, 0], xtr[1, 0, 0] = 0, 255
    xte = rng.integers(0, 256, size=(N_TEST, 28, 28), dtype=np.uint8)
    return xtr, np.arange(N_TRAIN, dtype=np.uint8) % 10, xte, (np.arange(N_TEST, dtype=np.uint8) * 3) % 10


def write_mnist(d, gz=False, arrays=None):
    os.makedirs(d, exist_ok=True)
    xtr, ytr, xte, yte = arrays or _mnist_arrays()
    for name, arr, magic in (("train-images-idx3-ubyte", xtr, 0x803), ("train-labels-idx1-ubyte", ytr, 0x801),
                             ("t10k-images-idx3-ubyte", xte, 0x803), ("t10k-labels-idx1-ubyte", yte, 0x801)):
        _write(os.path.join(d, name), _idx(arr, magic), gz)
    return xtr, ytr, xte, yte


@pytest.mark.parametrize("layout", ["plain", "gz", "torchvision"])
def test_mnist_round_trip(tmp_path, layout):
    if layout == "torchvision":  # torchvision keeps the .gz and the extracted files side by side
        d = tmp_path / "MNIST" / "raw"
        write_mnist(str(d), gz=True)
        xtr, ytr, xte, yte = write_mnist(str(d), gz=False)
    else:
        xtr, ytr, xte, yte = write_mnist(str(tmp_path), gz=layout == "gz")
    data = MNIST(str(tmp_path), num_clients=4)
    train, test, clients = data.load()
    assert clients is None
    x, y = train.tensors
    assert x.shape == (N_TRAIN, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    assert np.array_equal(np.rint(x.numpy() * 255).astype(np.uint8)[:, 0], xtr)
    assert np.array_equal(y.numpy(), ytr)
    xt, yt = test.tensors
    assert xt.shape == (N_TEST, 1, 28, 28)
    assert np.array_equal(np.rint(xt.numpy() * 255).astype(np.uint8)[:, 0], xte) and np.array_equal(yt.numpy(), yte)


def test_fashion_mnist_and_normalize(tmp_path):
    xtr, *_ = write_mnist(str(tmp_path / "FashionMNIST" / "raw"), gz=True)
    with pytest.raises(ConfigError, match="data.root"):  # variant="mnist" does not look in FashionMNIST/raw
        MNIST(str(tmp_path))
    plain = MNIST(str(tmp_path), variant="fashion", num_clients=2).load()[0].tensors[0]
    normed = FashionMNIST(str(tmp_path), num_clients=2, normalize=True).load()[0].tensors[0]
    assert torch.allclose(normed, (plain - 0.2860) / 0.3530, atol=1e-6)
    with pytest.raises(ConfigError, match="data.variant"):
        MNIST(str(tmp_path), variant="kmnist")


def test_mnist_partitions(tmp_path):
    write_mnist(str(tmp_path))
    d = MNIST(str(tmp_path), num_clients=4)
    d.setup()
    assert d.num_clients == 4 and [d.client_num_samples(c) for c in range(4)] == [5, 5, 5, 5]
    assert d.has_test_set and sum(x.shape[0] for x, _ in d.test_batches()) == N_TEST

    d = MNIST(str(tmp_path), num_clients=5, partition="shards", shards_per_client=2, seed=3)
    d.setup()
    labels = d._train_tensors[1].numpy()
    assert sum(d.client_num_samples(c) for c in range(5)) == N_TRAIN
    assert max(len(np.unique(labels[d._train_idx[c].numpy()])) for c in range(5)) <= 2

    d = MNIST(str(tmp_path), num_clients=3, partition="dirichlet", alpha=1.0)
    d.setup()
    assert sum(d.client_num_samples(c) for c in range(3)) == N_TRAIN

    d = MNIST(str(tmp_path), num_clients=2, client_test_fraction=0.2)
    d.setup()
    assert d.has_client_test_sets and d.client_num_samples(0) == 8


def test_mnist_missing_directory_and_files(tmp_path):
    with pytest.raises(ConfigError, match="data.root.*no such directory"):
        MNIST(str(tmp_path / "nowhere"))
    write_mnist(str(tmp_path), gz=True)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(ConfigError) as e:
        MNIST(str(tmp_path))
    msg = str(e.value)
    assert msg.startswith("data.root=") and "\n" not in msg
    assert "lacks t10k-labels-idx1-ubyte" in msg and os.path.join(str(tmp_path), "MNIST", "raw") in msg
    assert "download MNIST to" in msg and "train-images-idx3-ubyte[.gz]" in msg


def _corrupt(tmp_path, name, payload, gz=False):
    write_mnist(str(tmp_path), gz=gz)
    path = os.path.join(str(tmp_path), name + (".gz" if gz else ""))
    if gz:
        with open(path, "wb") as f:
            f.write(payload)
    else:
        _write(os.path.join(str(tmp_path), name), payload, gz=False)
    return MNIST(str(tmp_path), num_clients=2)


def test_mnist_bad_files(tmp_path):
    xtr, ytr, _, _ = _mnist_arrays()
    cases = {
        "wrong magic": ("train-images-idx3-ubyte", _idx(xtr[:, 0, :], 0x801), "magic number 0x00000801"),
        "truncated": ("train-images-idx3-ubyte", _idx(xtr, 0x803)[:-100], "is truncated"),
        "short header": ("train-labels-idx1-ubyte", b"\x00\x00", "is truncated"),
        "count mismatch": ("train-labels-idx1-ubyte", _idx(ytr[:-1], 0x801), "has 20 images but .* has 19 labels"),
        "bad label": ("t10k-labels-idx1-ubyte", _idx(np.full(N_TEST, 10, np.uint8), 0x801), "label 10"),
    }
    for i, (name, payload, match) in enumerate(cases.values()):
        d = tmp_path / str(i)
        data = _corrupt(d, name, payload)
        with pytest.raises(ConfigError, match="data.root") as e:
            data.setup()
        assert name in str(e.value)
        assert e.match(match)
    gz = gzip.compress(_idx(xtr, 0x803))
    for i, payload in enumerate([gz[: len(gz) // 2], b"not gzip at all"]):  # truncated / not a gzip file
        data = _corrupt(tmp_path / f"gz{i}", "train-images-idx3-ubyte", payload, gz=True)
        with pytest.raises(ConfigError, match="data.root.*train-images-idx3-ubyte.gz"):
            data.setup()


def test_mnist_fit_end_to_end(tmp_path):
    write_mnist(str(tmp_path / "data"), gz=True)
    trainer = FederatedTrainer(rounds=2, clients_per_round=2, batch_size=4, num_threads=1, enable_progress_bar=False,
                               enable_summary=False, log_dir=str(tmp_path / "runs"))
    trainer.fit(MLPClassifier(in_features=784, hidden=[8]), MNIST(str(tmp_path / "data"), num_clients=4))
    assert len(trainer.history) == 2


# ---------------------------------------------------------------------------------------- CIFAR-10
def write_cifar(d, per_batch=4, n_test=6, str_keys=False):
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(1)
    out = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        n = n_test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [(i + j) % 10 for j in range(n)]
        key = (lambda k: k) if str_keys else (lambda k: k.encode())
        with open(os.path.join(d, name), "wb") as f:
            pickle.dump({key("batch_label"): b"x", key("data"): data, key("labels"): labels}, f)
        out[name] = (data, labels)
    return out


@pytest.mark.parametrize("sub", ["", "cifar-10-batches-py"])
def test_cifar10_round_trip(tmp_path, sub):
    written = write_cifar(str(tmp_path / sub) if sub else str(tmp_path))
    data = CIFAR10(str(tmp_path), num_clients=2)
    train, test, _ = data.load()
    x, y = train.tensors
    assert x.shape == (20, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    raw = np.concatenate([written[f"data_batch_{k}"][0] for k in range(1, 6)])
    assert np.array_equal(np.rint(x.numpy() * 255).astype(np.uint8), raw.reshape(-1, 3, 32, 32))
    # channel-major: pixel (c, h, w) of image i is raw[i, c * 1024 + h * 32 + w]
    assert round(float(x[7, 2, 5, 9]) * 255) == raw[7, 2 * 1024 + 5 * 32 + 9]
    assert y.tolist() == sum((written[f"data_batch_{k}"][1] for k in range(1, 6)), [])
    assert test.tensors[0].shape == (6, 3, 32, 32) and test.tensors[1].tolist() == written["test_batch"][1]
    data.setup()
    assert data.client_num_samples(0) + data.client_num_samples(1) == 20


def test_cifar10_normalize_and_shards(tmp_path):
    write_cifar(str(tmp_path), str_keys=True)
    plain = CIFAR10(str(tmp_path), num_clients=2).load()[0].tensors[0]
    normed = CIFAR10(str(tmp_path), num_clients=2, normalize=True).load()[0].tensors[0]
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    assert torch.allclose(normed, (plain - mean) / std, atol=1e-5)
    d = CIFAR10(str(tmp_path), num_clients=5, partition="shards", shards_per_client=2)
    d.setup()
    labels = d._train_tensors[1].numpy()
    assert max(len(np.unique(labels[d._train_idx[c].numpy()])) for c in range(5)) <= 2


def test_cifar10_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="data.root.*no such directory"):
        CIFAR10(str(tmp_path / "nowhere"))
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"")
    with pytest.raises(ConfigError, match="data.root.*CIFAR-10 files not found.*tar xzf"):
        CIFAR10(str(tmp_path))
    d = tmp_path / "cifar-10-batches-py"
    write_cifar(str(d))
    os.remove(d / "data_batch_3")
    with pytest.raises(ConfigError, match="data.root.*lacks data_batch_3"):
        CIFAR10(str(tmp_path))

    cases = [
        (lambda b: b[: len(b) // 2], "unpickling failed"),  # truncated
        (lambda b: pickle.dumps([1, 2]), "not a dict"),
        (lambda b: pickle.dumps({b"data": np.zeros((4, 3072), np.uint8)}), "no 'data' and 'labels'"),
        (lambda b: pickle.dumps({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2]}),
         "4 images but 3 labels"),
        (lambda b: pickle.dumps({b"data": np.zeros((4, 1024), np.uint8), b"labels": [0] * 4}), "expected uint8"),
        (lambda b: pickle.dumps({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 11]}), "labels outside"),
    ]
    for i, (make, match) in enumerate(cases):
        root = tmp_path / f"c{i}"
        write_cifar(str(root))
        path = root / "data_batch_2"
        path.write_bytes(make(path.read_bytes()))
        data = CIFAR10(str(root), num_clients=2)
        with pytest.raises(ConfigError, match="data.root") as e:
            data.setup()
        assert str(path) in str(e.value) and e.match(match)
