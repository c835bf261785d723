"""FedEXP's adaptive global step size (Jhunjhunwala et al. 2023) and DP-FedEXP (paper 002, Sec. 3).

The server steps ``w <- w + eta_g c_bar`` with ``c_bar`` the mean (noised) update and, by variant:

- ``plain`` (FedEXP, eq. (2)): ``eta_g = max(1, sum ||D_i||^2 / (k |S| (||D_bar||^2 + eps)))`` with
  ``k = 2`` and a small ``eps`` in the original FedEXP (``half=True``), ``k = 1``, ``eps = 0`` in
  paper 002. The squared norms are raw statistics: no DP run accepts this variant.
- ``ldp_gaussian`` (LDP-FedEXP, eq. (6)): ``eta_g = max(1, (mean ||c_i||^2 - d sigma^2) /
  ||c_bar||^2)``, with ``c_i`` each client's *noised* update (local Gaussian noise of std
  ``sigma``): ``||c_i||^2`` is post-processing of the local release, so it costs nothing; the
  estimator is unbiased for ``mean ||D_i||^2``.
- ``ldp_privunit`` (eq. (8), App. D): ``eta_g = max(1, mean s_hat_i / ||c_bar||^2)`` with ``s_hat_i``
  Alg. 5's estimate of ``||D_i||^2`` from the PrivUnit output, which the randomizer
  (:class:`~dpfl_lightning.plugins.PrivUnitRandomizer`) sends as ``norm_sq_estimate``.
- ``cdp`` (CDP-FedEXP, eq. (7)): ``eta_g = max(1, (mean ||D_i||^2 + xi) / ||c_bar||^2)``: the sum of the
  clipped updates' squared norms (sensitivity ``C^2``) travels as the payload scalar ``norm_sq``
  and gets central noise ``xi`` (std ``sigma_xi`` on the mean; default ``d sigma^2 / M`` with
  ``sigma / sqrt(M)`` the std of the update noise on the mean, Theorem 4.6), a declared release
  the ledger composes with the update noise (Prop. 4.2).

Every variant divides by the plain mean over the cohort (``trainer.weighting="uniform"``): the
step-size formulas are for the uniform average ``c_bar`` of the updates, so sample weighting is
refused. ``ldp_privunit`` needs :class:`~dpfl_lightning.plugins.PrivUnitRandomizer` in the run (it
sends ``norm_sq_estimate``); ``ldp_gaussian`` needs local Gaussian noise on the update.

The presets :class:`~dpfl_lightning.algorithms.FedEXP`, ``LDPFedEXP`` and ``CDPFedEXP`` pick the
variant that matches their noise. ``eta_g`` is logged every round. With
``average_last=2`` evaluation sees the average of the last two global models (App. G, after
Jhunjhunwala et al.) while training continues from the last one.
"""

from __future__ import annotations

import math

import torch

from dpfl_lightning import rng
from dpfl_lightning.federated import frozen
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.payload import UPDATE, Segment
from dpfl_lightning.plugins.callback import ORDER_SERVER_STEP, FederatedCallback
from dpfl_lightning.plugins.setup_checks import check_uniform_weighting
from dpfl_lightning.privacy.mechanisms import Mechanism
from dpfl_lightning.federated.releases import MetricRelease

VARIANTS = ("plain", "ldp_gaussian", "ldp_privunit", "cdp")
XI_NOISE = rng.register_purpose("FedEXP.xi_noise")


