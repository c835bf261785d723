"""Under two ranks: DiscreteDistributedNoise's modular sum (masks, dropouts) is bit-identical to one
process; in secure mode each rank makes the SecAgg secrets of its own clients only, the ranks
exchange keys, shares and reveals, and every rank decodes the survivors' sum."""

import math
import os

import torch

from dpfl_lightning.federated.payload import UPDATE
from dpfl_lightning.plugins import DiscreteDistributedNoise, UpdateClipping
from dpfl_lightning.plugins.discrete_distributed_noise import SEGMENT
from helpers import TinyClassifier, quiet_trainer, record_client_secrets, tiny_data


def _fit(log_dir, communicator, mechanism):
    noise = DiscreteDistributedNoise(mechanism, noise_multiplier=0.5, bits=20, dropout=0.2, min_survivors=3)
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=7, communicator=communicator, seed=4,
                            plugins=[UpdateClipping(0.5), noise])
    return trainer, trainer.fit(TinyClassifier(), tiny_data(num_clients=15))


def test_discrete_noise_two_ranks_bit_identical_to_one(shared_tmp, comm):
    for mechanism in ("discrete_gaussian", "skellam"):
        two, m2 = _fit(os.path.join(shared_tmp, f"two-{mechanism}"), "auto", mechanism)
        assert two.world_size == 2
        one, m1 = _fit(os.path.join(shared_tmp, f"one-{mechanism}{comm.Get_rank()}"), "local", mechanism)
        assert torch.equal(m2.global_params, m1.global_params)
        assert [h["epsilon"] for h in two.history] == [h["epsilon"] for h in one.history]
        everyone = comm.allgather(m2.global_params.numpy().tobytes())
        assert everyone[0] == everyone[1]


class Recording(DiscreteDistributedNoise):
    """Records on this rank each client's clipped update (what the integer pipeline encodes), whether
    its row was sent (a dropped client's stays zero), and each round's decoded sum."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.trained, self.sums = {}, {}

    def on_client_end(self, *, client):
        clipped = client.payload[UPDATE].clone()
        super().on_client_end(client=client)
        self.trained[(client.round_idx, client.client)] = (clipped, bool(client.payload[SEGMENT].any()))

    def on_aggregate(self, *, server):
        super().on_aggregate(server=server)
        self.sums[server.round_idx] = server.aggregate.sums[UPDATE].clone()


def test_secure_secagg_on_two_ranks_keeps_secrets_on_their_rank_and_decodes_the_sum(shared_tmp, comm, monkeypatch):
    made = record_client_secrets(monkeypatch)
    noise = Recording(noise_multiplier=1e-3, bits=20, dropout=0.2, min_survivors=4)
    log_dir = os.path.join(shared_tmp, "secure")
    trainer = quiet_trainer(log_dir, rounds=3, clients_per_round=10, communicator="auto", seed=4, secure=True,
                            checkpoint_every=1, plugins=[UpdateClipping(0.5), noise])
    model = trainer.fit(TinyClassifier(), tiny_data(num_clients=15))
    assert trainer.world_size == 2
    # this rank made secrets for the clients it trained, and for no other
    assert sorted((s.round_idx, s.client) for s in made) == sorted(noise.trained)
    ranks = comm.allgather(noise.trained)
    assert ranks[0] and ranks[1] and set(ranks[0]).isdisjoint(ranks[1])
    trained = {**ranks[0], **ranks[1]}
    applied = [r for r in noise.sums if r not in noise.skipped_rounds]
    assert applied
    padded = 1 << (model.num_parameters - 1).bit_length()
    for r in applied:  # the decoded sum is the senders' clipped sum, up to rounding and the (small) noise
        sent = [u for (rr, _), (u, was_sent) in trained.items() if rr == r and was_sent]
        n, true = len(sent), torch.stack(sent).double().sum(0)
        # per coordinate of a client: rounding variance <= 1/4, noise variance s2 (grid units); 3x the rms
        tol = 3 * noise.gamma * math.sqrt(n * padded * (0.25 + noise.noise_parameter))
        assert (noise.sums[r].double() - true).norm() <= tol < true.norm() / 10
    models = comm.allgather(model.global_params.numpy().tobytes())
    assert models[0] == models[1]
    needles = [v for part in comm.allgather([(s.private_key, s.self_mask_seed) for s in made]) for pair in part
               for v in pair]
    needles += [v.hex().encode() for v in needles]
    if comm.Get_rank() == 0:
        files = [os.path.join(d, f) for d, _, fs in os.walk(log_dir) for f in fs]
        assert any(f.endswith(".ckpt") for f in files)
        for f in files:
            data = open(f, "rb").read()
            assert not [v for v in needles if v in data], f
