"""Partitioners and the built-in data sources."""

import warnings

import numpy as np
import pytest
import torch

from dpfl_lightning import ConfigError, FederatedDataModule
from dpfl_lightning.data import Digits, NpzFile, QuadraticClients, SyntheticLogistic, partition, quadratic_problem
from dpfl_lightning.rng import DATA, RandomSource

LABELS = np.repeat(np.arange(10), 100)  # 1000 samples, 100 per class


def _classes(parts):
    return [len(np.unique(LABELS[p.numpy()])) for p in parts]


def test_every_partition_covers_the_data_once():
    for scheme, kw in [("iid", {}), ("dirichlet", {"alpha": 0.3}), ("shards", {"shards_per_client": 2}),
                       ("label_sorted", {"iid_fraction": 0.1})]:
        parts = partition(LABELS, 20, scheme, seed=0, **kw)
        allidx = torch.cat(parts).sort().values
        assert torch.equal(allidx, torch.arange(1000)), scheme
        assert torch.equal(torch.cat(partition(LABELS, 20, scheme, seed=0, **kw)), torch.cat(parts))  # deterministic


def test_iid_sizes_and_mixture():
    parts = partition(LABELS, 20, "iid", seed=1)
    assert {len(p) for p in parts} == {50}
    assert min(_classes(parts)) >= 8


def test_shards_give_at_most_k_classes():
    for k in (1, 2, 5):
        parts = partition(LABELS, 20, "shards", seed=3, shards_per_client=k)
        assert max(_classes(parts)) <= k
        assert {len(p) for p in parts} == {1000 // 20}


def test_dirichlet_heterogeneity_grows_as_alpha_shrinks():
    def spread(alpha):
        parts = partition(LABELS, 10, "dirichlet", seed=0, alpha=alpha)
        hist = np.stack([np.bincount(LABELS[p.numpy()], minlength=10) / max(len(p), 1) for p in parts])
        return np.abs(hist - 0.1).sum(1).mean()  # mean total-variation distance from uniform (x2)

    assert spread(0.1) > spread(1.0) > spread(100.0)
    assert spread(100.0) < 0.15


def test_dirichlet_respects_min_samples():
    parts = partition(LABELS, 50, "dirichlet", seed=0, alpha=0.5, min_samples=5)
    assert min(len(p) for p in parts) >= 5


def test_label_sorted_gamma():
    parts = partition(LABELS, 10, "label_sorted", seed=0, iid_fraction=0.0)
    assert max(_classes(parts)) == 1  # 0% similar: each client one class here
    parts = partition(LABELS, 10, "label_sorted", seed=0, iid_fraction=1.0)
    assert min(_classes(parts)) >= 8


@pytest.mark.parametrize("scheme,kw,setting", [("nope", {}, "data.partition"), ("dirichlet", {"alpha": 0.0}, "data.alpha"),
                                               ("shards", {"shards_per_client": 0}, "data.shards_per_client"),
                                               ("label_sorted", {"iid_fraction": 1.5}, "data.iid_fraction")])
def test_bad_partition_settings(scheme, kw, setting):
    with pytest.raises(ConfigError, match=setting):
        partition(LABELS, 10, scheme, seed=0, **kw)


def test_more_clients_than_samples():
    with pytest.raises(ConfigError, match="data.num_clients"):
        partition(LABELS[:5], 10, "iid", seed=0)


def test_synthetic_logistic_shapes_and_heterogeneity():
    d = SyntheticLogistic(num_clients=8, samples_per_client=30, test_samples_per_client=10, dim=12, alpha=1, beta=1)
    d.setup()
    assert d.num_clients == 8 and d.client_num_samples(3) == 30
    x, y = d._train_tensors
    assert x.shape == (240, 12) and y.min() >= 0 and y.max() <= 9
    means = torch.stack([x[i * 30 : (i + 1) * 30].mean(0) for i in range(8)])
    d0 = SyntheticLogistic(num_clients=8, samples_per_client=30, dim=12, alpha=0, beta=0)
    d0.setup()
    x0 = d0._train_tensors[0]
    means0 = torch.stack([x0[i * 30 : (i + 1) * 30].mean(0) for i in range(8)])
    assert means.std(0).mean() > means0.std(0).mean()  # beta spreads the users' feature means


def test_quadratic_minimiser_has_zero_gradient():
    p = quadratic_problem(num_clients=10, dim=30, rank=5, seed=1)
    A, wi = p.A.double(), p.w_star_i.double()
    grad = torch.einsum("ndk,nek,ne->d", A, A, p.w_star.double().unsqueeze(0) - wi) / 10
    assert grad.abs().max() < 1e-4
    data = QuadraticClients(num_clients=10, dim=30, rank=5, seed=1)
    data.setup()
    assert data.num_clients == 10 and data.client_num_samples(0) == 1


def test_digits_bundled_and_partitioned():
    d = Digits(num_clients=30, partition="shards", shards_per_client=2)
    d.setup()
    x, y = d._train_tensors
    assert x.shape[1] == 64 and float(x.max()) <= 1.0
    assert d.has_test_set
    labels = y.numpy()
    assert max(len(np.unique(labels[d._train_idx[c].numpy()])) for c in range(30)) <= 2


def test_client_batches_epochs_steps_and_full_batch():
    d = FederatedDataModule.from_tensors(torch.arange(40.0).reshape(20, 2), torch.arange(20) % 2, num_clients=2)
    g = RandomSource(0).stream(0, 0, DATA)
    batches = list(d.client_batches(0, 3, epochs=2, stream=g))
    assert [b[0] for b in batches] == [0] * 4 + [1] * 4
    seen = torch.cat([b[2][1] for b in batches[:4]])
    assert len(seen) == 10
    assert len(list(d.client_batches(0, 3, steps=7, stream=g))) == 7
    full = list(d.client_batches(0, None, epochs=1, stream=g))
    assert len(full) == 1 and full[0][2][0].shape[0] == 10


def test_client_test_split():
    d = Digits(num_clients=10, client_test_fraction=0.25)
    d.setup()
    for c in range(10):
        tr, te = set(d._train_idx[c].tolist()), set(d._test_idx[c].tolist())
        assert tr and te and not tr & te


def test_npz_file(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x_train=np.random.rand(30, 4), y_train=np.arange(30) % 3, x_test=np.random.rand(6, 4),
             y_test=np.arange(6) % 3, client_train=np.arange(30) % 5)
    d = NpzFile(str(path))
    d.setup()
    assert d.num_clients == 5 and d.has_test_set
    with pytest.raises(ConfigError, match="data.path"):
        NpzFile(str(tmp_path / "missing.npz"))


def test_client_batches_keep_the_layout_of_the_stored_tensors():
    # a channels_last image tensor gives channels_last batches, as indexing it would (a contiguous
    # copy can change a convolution's gradients in the last bits)
    from dpfl_lightning import FederatedDataModule, rng

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, 4, 4, generator=g).to(memory_format=torch.channels_last)
    y = torch.randint(0, 3, (24,), generator=g)
    data = FederatedDataModule.from_tensors(x, y, client_indices=[range(0, 12), range(12, 24)])
    data.setup()
    stored = data.in_memory_tensors[0]
    assert stored.is_contiguous(memory_format=torch.channels_last)
    stream = rng.RandomSource(0).stream(0, 1, rng.DATA)
    for _, _, (xb, yb) in data.client_batches(1, 5, epochs=1, stream=stream):
        assert xb.stride() == stored.stride()  # channels_last: (48, 1, 12, 3)
        assert yb.is_contiguous()