class FedEXP(FederatedCallback):
    """DP-FedEXP's adaptive global step size (see the module docstring).

    Args:
        variant: ``plain``, ``ldp_gaussian``, ``ldp_privunit`` or ``cdp``.
        half / eps: the original FedEXP's factor 1/2 and denominator constant (``plain`` only).
        sigma_xi: CDP: the std of ``xi`` on the mean squared norm (default ``d sigma^2 / M``).
        average_last: evaluate the average of the last this many global models (1: the last).
    """

    order = ORDER_SERVER_STEP

    def __init__(self, variant: str = "plain", half: bool = False, eps: float = 0.0, sigma_xi: float | None = None,
                 average_last: int = 2) -> None:
        require(variant in VARIANTS, "FedEXP.variant", variant, "unknown variant", f"use one of {VARIANTS}")
        require(eps >= 0, "FedEXP.eps", eps, "must be >= 0", "set a small non-negative constant")
        require(sigma_xi is None or sigma_xi > 0, "FedEXP.sigma_xi", sigma_xi, "must be > 0",
                "leave it unset (d sigma^2 / M) or give a positive std")
        require(average_last in (1, 2), "FedEXP.average_last", average_last, "must be 1 or 2",
                "use 2 (paper 002 App. G) or 1 (the last iterate)")
        self.variant = variant
        self.half = bool(half)
        self.eps = float(eps)
        self.sigma_xi = sigma_xi
        self.average_last = average_last
        self.eta_g: list[float] = []
        self._previous: torch.Tensor | None = None

    # ------------------------------------------------------------------ set-up
    def _local_gaussian(self, mechanisms) -> Mechanism | None:
        return next((m for m in mechanisms if m.placement == "local" and UPDATE in m.covers and m.is_gaussian), None)

    def setup(self, *, ctx) -> None:
        check_uniform_weighting("FedEXP", "the global step size is defined for the plain mean of the updates", ctx)
        self._bound = ctx.norm_bound((UPDATE,), before=self)
        self._d = ctx.module.num_parameters if ctx.module is not None else ctx.num_parameters
        self._num_clients = ctx.sampler.expected_cohort
        if self.variant == "cdp" and self._bound is None:
            raise ConfigError("FedEXP.variant", "cdp", "the squared norms need a bound (C^2) for their noise",
                              "add UpdateClipping(C) before FedEXP")
        if self.variant in ("cdp", "ldp_gaussian") and self._d is None:
            raise ConfigError("FedEXP", self.variant, "the step size (and CDP's default sigma_xi = d sigma^2 / M) "
                              "needs the model's parameter count d, which planning without the model does not know",
                              "plan with the model in the config (dpfl privacy epsilon --config with a model:)")
        moving = ctx.moving_bound((UPDATE,), before=self)
        if self.variant == "cdp" and moving is not None and self.sigma_xi is not None:
            raise ConfigError("FedEXP.sigma_xi", self.sigma_xi,
                              f"{moving} moves the clip norm C_t every round, so xi's fixed std would protect squared "
                              "norms bounded by C_t^2 with a multiplier that moves while the ledger accounts one",
                              "leave sigma_xi unset (d sigma_t^2 / M follows the bound) or use UpdateClipping(C)")

    def payload_segments(self, *, ctx) -> list[Segment]:
        if self.variant in ("plain", "cdp"):
            return [Segment("norm_sq", 1, "data", "FedEXP")]
        if self.variant == "ldp_gaussian":
            return [Segment("norm_sq", 1, "released", "FedEXP")]
        return []  # ldp_privunit: the randomizer sends its own estimate

    def privacy_mechanisms(self, *, ctx) -> list[Mechanism]:
        if self.variant != "cdp":
            return []
        # a sum of squared norms in [0, C^2]: adding, removing or replacing one client moves it by C^2
        # at most (paper 002 App. E: sensitivity C^2 / M on the mean)
        c_sq = self._bound() ** 2
        return [Mechanism.gaussian("FedEXP", self._xi_std(self._update_multiplier(ctx), self._bound()), c_sq,
                                   "central", ("norm_sq",), replace_sensitivity=c_sq)]

    def _update_multiplier(self, ctx) -> float | None:
        """The noise multiplier of the Gaussian noise on the update (``None`` with ``sigma_xi`` given)."""
        if self.sigma_xi is not None:
            return None
        update = [m for m in ctx.mechanisms if m.source != "FedEXP" and UPDATE in m.covers and m.is_gaussian]
        if not update:
            raise ConfigError("FedEXP", "cdp", "sigma_xi defaults to d sigma^2 / M, but no Gaussian noise covers the "
                              "update", "add GaussianNoise(noise_multiplier=..., placement='central') or give sigma_xi")
        return update[0].noise_multiplier

    def _xi_std(self, z: float | None, clip: float) -> float:
        """The std of ``xi`` on the *sum* of squared norms (``M sigma_xi``) in a round whose clip norm is
        ``clip``: ``sigma_xi = d sigma^2 / M`` with ``sigma = z C / sqrt(M)`` the std of the update
        noise on the mean (eq. (7), Theorem 4.6), so xi's multiplier ``d z^2 / M`` stays fixed when an
        adaptive clip moves ``C``."""
        M = self._num_clients
        if z is None:
            return M * self.sigma_xi
        sigma = z * clip / math.sqrt(M)  # paper 002: the mean carries N(0, sigma^2 / M)
        return M * (self._d * sigma**2 / M)

    def on_fit_start(self, *, ctx) -> None:
        if self.variant == "ldp_gaussian":
            m = self._local_gaussian(ctx.mechanisms)
            if m is None:
                raise ConfigError("FedEXP.variant", "ldp_gaussian", "no local Gaussian noise covers the update",
                                  "add GaussianNoise(..., placement='local') or use another variant")
            self._sigma = m.noise_multiplier * m.sensitivity  # each client's noise std
        if self.variant == "ldp_privunit" and not any(m.source == "PrivUnitRandomizer" and UPDATE in m.covers
                                                    for m in ctx.mechanisms):
            raise ConfigError("FedEXP.variant", "ldp_privunit", "no PrivUnitRandomizer sends the clients' norm "
                              "estimates (norm_sq_estimate) that the step size needs",
                              "add PrivUnitRandomizer(eps0, eps1, eps2) with UpdateClipping(C) before FedEXP, use "
                              "the preset LDPFedEXP(randomizer='privunit'), or use another variant")
        if self.variant == "cdp":
            self._z_update = self._update_multiplier(ctx)

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [MetricRelease("eta_g", "noised", "FedEXP", "the global step size, from noised sums")]

    def value_bound(self, *, segment: str, bound: float | None) -> float | None:
        if segment != "norm_sq":
            return bound
        if self._bound is not None and self.variant in ("cdp", "plain"):
            return self._bound() ** 2
        return None  # a noised update's squared norm has no useful bound: kept rows, two-pass sum

    # ------------------------------------------------------------------ a round
    def before_round(self, *, plan, server) -> None:
        if self.variant == "cdp":  # the clip norm of this round (an adaptive bound moves between rounds)
            self._round_xi_std = self._xi_std(self._z_update, self._bound())

    def on_client_end(self, *, client) -> None:
        if "norm_sq" in client.payload:  # after every other plugin: the clipped (and, LDP, noised) update
            u = client.payload[UPDATE]
            client.payload["norm_sq"].fill_(float(torch.linalg.vector_norm(u, dtype=torch.float64)) ** 2)

    def on_aggregate(self, *, server) -> None:
        if self.variant == "cdp":  # xi on the sum of squared norms: a central Gaussian release
            stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, XI_NOISE)
            stream.add_normal_(server.aggregate["norm_sq"], self._round_xi_std)

    def step_size(self, server) -> float:
        """``eta_g`` of this round (eqs. (2), (6), (7), (8))."""
        agg, c_bar = server.aggregate, server.update
        n = agg.denominator
        denom = float(torch.linalg.vector_norm(c_bar, dtype=torch.float64)) ** 2
        if self.variant == "ldp_privunit":
            numerator = agg.scalar("norm_sq_estimate") / n
        elif self.variant == "ldp_gaussian":  # the noise dimension: the trainable part
            numerator = agg.scalar("norm_sq") / n - frozen.count(server.plan.trainable, self._d) * self._sigma**2
        else:
            numerator = agg.scalar("norm_sq") / n  # cdp: xi is in the sum already
        if self.variant == "plain":
            k = 2.0 if self.half else 1.0
            return max(1.0, numerator / (k * (denom + self.eps))) if denom + self.eps > 0 else 1.0
        return max(1.0, numerator / denom) if denom > 0 else 1.0

    def on_server_update(self, *, server) -> None:
        eta = self.step_size(server)
        server.update.mul_(eta)
        self.eta_g.append(eta)
        if self.average_last == 2:
            self._previous = server.global_params.detach().clone()  # before this round's step

    def evaluation_params(self, *, params: torch.Tensor) -> torch.Tensor:
        if self.average_last == 2 and self._previous is not None:
            return (params + self._previous) / 2
        return params

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        metrics["eta_g"] = self.eta_g[-1] if self.eta_g else 1.0
