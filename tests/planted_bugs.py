"""Planted privacy bugs for testing ``dpfl audit`` itself: user plugins that declare the honest
mechanism (the ledger accounts exactly what the honest plugin would) and do less.

- :class:`HalfNoise`: central Gaussian noise of multiplier ``z`` declared, ``z / 2`` added;
- :class:`LooseClip`: a clip at ``C`` declared, at ``factor C`` applied (10 by default; 2 too);
- :class:`HalfSkippedClip`: a clip at ``C`` declared, skipped for clients with an even id;
- :class:`SizeWeightedClip`: a clip at ``C`` and uniform weights declared, the clipped update then
  weighted by ``n_i / mean n`` (size-weighted averaging the ledger does not account);
- :class:`QuarterLocalNoise`: local noise of multiplier ``z`` declared, ``z / 4`` added;
- :class:`HalfCoordinateNoise`: central noise declared on the whole update, added to its first half only;
- :class:`HalfCorrelatedNoise`: correlated noise (DP-FTRL) declared, each round's fresh rows drawn at half scale;
- :class:`HalfDiscreteNoise`: distributed discrete noise declared, each integer share at half its std.
"""

from dpfl_lightning import rng
from dpfl_lightning.federated import frozen
from dpfl_lightning.federated.payload import UPDATE
from dpfl_lightning.plugins import CorrelatedNoise, DiscreteDistributedNoise, GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.sensitivity import scale_to_norm_


class HalfNoise(GaussianNoise):
    """Declares ``GaussianNoise(noise_multiplier=z)`` (central) and adds half its standard deviation."""

    def on_aggregate(self, *, server) -> None:
        stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, rng.CENTRAL_NOISE)
        frozen.add_noise_(stream, server.aggregate[UPDATE], self.sigma / 2, server.plan.trainable)


class LooseClip(UpdateClipping):
    """Declares ``UpdateClipping(max_norm=C)`` and clips at ``factor C``."""

    def __init__(self, max_norm: float, factor: float = 10.0) -> None:
        super().__init__(max_norm=max_norm)
        self.factor = factor

    def on_client_end(self, *, client) -> None:
        scale_to_norm_([client.payload[s] for s in self.segments], self.factor * self.max_norm, True)


class HalfSkippedClip(UpdateClipping):
    """Declares ``UpdateClipping(max_norm=C)`` and skips the clip for clients with an even id."""

    def on_client_end(self, *, client) -> None:
        if client.client % 2:
            super().on_client_end(client=client)


class SizeWeightedClip(UpdateClipping):
    """Declares ``UpdateClipping(max_norm=C)`` (uniform weights: each client adds at most ``C``) and
    weights each clipped update by ``n_i / mean_j n_j`` over all clients, as size-weighted FedAvg
    would (the sum is still divided by the public denominator)."""

    def setup(self, *, ctx) -> None:
        super().setup(ctx=ctx)
        sizes = [ctx.data.client_num_samples(c) for c in range(ctx.data.num_clients)]
        self._mean = sum(sizes) / len(sizes)

    def on_client_end(self, *, client) -> None:
        super().on_client_end(client=client)
        for s in self.segments:
            client.payload[s].mul_(client.num_samples / self._mean)


class QuarterLocalNoise(GaussianNoise):
    """Declares ``GaussianNoise(noise_multiplier=z, placement="local")`` and adds a quarter of its
    standard deviation to each client's message."""

    def __init__(self, noise_multiplier: float = 1.0) -> None:
        super().__init__(noise_multiplier=noise_multiplier, placement="local")

    def on_client_end(self, *, client) -> None:
        stream = client.random.stream(client.round_idx, client.client, rng.CLIENT_NOISE)
        stream.add_normal_(client.payload[UPDATE], self.sigma / 4)


class HalfCoordinateNoise(GaussianNoise):
    """Declares central ``GaussianNoise(noise_multiplier=z)`` on the update and noises its first half
    only (the second half in the clear: epsilon infinite)."""

    def on_aggregate(self, *, server) -> None:
        stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, rng.CENTRAL_NOISE)
        update = server.aggregate[UPDATE]
        half = update.numel() // 2
        stream.add_normal_(update[:half], self.sigma)


class HalfCorrelatedNoise(CorrelatedNoise):
    """Declares ``CorrelatedNoise`` (the ledger accounts ``z`` and the strategy's sensitivity) and
    scales each round's fresh rows of ``Z`` by half of ``z sens C_t``."""

    def before_round(self, *, plan, server) -> None:
        super().before_round(plan=plan, server=server)
        self._round_scale /= 2


class HalfDiscreteNoise(DiscreteDistributedNoise):
    """Declares ``DiscreteDistributedNoise`` (accounted shares of variance ``sigma^2 / m``) and draws
    each share with a quarter of that variance (half the std; Skellam: a quarter of ``lam``)."""

    def settings(self):
        import dataclasses

        honest = super().settings()
        return dataclasses.replace(honest, noise_parameter=honest.noise_parameter / 4)
