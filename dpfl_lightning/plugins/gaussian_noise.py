"""GaussianNoise: the Gaussian mechanism on client updates, in one of three placements.

Sensitivity comes from the bounding plugin before it (:class:`UpdateClipping` or
:class:`UpdateNormalization`, norm bound ``C``): the cohort's sum changes by at most ``C`` when one
client is added or removed. With ``noise_multiplier=z`` the standard deviation is ``sigma = z * C``.

Threat models (who must be trusted for the guarantee to hold):

``local``
    Each client adds ``N(0, sigma^2 I)`` to its own bounded update before it leaves the client
    (paper 000 Alg. 1 line 9). Guarantee towards the server and everyone else; nothing raw crosses
    the communicator. Each client's release is a Gaussian mechanism with multiplier ``z``.
``central``
    A trusted aggregator adds one draw ``N(0, sigma^2 I)`` to the sum of the bounded updates
    (McMahan et al. 2018). Guarantee towards anyone who sees the models; the server sees raw
    updates. Amplified by client sampling.
``distributed``
    Each of the ``n`` clients of the round adds ``N(0, sigma^2 / n I)``, so the sum carries exactly
    ``N(0, sigma^2 I)``: the central guarantee without a trusted server, assuming secure
    aggregation hides individual (under-noised) contributions (paper 003 Alg. 1 line 12 adds
    ``zeta ~ N(0, r sigma_003^2 I)`` per client, i.e. this placement).

Draws are keyed by (seed, round, client) -- (seed, round) for the central draw, taken identically
on every rank -- so they do not depend on the number of ranks, and two runs with the same seed (say
clipping vs normalization) see the same noise. That makes the noise a function of the (logged)
seed: anyone who has the seed can subtract it. This is what a simulation wants; for data that must
really be protected use ``secure=True``: the key then also mixes in a secret drawn from the
operating system at set-up (shared by the ranks, never logged or checkpointed), so the noise is
no longer reproducible from the configuration.
"""

from __future__ import annotations

import math

import torch

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.plugins.base import ORDER_ADD_NOISE, Aggregate, ClientUpdate, FederatedCallback
from dpfl_lightning.plugins.sensitivity import SensitivityBound

PLACEMENTS = ("local", "central", "distributed")


