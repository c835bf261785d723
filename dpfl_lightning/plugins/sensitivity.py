"""What update clipping and update normalization share: a norm bound ``C`` on every client update.

Sensitivity (client-level DP): with every update's L2 norm at most ``C``, adding or removing one
client changes the sum of updates by at most ``C`` in L2 norm (replacing one client: ``2C``).
:class:`~dpfl_lightning.plugins.gaussian_noise.GaussianNoise` reads ``max_norm`` from the bounding
plugin before it to turn a noise multiplier into a standard deviation.
"""

from __future__ import annotations

import math

import torch

from dpfl_lightning.errors import require
from dpfl_lightning.plugins.base import ORDER_BOUND_SENSITIVITY, ClientUpdate, FederatedCallback


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


def scale_to_norm_(update: torch.Tensor, target: float, only_if_above: bool) -> float:
    """Scale ``update`` in place to L2 norm ``target`` (or to at most ``target``); return its norm before.

    The float32 product ``update * (target / norm)`` can land a few ulp above ``target``; the result
    is nudged down until its float64 norm is ``<= target``, so the bound holds exactly, not up to
    rounding. A zero update stays zero (normalizing it would divide by zero).
    """
    norm = _norm(update)
    if norm == 0.0 or (only_if_above and norm <= target):
        return norm
    factor = target / norm
    update.mul_(factor)
    shrink = 1.0 - 2.0**-23
    while _norm(update) > target:
        update.mul_(shrink)
    return norm


class SensitivityBound(FederatedCallback):
    """Base of the plugins that bound each client's update norm by ``max_norm``."""

    order = ORDER_BOUND_SENSITIVITY
    only_if_above = True

    def __init__(self, max_norm: float, log_norms: bool = False) -> None:
        require(isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0,
                f"{type(self).__name__}.max_norm", max_norm, "the norm bound C must be a finite number > 0",
                "set max_norm to a positive value such as 1.0")
        self.max_norm = float(max_norm)
        self.log_norms = bool(log_norms)
        # Raw-update statistics are not private: they only cross the communicator when asked for.
        self.aggregated_scalars = ("update_norm", "bounded") if self.log_norms else ()

    def on_client_end(self, *, trainer, result: ClientUpdate) -> None:
        norm = scale_to_norm_(result.update, self.max_norm, self.only_if_above)
        if self.log_norms:
            result.scalars["update_norm"] = norm
            result.scalars["bounded"] = float(norm > self.max_norm or not self.only_if_above)

    def on_round_end(self, *, trainer, round_idx: int, metrics: dict[str, float]) -> None:
        agg = trainer.last_aggregate
        if self.log_norms and agg is not None and agg.num_clients:
            metrics["update_norm_mean"] = agg.scalars["update_norm"] / agg.num_clients
            metrics["fraction_bounded"] = agg.scalars["bounded"] / agg.num_clients
