"""Randomness that cannot repeat: 128-bit keys that the generators really use.

torch's CPU ``manual_seed`` keeps 32 bits of a seed, so keyed streams used to collide after ~2^16
keys (the birthday bound); these tests fail on a generator seeded that way."""

import numpy as np
import pytest
import torch

from dpfl_lightning import rng
from dpfl_lightning.plugins import GaussianNoise, UpdateClipping
from helpers import Recorder, TinyClassifier, quiet_trainer, tiny_data


def test_1e5_keys_give_1e5_distinct_streams():
    src = rng.RandomSource(7)
    seen = set()
    for r in range(1000):
        for c in range(100):
            seen.add(src.stream(r, c, rng.CLIENT_NOISE).normal((16,), 1.0).numpy().tobytes())
    assert len(seen) == 100_000


def test_keys_differing_only_in_high_bits_give_different_streams():
    base = int.from_bytes(bytes(range(16)), "little")
    for bit in (32, 40, 63, 64, 100, 127):
        a = rng.torch_generator((base).to_bytes(16, "little"))
        b = rng.torch_generator((base ^ (1 << bit)).to_bytes(16, "little"))
        assert not torch.equal(torch.randn(16, generator=a), torch.randn(16, generator=b)), bit
    # and seeds that differ above bit 31 (torch's manual_seed would merge them)
    s1, s2 = rng.RandomSource(5), rng.RandomSource(5 + 2**32)
    assert not torch.equal(s1.stream(0, 0, rng.CLIENT_NOISE).normal((16,), 1.0),
                           s2.stream(0, 0, rng.CLIENT_NOISE).normal((16,), 1.0))


def test_streams_are_reproducible_and_purposes_differ():
    src = rng.RandomSource(3)
    a = src.stream(2, 5, rng.CLIENT_NOISE).normal((8,), 1.0)
    assert torch.equal(a, rng.RandomSource(3).stream(2, 5, rng.CLIENT_NOISE).normal((8,), 1.0))
    assert not torch.equal(a, src.stream(2, 5, rng.CENTRAL_NOISE).normal((8,), 1.0))
    assert not torch.equal(a, src.stream(2, 6, rng.CLIENT_NOISE).normal((8,), 1.0))


def test_the_reported_collision_has_no_repeated_noise_vector(log_dir):
    # seed 31385, 40 clients, full participation, local noise: client 8 in round 0 and client 23 in
    # round 3 used to receive the same noise vector
    after = Recorder(order=300)
    trainer = quiet_trainer(log_dir, rounds=4, seed=31385,
                            plugins=[UpdateClipping(1.0), GaussianNoise(noise_multiplier=1.0, placement="local"), after])
    trainer.fit(TinyClassifier(lr=0.0), tiny_data(num_clients=40))  # zero updates: what is sent is the noise
    sent = torch.stack(after.updates)
    assert sent.shape[0] == 160
    assert torch.unique(sent, dim=0).shape[0] == 160


def test_secure_streams_are_unit_normal_and_uniform():
    # 4e5 draws: the sample sd has relative standard error 1/sqrt(8e5) ~ 0.11%; allow 0.6%
    src = rng.RandomSource(0, rng.new_secret())
    x = src.stream(0, 0, rng.CLIENT_NOISE).normal((400_000,), 2.0, dtype=torch.float64)
    assert abs(x.std().item() / 2.0 - 1) < 0.006 and abs(x.mean().item()) < 5 * 2.0 / 632
    kurt = ((x / x.std()) ** 4).mean().item()  # a Gaussian's is 3 (s.e. ~ sqrt(24/n) = 0.008)
    assert abs(kurt - 3) < 0.05
    u = src.stream(0, 0, rng.SAMPLING).uniform(400_000)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 5 * 0.2887 / 632
    # distinct keys, distinct streams; the same key, the same stream within a run (every rank agrees)
    assert not torch.equal(src.stream(0, 1, rng.CLIENT_NOISE).uniform(8), src.stream(0, 2, rng.CLIENT_NOISE).uniform(8))
    assert torch.equal(src.stream(4, 1, rng.CLIENT_NOISE).uniform(8), src.stream(4, 1, rng.CLIENT_NOISE).uniform(8))


