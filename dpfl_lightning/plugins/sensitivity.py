"""What update clipping and update normalization share: a norm bound ``C`` on every client's payload.

Sensitivity (client-level DP): with every client's contribution of L2 norm at most ``C``, adding or
removing one client changes the sum by at most ``C`` in L2 norm (replacing one client: ``2C``).
A bound acts on one or more payload segments jointly (default: the model update); noise plugins
after it read the bound of the segments they cover from the set-up context.
"""

from __future__ import annotations

import math

import torch

from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.payload import UPDATE, Segment
from dpfl_lightning.plugins.callback import ORDER_BOUND_SENSITIVITY, FederatedCallback
from dpfl_lightning.federated.releases import MetricRelease

_SHRINK = 1.0 - 2.0**-20
# Scaling by (C / ||u||)(1 - 2^-22) keeps the float32 result below C without measuring it again:
# every element and the factor itself round by at most 2^-24 relative, so the norm grows by at most
# (1 + 2^-24)^2 < 1 / (1 - 2^-22). Subnormal results (a bound below ~1e-30) are measured anyway.
_MARGIN = 1.0 - 2.0**-22


_BLOCK = 1 << 20  # values converted to float64 at a time (a whole large model at once is ~7x slower)


def required_update_bound(ctx, plugin: FederatedCallback, setting: str, value: object, why: str) -> float:
    """The norm bound on the update that a plugin placed before ``plugin`` enforces (the set-up
    context's ``norm_bound``); refused, naming ``setting=value`` and ``why`` it needs one, when none does."""
    bound = ctx.norm_bound((UPDATE,), before=plugin)
    if bound is None:
        raise ConfigError(setting, value, f"{why}, and no UpdateClipping or UpdateNormalization bounds the update "
                          "before it", f"add UpdateClipping(C) to the plugins before {type(plugin).__name__}")
    return bound


def joint_norm(parts: list[torch.Tensor]) -> float:
    """The joint L2 norm, accumulated in float64."""
    total = 0.0
    for p in parts:
        flat = p.reshape(-1)
        if flat.numel() <= _BLOCK:
            total += float(torch.linalg.vector_norm(flat, dtype=torch.float64)) ** 2
        else:
            total += sum(float(torch.linalg.vector_norm(flat[i : i + _BLOCK], dtype=torch.float64)) ** 2
                         for i in range(0, flat.numel(), _BLOCK))
    return math.sqrt(total)


def _scale(parts: list[torch.Tensor], factor: float) -> None:
    for p in parts:
        if p.dtype == torch.float64 or 1e-30 < factor < 1e30:
            p.mul_(factor)
        else:  # the factor is not a float32 number (a tiny update normalized to C): scale in float64
            p.copy_(p.double().mul_(factor))


def scale_to_norm_(parts: torch.Tensor | list[torch.Tensor], target: float, only_if_above: bool) -> float:
    """Scale ``parts`` (jointly) in place to L2 norm ``target``, or to at most ``target`` with
    ``only_if_above``; return their norm before.

    The bound holds exactly, not up to rounding: the float32 product ``u * (C / ||u||)`` can land a
    few ulp above ``C``, so the result is shrunk (then moved one ulp towards zero, a bounded number of
    times) until its float64 norm is ``<= C``. It always returns: a zero update stays zero, a
    non-finite one is left for the trainer's finite check, and a tiny one (say 1e-40) is scaled in
    float64, where ``C / ||u||`` does not overflow.
    """
    parts = [parts] if isinstance(parts, torch.Tensor) else list(parts)
    norm = joint_norm(parts)
    if not math.isfinite(norm) or norm == 0.0 or (only_if_above and norm <= target):
        return norm
    _scale(parts, target / norm * _MARGIN)
    if target > 1e-30 and all(p.dtype in (torch.float32, torch.float64) for p in parts):
        return norm
    for _ in range(4):
        now = joint_norm(parts)
        if now <= target:
            return norm
        _scale(parts, target / now * _SHRINK)
    for _ in range(64):  # each pass lowers every non-zero magnitude by one ulp
        if joint_norm(parts) <= target:
            return norm
        for p in parts:
            p.copy_(torch.nextafter(p, torch.zeros_like(p)))
    for p in parts:  # unreachable in practice; the bound must hold whatever happens
        p.zero_()
    return norm


