"""PrivUnitRandomizer: each client replaces its clipped update by PrivUnit's randomized direction
times ScalarDP's randomized norm (paper 002 App. D, Alg. 3-4; Bhowmick et al. 2018).

``c = ScalarDP(||x||; eps2) * PrivUnit(x / ||x||; eps0, eps1)`` is an unbiased estimate of the
clipped update ``x`` (``||x|| <= C``, the bound of the bounding plugin before it) and is pure
``(eps0 + eps1 + eps2)``-DP for any two inputs, per client per participation, towards whoever sees
it (the server): the ledger accounts it as binary randomized response of that epsilon (the
dominating pair of pure DP), composed over each client's participations, and never worse than basic
composition. The client also sends Alg. 5's estimate ``s_hat`` of ``||x||^2`` from its own output
(``norm_sq_estimate``, post-processing), for LDP-FedEXP's step size (eq. (8)).

The math lives in :mod:`dpfl_lightning.privacy.privunit` (log-space constants, stable up to
``d = 10^7``). Its randomness is the client's keyed stream: in secure mode the CSPRNG (SHAKE-256
keyed by the run's secret; Gaussian directions drawn as the noise is, in float64).
"""

from __future__ import annotations

import torch

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.payload import UPDATE, Segment
from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, FederatedCallback
from dpfl_lightning.privacy import privunit
from dpfl_lightning.privacy.mechanisms import Mechanism
from dpfl_lightning.plugins.sensitivity import required_update_bound

PRIVUNIT = rng.register_purpose("PrivUnitRandomizer.privunit")


class PrivUnitRandomizer(FederatedCallback):
    """Replace every client's clipped update by PrivUnit x ScalarDP (see the module docstring).

    Args:
        eps0, eps1: PrivUnit's privacy parameters (the cap probability and the cap's angle).
        eps2: ScalarDP's (the norm).
        gamma_rule: ``paper`` (Alg. 3's conditions) or ``exact`` (the largest cap for ``eps1``).
    """

    order = ORDER_ADD_NOISE

    def __init__(self, eps0: float = 2.0, eps1: float = 2.0, eps2: float = 2.0, gamma_rule: str = "paper") -> None:
        for name, value in (("eps0", eps0), ("eps1", eps1), ("eps2", eps2)):
            require(isinstance(value, (int, float)) and 0 < value < float("inf"), f"PrivUnitRandomizer.{name}", value,
                    "must be a finite number > 0", "set a positive epsilon, e.g. 2")
        self.eps0, self.eps1, self.eps2 = float(eps0), float(eps1), float(eps2)
        self.gamma_rule = gamma_rule
        self.consts: privunit.PrivUnitConstants | None = None

    @property
    def epsilon(self) -> float:
        """``eps0 + eps1 + eps2`` (Lemma D.1): per client per participation."""
        return self.eps0 + self.eps1 + self.eps2

    def setup(self, *, ctx) -> None:
        bound = required_update_bound(ctx, self, "PrivUnitRandomizer", "update", "ScalarDP needs the update's norm bound C")
        moving = ctx.moving_bound((UPDATE,), before=self)
        if moving is not None:
            raise ConfigError("PrivUnitRandomizer", moving, "ScalarDP's range [0, C] and PrivUnit's constants are "
                              "fixed at set-up, but this bound moves every round (a norm above the first C would "
                              "break the randomizer's guarantee)", "use UpdateClipping(C) before PrivUnitRandomizer")
        self._C = bound()
        d = ctx.module.num_parameters if ctx.module is not None else 2
        self.consts = privunit.privunit_constants(d, self.eps0, self.eps1, self.eps2, self._C, self.gamma_rule)
        self._by_dim = {d: self.consts}

    def _constants(self, d: int) -> privunit.PrivUnitConstants:
        """The constants for a ``d``-dimensional input (the trainable part, when some parameters are frozen)."""
        if d not in self._by_dim:
            self._by_dim[d] = privunit.privunit_constants(d, self.eps0, self.eps1, self.eps2, self._C, self.gamma_rule)
        return self._by_dim[d]

    def payload_segments(self, *, ctx) -> list[Segment]:
        return [Segment("norm_sq_estimate", 1, "released", "PrivUnitRandomizer")]

    def privacy_mechanisms(self, *, ctx) -> list[Mechanism]:
        return [Mechanism.pure("PrivUnitRandomizer", self.epsilon, (UPDATE,), self._C)]

    def value_bound(self, *, segment: str, bound: float | None) -> float | None:
        c = self.consts
        if segment == UPDATE:  # ||c|| = |r_hat| / m, |r_hat| <= a max(b, k - b)
            return c.a * max(c.b, c.k - c.b) / c.m
        if segment == "norm_sq_estimate":
            r = c.a * max(c.b, c.k - c.b)
            return (r * r + abs(c.c2) * r + abs(c.c3)) / (1 + c.c1)
        return bound

    def on_client_end(self, *, client) -> None:
        u = client.payload[UPDATE]
        x = u.detach()  # the trainable entries only: frozen parameters are not part of the update
        consts = self._constants(x.numel())
        stream = client.random.stream(client.round_idx, client.client, PRIVUNIT)  # the CSPRNG in secure mode
        release = privunit.privatize(x.to("cpu", torch.float64), consts, stream)
        u.copy_(release.c.to(u.device, u.dtype))
        s_hat = privunit.estimate_sq_norm_of(release.c, consts)
        client.payload["norm_sq_estimate"].fill_(float(s_hat))
