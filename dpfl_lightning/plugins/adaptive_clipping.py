"""AdaptiveClipping: a clip norm that follows a target quantile of the update norms (Andrew, Thakkar,
McMahan, Ramaswamy, "Differentially private learning with adaptive clipping", NeurIPS 2021).

Every round each client of the cohort also sends the centred bit ``b_i - 1/2`` with
``b_i = 1[||u_i|| <= C_t]`` (the payload scalar ``clip_bit``); the sum gets Gaussian noise of std
``sigma_b`` (central, or shares of it from each client for distributed noise) and the server
estimates the fraction of unclipped updates ``b~ = (sum (b_i - 1/2) + noise) / n + 1/2`` (``n``
the expected cohort size) and moves the bound geometrically towards the ``gamma`` quantile:
``C_{t+1} = C_t exp(-eta_C (b~ - gamma))`` (their Alg. 1).

Privacy: adding or removing a client moves the centred count by at most 1/2, so the count is a
Gaussian release of multiplier ``2 sigma_b``, declared to the ledger. The update's own noise keeps
``sigma_t = z_Delta C_t`` with the current bound. With ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``
the two Gaussians on the same sample compose to one of multiplier ``z``: the run spends exactly the
privacy of a non-adaptive run with noise multiplier ``z`` (the preset
:class:`~dpfl_lightning.algorithms.AdaptiveClipping` does this arithmetic).

With ``normalize=True`` the bound is DP-NormFedAvg's scale: every update is rescaled to ``C_t``
(paper 003) and the bit still says whether the raw norm was below ``C_t``.
"""

from __future__ import annotations

import math
from typing import Any

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.payload import Segment
from dpfl_lightning.plugins.gaussian_noise import client_noise_std, noised_value_bound
from dpfl_lightning.plugins.sensitivity import SensitivityBound
from dpfl_lightning.privacy.mechanisms import PLACEMENTS, Mechanism
from dpfl_lightning.federated.releases import MetricRelease

COUNT_NOISE = rng.register_purpose("AdaptiveClip.count_noise")
MAX_LEARNING_RATE = 10.0
COUNT_SENSITIVITY = 0.5  # the centred count moves by at most 1/2 when a client is added or removed


def update_noise_multiplier(total: float, count_noise: float) -> float:
    """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: the update's multiplier that, composed with the
    count's, spends the privacy of one Gaussian of multiplier ``total`` (Andrew et al. 2021, Sec. 3)."""
    require(2 * count_noise > total, "AdaptiveClipping.count_noise", count_noise,
            f"the count's noise must be larger than z/2 = {total / 2:g} (else it alone spends the budget)",
            f"set count_noise > {total / 2:g} (Andrew et al. use sigma_b = expected cohort / 20)")
    return (total**-2 - (2 * count_noise) ** -2) ** -0.5