class SensitivityBound(FederatedCallback):
    """Base of the plugins that bound each client's contribution by ``max_norm``.

    Args:
        max_norm: the bound ``C`` (> 0).
        segments: the payload segments bounded jointly (default: the model update).
        log_norms: also send and log the mean raw norm and the fraction of bounded clients. These
            are statistics of raw updates with no noise: a DP run refuses them unless
            ``log_client_metrics=True`` releases them knowingly (then they are not accounted).
    """

    order = ORDER_BOUND_SENSITIVITY
    only_if_above = True
    #: True when ``max_norm`` changes between rounds (adaptive clipping): every mechanism scaled to
    #: this bound must then follow it round by round, or be refused at set-up
    bound_moves = False

    def __init__(self, max_norm: float, segments: tuple[str, ...] | list[str] = (UPDATE,), log_norms: bool = False) -> None:
        require(isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0,
                f"{type(self).__name__}.max_norm", max_norm, "the norm bound C must be a finite number > 0",
                "set max_norm to a positive value such as 1.0")
        require(len(segments) >= 1, f"{type(self).__name__}.segments", segments, "bounds nothing",
                "name at least one payload segment, e.g. ['update']")
        self.max_norm = float(max_norm)
        self.segments = tuple(segments)
        self.log_norms = bool(log_norms)

    def payload_segments(self, *, ctx) -> list[Segment]:
        if not self.log_norms:
            return []
        owner = type(self).__name__
        return [Segment("raw_norm", 1, "data", owner), Segment("raw_norm_sq", 1, "data", owner),
                Segment("bounded", 1, "data", owner)]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        owner = type(self).__name__
        return [MetricRelease("clip_norm", "public", owner, "the bound C in force"),
                MetricRelease("update_norm_mean", "unaccounted", owner, "mean raw update norm"),
                MetricRelease("update_norm_std", "unaccounted", owner, "spread of the raw update norms"),
                MetricRelease("fraction_bounded", "unaccounted", owner, "fraction of clients above the bound")]

    def value_bound(self, *, segment: str, bound: float | None) -> float | None:
        if segment in self.segments:  # every value of a vector of norm <= C is at most C
            return self.max_norm if bound is None else min(bound, self.max_norm)
        if segment in ("raw_norm", "bounded") and self.log_norms:
            return None if segment == "raw_norm" else 1.0
        return bound

    def on_client_end(self, *, client) -> None:
        self.bound_payload(client)

    def bound_payload(self, client) -> float:
        """Bound the client's segments to ``max_norm`` (the update segment holds the trainable entries
        only: frozen parameters are neither bounded nor sent); return their norm before."""
        norm = scale_to_norm_([client.payload[s] for s in self.segments], self.max_norm, self.only_if_above)
        if self.log_norms:
            client.payload["raw_norm"].fill_(norm)
            client.payload["raw_norm_sq"].fill_(norm * norm)
            client.payload["bounded"].fill_(float(self.above_bound(norm) or not self.only_if_above))
        return norm

    def above_bound(self, norm: float) -> bool:
        """Whether a client's raw norm (as :meth:`bound_payload` returns it) exceeded the bound in force."""
        return norm > self.max_norm

    def before_round(self, *, plan, server) -> None:
        self._round_bound = self.max_norm  # an adaptive bound may move during the round

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        metrics["clip_norm"] = self._round_bound
        agg = server.aggregate
        if self.log_norms and agg is not None and agg.num_clients:
            n = agg.num_clients
            mean = agg.scalar("raw_norm") / n
            metrics["update_norm_mean"] = mean
            metrics["update_norm_std"] = math.sqrt(max(agg.scalar("raw_norm_sq") / n - mean * mean, 0.0))
            metrics["fraction_bounded"] = agg.scalar("bounded") / n
