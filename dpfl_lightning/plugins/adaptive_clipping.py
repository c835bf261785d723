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
from dpfl_lightning.errors import require
from dpfl_lightning.payload import Segment
from dpfl_lightning.plugins.gaussian_noise import NOISE_TAIL
from dpfl_lightning.plugins.sensitivity import SensitivityBound, scale_to_norm_
from dpfl_lightning.privacy.mechanisms import PLACEMENTS, Mechanism
from dpfl_lightning.releases import MetricRelease

COUNT_NOISE = rng.PLUGIN + 40


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
        count_noise: ``sigma_b``, the std of the noise on the count (their choice: cohort / 20).
        placement: of the count's noise, ``central`` or ``distributed`` (follow the update's noise).
        normalize: rescale every update to ``C_t`` instead of clipping.
    """

    def __init__(self, initial_clip: float = 1.0, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 count_noise: float = 1.0, placement: str = "central", normalize: bool = False) -> None:
        super().__init__(initial_clip)
        require(0 < target_quantile < 1, "AdaptiveClip.target_quantile", target_quantile, "must be in (0, 1)",
                "set e.g. 0.5")
        require(learning_rate > 0, "AdaptiveClip.learning_rate", learning_rate, "must be > 0", "set e.g. 0.2")
        require(count_noise > 0, "AdaptiveClip.count_noise", count_noise, "must be > 0",
                "set sigma_b > 0 (an un-noised count is an unaccounted release)")
        require(placement in ("central", "distributed"), "AdaptiveClip.placement", placement,
                "the count's noise is central or distributed", f"use one of {PLACEMENTS[1:]}")
        self.target_quantile = float(target_quantile)
        self.learning_rate = float(learning_rate)
        self.count_noise = float(count_noise)
        self.placement = placement
        self.only_if_above = not normalize
        self.quantile_estimates: list[float] = []

    def setup(self, *, ctx) -> None:
        self._n = ctx.sampler.expected_cohort

    def payload_segments(self, *, ctx) -> list[Segment]:
        return [*super().payload_segments(ctx=ctx), Segment("clip_bit", 1, "data", "AdaptiveClip")]

    def privacy_mechanisms(self, *, ctx) -> list[Mechanism]:
        # the centred count moves by at most 1/2 when a client is added or removed
        return [Mechanism.gaussian("AdaptiveClip", self.count_noise, 0.5, self.placement, ("clip_bit",))]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [*super().released_metrics(ctx=ctx),
                MetricRelease("unclipped_fraction", "noised", "AdaptiveClip", "the noisy fraction b~ of updates <= C")]

    def value_bound(self, *, segment: str, bound: float | None) -> float | None:
        if segment == "clip_bit":
            share = self.count_noise / math.sqrt(self._cohort) if self.placement == "distributed" else 0.0
            return 0.5 + NOISE_TAIL * share
        return super().value_bound(segment=segment, bound=bound)

    def before_round(self, *, plan, server) -> None:
        super().before_round(plan=plan, server=server)
        self._cohort = max(len(plan.cohort), 1)

    def on_client_end(self, *, client) -> None:
        norm = scale_to_norm_([client.payload[s] for s in self.segments], self.max_norm, self.only_if_above)
        if math.isfinite(norm):
            client.checked_finite.update(self.segments)
        bit = client.payload["clip_bit"]
        bit.fill_((1.0 if norm <= self._round_bound else 0.0) - 0.5)
        if self.placement == "distributed":
            stream = client.random.stream(client.round_idx, client.client, COUNT_NOISE)
            stream.add_normal_(bit, self.count_noise / math.sqrt(self._cohort))
        if self.log_norms:
            client.payload["raw_norm"].fill_(norm)
            client.payload["raw_norm_sq"].fill_(norm * norm)
            client.payload["bounded"].fill_(float(norm > self.max_norm or not self.only_if_above))

    def on_aggregate(self, *, server) -> None:
        if self.placement == "central":
            stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, COUNT_NOISE)
            stream.add_normal_(server.aggregate["clip_bit"], self.count_noise)

    def on_server_update(self, *, server) -> None:
        b = server.aggregate.scalar("clip_bit") / self._n + 0.5
        self.quantile_estimates.append(b)
        self.max_norm *= math.exp(-self.learning_rate * (b - self.target_quantile))

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        super().on_round_end(server=server, metrics=metrics)
        if self.quantile_estimates:
            metrics["unclipped_fraction"] = self.quantile_estimates[-1]

    def state_dict(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.max_norm = float(state["max_norm"])