class AdaptiveClip(SensitivityBound):
    """Clip (or normalize) every update to ``C_t`` and move ``C_t`` towards the ``target_quantile`` of
    the update norms with a noisy count (see the module docstring).

    Args:
        initial_clip: ``C_0``.
        target_quantile: ``gamma`` (their default 0.5).
        learning_rate: ``eta_C`` (their default 0.2).
        count_noise: ``sigma_b``, the std of the noise on the count (default: their choice, expected
            cohort / 20).
        placement: of the count's noise, ``central`` or ``distributed`` (follow the update's noise).
        normalize: rescale every update to ``C_t`` instead of clipping.
        total_noise_multiplier / update_noise: give the update's :class:`GaussianNoise` the share
            ``z_Delta`` of the total ``z`` once ``sigma_b`` is known (the preset does this).
    """

    bound_moves = True

    def __init__(self, initial_clip: float = 1.0, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 count_noise: float | None = None, placement: str = "central", normalize: bool = False,
                 total_noise_multiplier: float | None = None, update_noise: Any = None) -> None:
        super().__init__(initial_clip)
        require(0 < target_quantile < 1, "AdaptiveClip.target_quantile", target_quantile, "must be in (0, 1)",
                "set e.g. 0.5")
        require(isinstance(learning_rate, (int, float)) and 0 < learning_rate <= MAX_LEARNING_RATE,
                "AdaptiveClip.learning_rate", learning_rate,
                f"must be in (0, {MAX_LEARNING_RATE:g}]: the bound is multiplied by exp(-learning_rate (b~ - gamma)) "
                "every round, and larger steps overflow it", "set e.g. 0.2 (Andrew et al.)")
        require(count_noise is None or (isinstance(count_noise, (int, float)) and 0 < count_noise < math.inf),
                "AdaptiveClip.count_noise", count_noise, "must be a finite number > 0",
                "set sigma_b > 0 (an un-noised count is an unaccounted release), or leave it unset (cohort / 20)")
        require(placement in ("central", "distributed"), "AdaptiveClip.placement", placement,
                "the count's noise is central or distributed", f"use one of {PLACEMENTS[1:]}")
        require((total_noise_multiplier is None) == (update_noise is None), "AdaptiveClip.update_noise", update_noise,
                "the split of a total noise multiplier needs both the total and the update's noise plugin",
                "give total_noise_multiplier and update_noise together (the AdaptiveClipping preset does)")
        self.target_quantile = float(target_quantile)
        self.learning_rate = float(learning_rate)
        self.count_noise = None if count_noise is None else float(count_noise)
        self.placement = placement
        self.only_if_above = not normalize
        self.total_noise_multiplier = total_noise_multiplier
        self.update_noise = update_noise
        self.sigma_b = self.count_noise  # resolved at set-up when unset
        self.quantile_estimates: list[float] = []

    def setup(self, *, ctx) -> None:
        self._n = ctx.sampler.expected_cohort
        # Andrew et al. (Sec. 3 and their experiments): sigma_b = expected cohort / 20
        self.sigma_b = self.count_noise if self.count_noise is not None else self._n / 20
        if self.update_noise is not None:  # the update's share of the total (module docstring)
            self.update_noise.use_noise_multiplier(update_noise_multiplier(self.total_noise_multiplier, self.sigma_b))

    def payload_segments(self, *, ctx) -> list[Segment]:
        return [*super().payload_segments(ctx=ctx), Segment("clip_bit", 1, "data", "AdaptiveClip")]

    def privacy_mechanisms(self, *, ctx) -> list[Mechanism]:
        return [Mechanism.gaussian("AdaptiveClip", self.sigma_b, COUNT_SENSITIVITY, self.placement, ("clip_bit",))]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [*super().released_metrics(ctx=ctx),
                MetricRelease("unclipped_fraction", "noised", "AdaptiveClip", "the noisy fraction b~ of updates <= C")]

    def value_bound(self, *, segment: str, bound: float | None) -> float | None:
        if segment == "clip_bit":
            return noised_value_bound(COUNT_SENSITIVITY, client_noise_std(self.sigma_b, self.placement, self._cohort))
        return super().value_bound(segment=segment, bound=bound)

    def before_round(self, *, plan, server) -> None:
        super().before_round(plan=plan, server=server)
        self._cohort = max(len(plan.cohort), 1)

    def on_client_end(self, *, client) -> None:
        norm = self.bound_payload(client)
        bit = client.payload["clip_bit"]
        bit.fill_((0.0 if self.above_bound(norm) else 1.0) - 0.5)
        if self.placement == "distributed":
            stream = client.random.stream(client.round_idx, client.client, COUNT_NOISE)
            stream.add_normal_(bit, client_noise_std(self.sigma_b, self.placement, self._cohort))

    def on_aggregate(self, *, server) -> None:
        if self.placement == "central":
            stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, COUNT_NOISE)
            stream.add_normal_(server.aggregate["clip_bit"], self.sigma_b)

    def on_server_update(self, *, server) -> None:
        b = server.aggregate.scalar("clip_bit") / self._n + 0.5
        self.quantile_estimates.append(b)
        # the noisy fraction can lie far outside [0, 1]: cap the exponent so the bound stays a float
        step = min(max(-self.learning_rate * (b - self.target_quantile), -600.0), 600.0)
        moved = self.max_norm * math.exp(step)
        if not (0.0 < moved < math.inf):
            raise ConfigError("AdaptiveClip.learning_rate", self.learning_rate,
                              f"the clip norm left the floating-point range in round {server.round_idx + 1}",
                              "lower learning_rate (Andrew et al. use 0.2)")
        self.max_norm = moved

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        super().on_round_end(server=server, metrics=metrics)
        if self.quantile_estimates:
            metrics["unclipped_fraction"] = self.quantile_estimates[-1]

    def state_dict(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.max_norm = float(state["max_norm"])