def _nan_data():
    x = torch.randn(40, 6)
    x[8, 2] = float("nan")
    x[13, 0] = float("inf")
    return FederatedDataModule.from_tensors(x, torch.arange(40) % 3, num_clients=4, partition="iid")


def test_nan_records_are_reported_before_training_without_naming_them():
    data = _nan_data()
    with pytest.warns(UserWarning, match=r"2 training record\(s\) hold NaN or inf values") as caught:
        data.warn_nonfinite(private=False)
    message = str(caught[0].message)
    assert "client" not in message.split("hold")[0] and "row" not in message  # how many, not which
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.warn_nonfinite(private=False)  # once
        clean = FederatedDataModule.from_tensors(torch.randn(40, 6), torch.arange(40) % 3, num_clients=4,
                                                 partition="iid")
        clean.warn_nonfinite(private=False)


def test_a_dp_run_says_only_that_some_records_are_not_finite(log_dir):
    """The count would change with one client's data: a DP run says 'some', a run without DP counts."""
    from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
    from helpers import TinyClassifier, quiet_trainer

    for plugins, said in (([UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0)], "some training records hold"),
                          ([], "2 training record(s) hold")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_trainer(log_dir, rounds=1, on_nonfinite="skip", plugins=plugins).fit(
                TinyClassifier(in_features=6, num_classes=3), _nan_data())
        nan = [str(w.message) for w in caught if "NaN or inf" in str(w.message)]
        assert len(nan) == 1 and said in nan[0], nan
        assert plugins == [] or not any(ch.isdigit() for ch in nan[0].split("NaN")[0]), nan


def test_npz_client_ids_with_gaps_are_renumbered_and_said(tmp_path):
    path = tmp_path / "gaps.npz"
    ids = np.array([0, 3, 7] * 10)  # ids 1, 2, 4, 5, 6 hold no row
    np.savez(path, x_train=np.random.default_rng(0).normal(size=(30, 4)), y_train=np.arange(30) % 2, client_train=ids)
    data = NpzFile(str(path), num_clients=3)
    with pytest.warns(UserWarning, match=r"3 distinct ids, not 0..2: the run's client i is the i-th smallest id \(0 .. 7"):
        data.setup()
    assert data.num_clients == 3 and all(data.client_num_samples(c) == 10 for c in range(3))
