"""``trainer.records_per_client``: the public number of records per client N. A local epoch is
ceil(N / B) batches for every client, whatever it holds; DP-SGD's batches sample every record with
probability B / N (Poisson) or B of max(n, N) slots (fixed); the data modules whose split gives every
client N records by construction declare it."""

from __future__ import annotations

import pytest
import torch

from dpfl_lightning import FederatedDataModule
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.privacy.guarantees import default_delta_for
from dpfl_lightning.rng import RECORD_SAMPLING, RandomSource
from helpers import TinyClassifier, quiet_trainer, tiny_data


def _data(sizes):
    n = sum(sizes)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    x = torch.randn(n, 10, generator=torch.Generator().manual_seed(0))
    return FederatedDataModule.from_tensors(x, torch.arange(n) % 10, x[:8], torch.arange(8) % 10,
                                            client_indices=[range(s, s + m) for s, m in zip(starts, sizes)])


def _batches(data, client, records, sampling="shuffle", epochs=1, steps=None, batch_size=4):
    stream = RandomSource(0).stream(0, client, RECORD_SAMPLING)
    return list(data.client_batches(client, batch_size, epochs=epochs, steps=steps, stream=stream, sampling=sampling,
                                    records=records))


def test_a_shuffled_epoch_is_the_public_records_batches():
    """A client of 5 records under N = 12, B = 4: an epoch is 3 batches, counted 0, 1, 2; its own
    passes (a batch of 4, then 1) repeat as needed."""
    data = _data([5, 12])
    out = _batches(data, 0, 12, epochs=2)
    assert [(e, b) for e, b, _ in out] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [len(batch[0]) for _, _, batch in out] == [4, 1, 4, 1, 4, 1]
    mine = {tuple(row.tolist()) for _, _, batch in _batches(data, 0, None) for row in batch[0]}
    assert len(mine) == 5 and {tuple(row.tolist()) for _, _, batch in out for row in batch[0]} == mine
    # without N, the client's own epoch: 2 batches a pass
    assert [(e, b) for e, b, _ in _batches(data, 0, None, epochs=2)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_dp_sgd_batches_sample_each_record_at_b_over_n(sampling):
    """A client of 3 records under N = 12, B = 4: each record is in a batch with probability 1/3 (mean
    batch 1 record), not in every batch as B / n = 4/3 would have it; a client of 20 > N records:
    Poisson still samples each at 1/3, fixed-size batches hold B = 4."""
    data = _data([3, 20])
    small = _batches(data, 0, 12, sampling=sampling, steps=3000)
    sizes = torch.tensor([len(batch[0]) for _, _, batch in small], dtype=torch.float64)
    assert sizes.max() <= 3 and 0.9 < float(sizes.mean()) < 1.1
    assert [(e, b) for e, b, _ in small[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    large = torch.tensor([len(batch[0]) for _, _, batch in _batches(data, 1, 12, sampling=sampling, steps=3000)],
                         dtype=torch.float64)
    if sampling == "poisson":
        assert 6.3 < float(large.mean()) < 7.0  # 20 / 3
    else:
        assert set(large.tolist()) == {4.0}
    assert set(torch.tensor([len(b[0]) for _, _, b in _batches(data, 0, None, sampling=sampling, steps=50)]).tolist()) \
        == {3}  # without N: B >= n, every record in every batch


@pytest.mark.parametrize("sampling", ["shuffle", "poisson", "fixed"])
def test_a_client_of_the_public_size_draws_the_batches_it_drew_without_it(sampling):
    """Where a client holds exactly N records, declaring N changes none of its batches."""
    data = _data([12, 7])
    with_n = _batches(data, 0, 12, sampling=sampling, epochs=2)
    without = _batches(data, 0, None, sampling=sampling, epochs=2)
    assert len(with_n) == len(without) == 6
    for (e1, b1, x1), (e2, b2, x2) in zip(with_n, without):
        assert (e1, b1) == (e2, b2) and torch.equal(x1[0], x2[0])


def test_every_client_takes_the_public_epochs_steps_and_sees_them(tmp_path):
    """Clients of 5, 12 and 20 records, N = 12, B = 4, two local epochs: every client takes 6 steps a
    round and sees ``num_training_batches`` 6 and ``estimated_stepping_batches`` rounds x 6."""
    class Counting(TinyClassifier):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_epoch_start(self):
            self.seen.append([self.trainer.num_training_batches, self.trainer.estimated_stepping_batches, 0])

        def training_step(self, batch, batch_idx):
            self.seen[-1][2] += 1
            return super().training_step(batch, batch_idx)

    model = Counting()
    quiet_trainer(str(tmp_path), rounds=2, local_epochs=2, records_per_client=12).fit(model, _data([5, 12, 20]))
    assert model.seen == [[6, 12, 6]] * 6


@pytest.mark.parametrize("value", [0, -3, 2.5, "12", True])
def test_a_bad_records_per_client_is_refused_with_the_setting(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^trainer\.records_per_client=.*must be an integer >= 1 or None"):
        quiet_trainer(str(tmp_path), records_per_client=value)


def test_data_modules_that_build_equal_clients_declare_their_size():
    assert tiny_data(num_clients=3, samples=12).public_records_per_client == 12
    held = tiny_data(num_clients=3, samples=12, client_test_fraction=0.3)
    held.setup()
    assert held.public_records_per_client == held.client_num_samples(0) == 9
    assert _data([5, 12]).public_records_per_client is None


def test_record_level_default_delta_follows_a_public_count_above_its_assumption():
    assert default_delta_for("record", 10) == 1e-6
    assert default_delta_for("record", 10, 12) == 1e-6
    assert default_delta_for("record", 10, 2 * 10 ** 6) == 1e-8


def test_vmap_trains_the_public_epoch_like_sequential(tmp_path):
    """Clients of 5, 12 and 20 records under N = 12: vmap takes the same 3 steps an epoch on the same
    batches as the sequential executor, and shows the same batch_idx."""
    class SeesBatches(TinyClassifier):
        def __init__(self):
            super().__init__()
            self.batch_indices = []

        def training_step(self, batch, batch_idx):
            self.batch_indices.append(int(batch_idx))
            return super().training_step(batch, batch_idx)

    out, seen = {}, {}
    for ex in ("sequential", "vmap"):
        model = SeesBatches()
        trainer = quiet_trainer(str(tmp_path / ex), rounds=2, local_epochs=2, records_per_client=12, executor=ex)
        out[ex] = trainer.fit(model, _data([5, 12, 20])).global_params.clone()
        seen[ex] = model.batch_indices
    assert torch.allclose(out["vmap"], out["sequential"], atol=1e-6)
    assert seen["sequential"] == [0, 1, 2] * 12  # 2 epochs of 3 batches, 3 clients, 2 rounds
    assert seen["vmap"][-36:] == seen["sequential"]  # (after vmap's set-up trial step)
