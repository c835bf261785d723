"""Sketches of the five kinds of plugin the next algorithms need, written against the public plugin
API only: a second vector with its own mechanism (SCAFFOLD's dc), a shared coin that changes the
local steps (ScaffNew), a squared-norm scalar with declared noise (CDP-FedEXP), a pure-epsilon local
randomizer (PrivUnit) and a noisy count that changes the clip norm of the next round (adaptive
clipping)."""

from __future__ import annotations

import math

import torch

from dpfl_lightning import rng
from dpfl_lightning.federated.payload import Segment
from dpfl_lightning.plugins import FederatedCallback, GaussianNoise, UpdateClipping
from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, ORDER_BOUND_SENSITIVITY, ORDER_LOCAL_TRAINING
from dpfl_lightning.privacy import privunit
from dpfl_lightning.privacy.mechanisms import Mechanism
from dpfl_lightning.federated.releases import MetricRelease
from helpers import TinyClassifier, quiet_trainer, tiny_data


class SecondVector(FederatedCallback):
    """Sends a second d-vector ``dc`` (a function of the local model: here the update itself, scaled),
    bounded jointly with the update by the clipping plugin and noised by its own Gaussian."""

    order = ORDER_LOCAL_TRAINING

    def __init__(self, std: float = 0.5):
        self.std = std
        self.sums: list[torch.Tensor] = []

    def payload_segments(self, *, ctx):
        return [Segment("dc", ctx.module.num_parameters if ctx.module else 1, "model", "SecondVector")]

    def setup(self, *, ctx):
        self._bound = ctx.norm_bound(("dc",), before=None)

    def privacy_mechanisms(self, *, ctx):
        return [Mechanism.gaussian("SecondVector", self.std, self._bound(), "central", ("dc",))]

    def on_client_end(self, *, client):
        if not client.skipped:
            client.payload["dc"].copy_(client.payload["update"]).mul_(0.5)

    def on_aggregate(self, *, server):
        stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, rng.PLUGIN + 1)
        stream.add_normal_(server.aggregate["dc"], self.std)
        self.sums.append(server.aggregate["dc"].clone())


class Coin(FederatedCallback):
    """ScaffNew's shared coin: this round's local steps are Geometric(p), the same for every client."""

    def __init__(self, p: float = 0.4):
        self.p = p
        self.steps: list[int] = []

    def before_round(self, *, plan, server):
        u = server.random.stream(plan.round_idx, rng.SERVER_CLIENT, rng.COIN).uniform(1).item()
        plan.local_steps = 1 + int(math.floor(math.log1p(-u) / math.log1p(-self.p)))
        plan.local_epochs = None
        self.steps.append(plan.local_steps)


class NormSquare(FederatedCallback):
    """CDP-FedEXP's ``sum ||D_i||^2``: a data scalar, bounded by C^2 after clipping, with central
    Gaussian noise ``xi`` declared as its own release."""

    order = ORDER_ADD_NOISE + 1

    def __init__(self, std: float = 2.0):
        self.std = std
        self.noisy: list[float] = []

    def payload_segments(self, *, ctx):
        return [Segment("norm_sq", 1, "data", "NormSquare")]

    def setup(self, *, ctx):
        self._bound = ctx.norm_bound(("update",), before=self)

    def privacy_mechanisms(self, *, ctx):
        return [Mechanism.gaussian("NormSquare", self.std, self._bound() ** 2, "central", ("norm_sq",))]

    def released_metrics(self, *, ctx):
        return [MetricRelease("noisy_norm_sq", "noised", "NormSquare")]

    def value_bound(self, *, segment, bound):
        return self._bound() ** 2 if segment == "norm_sq" else bound

    def on_client_end(self, *, client):
        # computed from the clipped update (before any noise), so bounded by C^2
        client.payload["norm_sq"].fill_(float(torch.linalg.vector_norm(client.payload["update"], dtype=torch.float64)) ** 2)

    def on_aggregate(self, *, server):
        stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, rng.PLUGIN + 2)
        stream.add_normal_(server.aggregate["norm_sq"], self.std)
        self.noisy.append(server.aggregate.scalar("norm_sq"))

    def on_round_end(self, *, server, metrics):
        metrics["noisy_norm_sq"] = self.noisy[-1]