def test_secure_mode_draws_plugin_purposes_from_the_csprng():
    # Plugin streams (FedEXP's xi noise, adaptive clipping's count noise, PrivUnit) are mechanisms:
    # in secure mode they must be CSPRNG streams, not Mersenne Twister ones.
    secure = rng.RandomSource(5, rng.new_secret())
    for purpose in (rng.CLIENT_NOISE, rng.COIN, rng.PLUGIN, rng.PLUGIN + 20, rng.PLUGIN + 40):
        assert isinstance(secure.stream(0, 1, purpose), rng.SecureStream)
    assert not isinstance(secure.stream(0, 1, rng.DATA), rng.SecureStream)
    assert not isinstance(rng.RandomSource(5).stream(0, 1, rng.PLUGIN + 20), rng.SecureStream)


def test_tags_separate_streams_and_the_empty_tag_is_the_untagged_key():
    src = rng.RandomSource(3)
    assert src.key(1, 2, rng.CLIENT_NOISE, "") == rng.derive_key(3, 1, 2, rng.CLIENT_NOISE)
    keys = {src.key(1, 2, rng.CLIENT_NOISE, t) for t in ("", "update", "dc", "update,dc")}
    assert len(keys) == 4


def test_successive_draws_of_a_stream_never_repeat_whatever_the_device(monkeypatch):
    # A noise stream opened on one device and used on tensors of another (a CPU stream noising CUDA
    # parameters) must continue one sequence per device, not restart it for every tensor: the
    # generator of a device is keyed once, whatever spelling of the device asks for it.
    keyed = []
    original = rng.torch_generator

    def counting(key, device="cpu"):
        keyed.append(torch.device(device))
        return original(key, "cpu")  # a CPU generator stands in for the CUDA one

    monkeypatch.setattr(rng, "torch_generator", counting)
    stream = rng.RandomSource(2).stream(0, 3, rng.CLIENT_NOISE)
    cuda = stream.generator_on(torch.device("cuda", 0))
    assert stream.generator_on("cuda:0") is cuda and stream.generator_on(torch.device("cuda:0")) is cuda
    assert keyed == [torch.device("cpu"), torch.device("cuda", 0)]  # the stream's own, then cuda:0 once
    monkeypatch.setattr(rng, "torch_generator", original)
    stream = rng.RandomSource(2).stream(0, 3, rng.CLIENT_NOISE)
    a, b = torch.zeros(64), torch.zeros(64)
    stream.add_normal_(a, 1.0)
    stream.add_normal_(b, 1.0)
    assert not torch.equal(a, b)
    assert stream.generator_on("cpu") is stream.generator_on(torch.device("cpu"))
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        x, y = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")
        stream.add_normal_(x, 1.0)
        stream.add_normal_(y, 1.0)
        assert not torch.equal(x, y)


def test_local_training_randomness_is_keyed_by_round_and_client(log_dir):
    """torch's global generator, which dropout and torch.rand in training_step draw from, is set for
    every client from (seed, round, client) alone: whichever clients trained before it."""
    from dpfl_lightning.plugins.callback import FederatedCallback

    seen = {}

    class Current(FederatedCallback):
        def on_client_start(self, *, client):
            Draws.current = (client.round_idx, client.client)

    class Draws(TinyClassifier):
        current = None

        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                seen[Draws.current] = torch.rand(3)
            return super().training_step(batch, batch_idx)

    # 40 clients a round: more than one batch of prepared generator states
    quiet_trainer(log_dir, rounds=2, clients_per_round=40, seed=5, batch_size=12,
                  plugins=[Current()]).fit(Draws(), tiny_data(num_clients=45))
    assert len(seen) == 80
    src = rng.RandomSource(5)
    for (r, c), drawn in seen.items():
        src.seed_torch(r, c, torch.device("cpu"))
        assert torch.equal(torch.rand(3), drawn)
    assert len({d.numpy().tobytes() for d in seen.values()}) == 80


