"""FederatedCallback.on_client_released: what each client sent, after every plugin's on_client_end and
before the row is summed, read-only; in both executors."""

import pytest
import torch

from dpfl_lightning.federated.payload import Segment
from dpfl_lightning.plugins import FederatedCallback, GaussianNoise, UpdateClipping
from helpers import TinyClassifier, quiet_trainer, tiny_data

ROUNDS, COHORT = 2, 4


class Stamp(FederatedCallback):
    """Last on_client_end of all: writes client + 1 into its own segment."""

    order = 999

    def __init__(self, log):
        self.log = log

    def payload_segments(self, *, ctx):
        return [Segment("stamp", 1, "released", "Stamp")]

    def on_client_end(self, *, client):
        client.payload["stamp"].fill_(client.client + 1)
        self.log.append(("end", client.round_idx, client.client))


class Reader(FederatedCallback):
    """First plugin of all: records what each client released and the cohort's sums."""

    order = 0

    def __init__(self, log):
        self.log, self.released, self.sums = log, {}, {}

    def on_client_released(self, *, client, released):
        self.log.append(("released", client.round_idx, client.client))
        self.released.setdefault(client.round_idx, []).append({k: v.clone() for k, v in released.items()})

    def on_aggregate(self, *, server):
        self.sums[server.round_idx] = {k: server.aggregate[k].clone() for k in ("stamp", "update")}


class Writer(FederatedCallback):
    """Tries to change what is summed from on_client_released."""

    def __init__(self):
        self.refused = 0

    def on_client_released(self, *, client, released):
        released["update"].add_(1e3)
        client.payload["update"].mul_(-7.0)
        try:
            released["update"] = torch.zeros(1)
        except TypeError:
            self.refused += 1


def _fit(log_dir, executor, plugins):
    t = quiet_trainer(log_dir, rounds=ROUNDS, clients_per_round=COHORT, seed=0, executor=executor, plugins=plugins)
    torch.manual_seed(0)
    return t.fit(TinyClassifier(), tiny_data(num_clients=8)).global_params.clone()


@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_released_is_the_row_summed_after_every_on_client_end(log_dir, executor):
    log = []
    reader = Reader(log)
    _fit(log_dir, executor, [reader, Stamp(log), UpdateClipping(0.5),
                             GaussianNoise(noise_multiplier=0.5, placement="local")])
    for r in range(ROUNDS):
        ends = [e for e in log if e[1] == r and e[0] == "end"]
        seen = [e for e in log if e[1] == r and e[0] == "released"]
        assert len(ends) == len(seen) == COHORT  # once per client, each after that client's last on_client_end
        assert all(log.index(("end", r, c)) < log.index(("released", r, c)) for _, _, c in ends)
        rows = reader.released[r]
        stamps = sorted(int(row["stamp"].item()) for row in rows)
        assert stamps == sorted(c + 1 for _, _, c in ends)  # written by the order-999 plugin, seen by order 0
        assert float(reader.sums[r]["stamp"].item()) == sum(stamps)
        summed = torch.stack([row["update"] for row in rows]).sum(0)
        torch.testing.assert_close(reader.sums[r]["update"], summed.to(reader.sums[r]["update"]), rtol=0, atol=1e-5)
        assert max(float(row["update"].norm()) for row in rows) > 0.5  # the local noise is in the release


@pytest.mark.parametrize("executor", ["sequential", "vmap"])
def test_writing_to_the_release_is_refused_or_changes_nothing_summed(log_dir, executor):
    plain = _fit(log_dir, executor, [UpdateClipping(0.5)])
    writer = Writer()
    written = _fit(log_dir, executor, [UpdateClipping(0.5), writer])
    assert writer.refused == ROUNDS * COHORT  # assigning a segment raises
    assert torch.equal(written, plain)  # in-place writes went to copies
    moved = _fit(log_dir, executor, [])
    assert not torch.equal(moved, plain)  # (the clipping plugin does change the model: the check can fail)