class PrivUnitSketch(FederatedCallback):
    """A pure-epsilon local randomizer replacing the (clipped) update by PrivUnit's output."""

    order = ORDER_ADD_NOISE

    def __init__(self, eps: float = 2.0, C: float = 1.0):
        self.eps, self.C = eps, C

    def setup(self, *, ctx):
        self.consts = privunit.privunit_constants(ctx.module.num_parameters, self.eps, self.eps, self.eps, self.C) \
            if ctx.module is not None else None

    def privacy_mechanisms(self, *, ctx):
        return [Mechanism.pure("PrivUnitSketch", 3 * self.eps, ("update",), self.C)]

    def on_client_end(self, *, client):
        g = client.random.generator(client.round_idx, client.client, rng.PLUGIN + 3)
        u = client.payload["update"]
        u.copy_(privunit.privatize(u.double(), self.consts, g).c.to(u.dtype))


class AdaptiveClip(FederatedCallback):
    """Adaptive clipping's count: each client sends ``1[||u|| <= C]``; the sum gets central Gaussian
    noise (sensitivity 1); the next round's clip norm follows ``C <- C exp(-eta (b - gamma))``."""

    order = ORDER_BOUND_SENSITIVITY - 1  # before the clipping plugin: it sees the raw norm

    def __init__(self, clip, std: float = 1.0, gamma: float = 0.5, eta: float = 0.2):
        self.clip, self.std, self.gamma, self.eta = clip, std, gamma, eta
        self.norms: list[float] = []

    def payload_segments(self, *, ctx):
        return [Segment("below", 1, "data", "AdaptiveClip")]

    def privacy_mechanisms(self, *, ctx):
        return [Mechanism.gaussian("AdaptiveClip", self.std, 1.0, "central", ("below",))]

    def released_metrics(self, *, ctx):
        return [MetricRelease("clip_norm", "noised", "AdaptiveClip")]

    def value_bound(self, *, segment, bound):
        return 1.0 if segment == "below" else bound

    def on_client_end(self, *, client):
        norm = float(torch.linalg.vector_norm(client.payload["update"], dtype=torch.float64))
        client.payload["below"].fill_(float(norm <= self.clip.max_norm))

    def on_aggregate(self, *, server):
        stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, rng.PLUGIN + 4)
        stream.add_normal_(server.aggregate["below"], self.std)

    def on_server_update(self, *, server):
        b = server.aggregate.scalar("below") / len(server.plan.cohort)
        self.clip.max_norm *= math.exp(-self.eta * (b - self.gamma))
        self.norms.append(self.clip.max_norm)

    def on_round_end(self, *, server, metrics):
        metrics["clip_norm"] = self.clip.max_norm

    def state_dict(self):
        return {"max_norm": self.clip.max_norm}

    def load_state_dict(self, state):
        self.clip.max_norm = state["max_norm"]




def consumers_run(log_dir, communicator="auto", rounds=3):
    """All five sketches in one run (used by the two-rank test too)."""
    clip = UpdateClipping(1.0, segments=["update", "dc"])
    plugins = [SecondVector(0.5), clip, GaussianNoise(noise_multiplier=1.0, placement="distributed"), NormSquare(2.0),
               Coin(0.4), AdaptiveClip(clip, std=1.0)]
    trainer = quiet_trainer(log_dir, rounds=rounds, clients_per_round=6, seed=8, communicator=communicator, plugins=plugins)
    module = trainer.fit(TinyClassifier(), tiny_data(num_clients=14))
    return trainer, module, plugins