def test_prepared_generator_states_serve_only_their_round():
    src, fresh = rng.RandomSource(5), rng.RandomSource(5)
    src.prepare_torch(3, [5, 6])
    for r in (4, 3):  # another round first: computed on the spot, not the prepared state of round 3
        src.seed_torch(r, 5, torch.device("cpu"))
        got = torch.rand(4)
        fresh.seed_torch(r, 5, torch.device("cpu"))
        assert torch.equal(got, torch.rand(4))


@pytest.mark.parametrize("n", [0, 1, 50, 64, 65, 192, 193, 5000, 300_000])  # the last: past the 1 MiB blocks
def test_first_words_of_many_streams_are_each_streams_own_words(n):
    # the vectorised executor draws every client's shuffle words at once: across the doubling
    # block boundaries (64 words, then 128 more ...) they must be what each stream gives alone
    for source in (rng.RandomSource(seed=2**70 + 3), rng.RandomSource(seed=3, secret=b"s" * 16)):
        together = source.data_words(4, [0, 1, 999], n)
        alone = np.stack([source.stream(4, c, rng.DATA).words(n) for c in (0, 1, 999)])
        assert together.dtype == alone.dtype and np.array_equal(together, alone)


def test_plugin_purposes_are_registered_by_name_and_never_shared():
    from dpfl_lightning.plugins import adaptive_clipping, canary, fedexp, privunit_randomizer, scaffold

    # every built-in plugin's stream is listed in one place, with the number its keys always had
    built_in = {"FedEXP.xi_noise": 120, "PrivUnitRandomizer.privunit": 130, "AdaptiveClip.count_noise": 140,
                "SCAFFOLD.warm_cohorts": 150, "CanaryClients.canary": 170}
    assert {name: rng.PLUGIN_PURPOSES[name].number for name in built_in} == built_in
    assert (fedexp.XI_NOISE, privunit_randomizer.PRIVUNIT, adaptive_clipping.COUNT_NOISE, scaffold.WARM_COHORTS,
            canary.CANARY) == (120, 130, 140, 150, 170)
    # today's rule: the core's noise, cohorts, DP-SGD batches and coins and every plugin stream are private
    assert [n for n in range(1, 200) if rng.is_private(n)] == [1, 3, 4, 7, 8, 9, *range(100, 200)]
    mine = rng.register_purpose("TestRng.noise")
    assert mine == rng.register_purpose("TestRng.noise") and mine >= rng.PLUGIN and rng.is_private(mine)
    assert rng.PLUGIN_PURPOSES["TestRng.noise"].number == mine
    public = rng.register_purpose("TestRng.shuffle", private=False)
    assert public not in (mine, 120, 130, 140, 150, 170) and not rng.is_private(public)
    with pytest.raises(ValueError, match="'TestRng.noise' is registered as number .* private=True"):
        rng.register_purpose("TestRng.noise", private=False)
    with pytest.raises(ValueError, match="'Late.noise' and 'FedEXP.xi_noise' would share the stream purpose 120"):
        rng.register_purpose("Late.noise", number=120)
    # a secure stream keys torch's generator with purpose + 10_000: those numbers are taken too
    with pytest.raises(ValueError, match="'Late.noise' and 'TestRng.noise' would share the stream purpose"):
        rng.register_purpose("Late.noise", number=mine + 10_000)
    with pytest.raises(ValueError, match="'Late.noise' and 'rng.CLIENT_NOISE' would share"):
        rng.register_purpose("Late.noise", number=10_003)
    with pytest.raises(ValueError, match="below rng.PLUGIN=100"):
        rng.register_purpose("Late.noise", number=9)
    assert "Late.noise" not in rng.PLUGIN_PURPOSES