class GaussianNoise(FederatedCallback):
    """Add Gaussian noise to client updates (``local`` / ``distributed``) or to their sum (``central``).

    Args:
        std: the standard deviation ``sigma``: per client update for ``local``, of the total noise
            on the sum for ``central`` and ``distributed``. Give either this or ``noise_multiplier``.
        noise_multiplier: ``z``; ``sigma = z * C`` with ``C`` the norm bound of the bounding plugin.
        placement: ``"local"``, ``"central"`` or ``"distributed"`` (see the module docstring).
    """

    order = ORDER_ADD_NOISE

    def __init__(self, std: float | None = None, noise_multiplier: float | None = None,
                 placement: str = "central", target_epsilon: float | None = None, delta: float | None = None,
                 accountant: str = "rdp", secure: bool = False) -> None:
        given = {"std": std, "noise_multiplier": noise_multiplier, "target_epsilon": target_epsilon}
        require(sum(v is not None for v in given.values()) == 1, "GaussianNoise", given,
                "exactly one of std, noise_multiplier and target_epsilon must be set",
                "pass std=..., noise_multiplier=... or target_epsilon=... (with delta)")
        if target_epsilon is not None:
            require(math.isfinite(target_epsilon) and target_epsilon > 0, "GaussianNoise.target_epsilon",
                    target_epsilon, "must be a finite number > 0", "set a positive epsilon, e.g. 3.0")
        require(delta is None or 0 < delta < 1, "GaussianNoise.delta", delta, "must be in (0, 1)",
                "set delta well below 1/num_clients")
        for name, value in (("std", std), ("noise_multiplier", noise_multiplier)):
            if value is not None:
                require(math.isfinite(value) and value >= 0, f"GaussianNoise.{name}", value,
                        "must be a finite number >= 0", f"set {name} to a non-negative value")
        require(placement in PLACEMENTS, "GaussianNoise.placement", placement, "unknown placement",
                f"use one of {', '.join(PLACEMENTS)}")
        self.std = std
        self.noise_multiplier = noise_multiplier
        self.placement = placement
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.accountant = accountant
        self.secure = secure
        self._secret = 0
        self.sensitivity: float | None = None
        self._cohort_size = 1

    @property
    def sigma(self) -> float:
        """The standard deviation in force (see ``std``)."""
        if self.std is not None:
            return float(self.std)
        assert self.sensitivity is not None, "setup() has not run"
        return float(self.noise_multiplier) * self.sensitivity

    def setup(self, *, trainer, module) -> None:
        if self.secure:
            import secrets

            secret = secrets.randbits(62) if trainer.is_global_zero else None
            self._secret = trainer.comm.broadcast_object(secret, root=0) if trainer.comm is not None else secret
        bounds = [p for p in trainer.plugins[: trainer.plugins.index(self)] if isinstance(p, SensitivityBound)]
        if bounds:
            self.sensitivity = bounds[-1].max_norm
        elif self.noise_multiplier is not None:
            raise ConfigError("GaussianNoise.noise_multiplier", self.noise_multiplier,
                              "a noise multiplier needs a norm bound to scale, and no UpdateClipping or "
                              "UpdateNormalization runs before the noise",
                              "add UpdateClipping(C) or UpdateNormalization(C) to the plugins, or give std=")
        if self.target_epsilon is not None:
            if self.sensitivity is None:
                raise ConfigError("GaussianNoise.target_epsilon", self.target_epsilon,
                                  "calibration needs a norm bound and no UpdateClipping or UpdateNormalization "
                                  "runs before the noise", "add UpdateClipping(C) or UpdateNormalization(C)")
            self.noise_multiplier = self._calibrate(trainer)

    def _calibrate(self, trainer) -> float:
        """The smallest ``z`` (to 1%) whose ledger epsilon after ``trainer.rounds`` rounds is at most
        the target: the accounted release scales linearly with ``z``."""
        from dpfl_lightning.privacy.calibrate import calibrate_release
        from dpfl_lightning.privacy.events import default_delta, guarantee

        if self.delta is None:
            self.delta = default_delta(trainer.sampler.num_clients)
        g = guarantee(self._mechanism(1.0), trainer.sampler)
        steps = trainer.rounds
        if g.per_client:  # the busiest client's participations are known in advance
            steps = int(trainer.sampler.participation_counts(trainer.seed, trainer.rounds).max())
        z_release = calibrate_release(g.release, self.target_epsilon, self.delta, steps * g.steps_per_round,
                                      self.accountant)
        return z_release / g.release.noise_multiplier

    def _mechanism(self, z: float):
        from dpfl_lightning.privacy.events import Mechanism

        return Mechanism("GaussianNoise", "client", self.placement, z * self.sensitivity, self.sensitivity)

    def privacy_mechanism(self, *, trainer):
        if self.sensitivity is None:
            return None  # std without a norm bound: no DP statement can be made
        return self._mechanism(self.sigma / self.sensitivity)

    def on_round_start(self, *, trainer, round_idx: int, cohort: list[int]) -> None:
        self._cohort_size = max(len(cohort), 1)

    def on_client_end(self, *, trainer, result: ClientUpdate) -> None:
        if self.placement == "central":
            return
        std = self.sigma if self.placement == "local" else self.sigma / math.sqrt(self._cohort_size)
        u = result.update
        g = rng.generator(trainer.seed ^ self._secret, result.round_idx, result.client, rng.CLIENT_NOISE, u.device)
        u.add_(torch.randn(u.shape, generator=g, device=u.device, dtype=u.dtype), alpha=std)

    def on_aggregate(self, *, trainer, aggregate: Aggregate) -> None:
        if self.placement != "central":
            return
        s = aggregate.update_sum
        g = rng.generator(trainer.seed ^ self._secret, aggregate.round_idx, rng.SERVER_CLIENT, rng.CENTRAL_NOISE, s.device)
        s.add_(torch.randn(s.shape, generator=g, device=s.device, dtype=s.dtype), alpha=self.sigma)

    def state_dict(self) -> dict:
        # A calibrated run resumed later must keep the noise it ran with (recalibrating for other
        # settings would make the ledger misreport the past rounds).
        return {"noise_multiplier": self.noise_multiplier} if self.target_epsilon is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.noise_multiplier = state["noise_multiplier"]
