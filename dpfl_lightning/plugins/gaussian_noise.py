"""GaussianNoise: the Gaussian mechanism on client payload segments, in one of three placements.

Sensitivity comes from the bounding plugins before it (:class:`UpdateClipping` or
:class:`UpdateNormalization`, norm bound ``C`` of the segments it covers): the cohort's sum changes
by at most ``C`` when one client is added or removed (``2C`` when one is replaced). With
``noise_multiplier=z`` the standard deviation is ``sigma = z * C`` (with an adaptive bound, ``C``
of the current round).

Threat models (who must be trusted for the guarantee to hold):

``local``
    Each client adds ``N(0, sigma^2 I)`` to its own bounded contribution before it leaves the client
    (paper 000 Alg. 1 line 9). Guarantee towards the server and everyone else; nothing raw crosses
    the communicator.
``central``
    A trusted aggregator adds one draw ``N(0, sigma^2 I)`` to the sum of the bounded contributions
    (McMahan et al. 2018). Guarantee towards anyone who sees the models; the server sees raw
    updates. Amplified by client sampling.
``distributed``
    Each of the ``n`` clients of the round adds ``N(0, sigma^2 / n I)``, so the sum carries exactly
    ``N(0, sigma^2 I)``: the central guarantee without a trusted server, assuming secure
    aggregation hides individual (under-noised) contributions (paper 003 Alg. 1 line 12 adds
    ``zeta ~ N(0, r sigma_003^2 I)`` per client, i.e. this placement).

Draws come from the run's random source keyed by (seed, round, client, purpose), so they do not
depend on the number of ranks and two simulations with the same seed (say clipping vs
normalization) see the same noise -- which makes the noise a function of the logged seed. With
``FederatedTrainer(secure=True)`` they come from a CSPRNG keyed by a secret nobody logs, with the
floating-point mitigation of :mod:`dpfl_lightning.rng`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from dpfl_lightning import rng
from dpfl_lightning.federated import frozen
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.payload import UPDATE
from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, FederatedCallback
from dpfl_lightning.plugins.calibrated_noise import CalibratedNoise
from dpfl_lightning.privacy.mechanisms import PLACEMENTS, Mechanism
from dpfl_lightning.federated.releases import MetricRelease


#: a Gaussian coordinate exceeds this many standard deviations with probability below 1e-500
NOISE_TAIL = 50.0


def client_noise_std(std: float, placement: str, cohort: int) -> float:
    """The std each client adds for a mechanism of total std ``std``: all of it (``local``), a share
    ``std / sqrt(n)`` of the round's ``n`` clients (``distributed``: the shares sum to ``std``), none
    (``central``: the server adds it to the sum)."""
    if placement == "central":
        return 0.0
    return std if placement == "local" else std / math.sqrt(cohort)


def noised_value_bound(bound: float, client_std: float) -> float:
    """A bound on any value of a segment bounded by ``bound`` after a client adds noise of std
    ``client_std`` (up to :data:`NOISE_TAIL` standard deviations)."""
    return bound + NOISE_TAIL * client_std


#: noise multipliers outside this range are refused: below it epsilon is astronomically large (no
#: guarantee worth the name), above it the noise drowns any update and the accountants overflow
MULTIPLIER_RANGE = (1e-4, 1e6)


def check_noise_multiplier(owner: str, value: float | None, allow_infinite_epsilon: bool,
                           setting: str = "noise_multiplier") -> None:
    """Refuse a noise multiplier of 0 (epsilon = inf) unless the user says so explicitly, and one
    outside :data:`MULTIPLIER_RANGE`."""
    if value is None:
        return
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0,
            f"{owner}.{setting}", value, "must be a finite number >= 0", f"set {setting} to a positive number")
    lo, hi = MULTIPLIER_RANGE
    require(value <= hi, f"{owner}.{setting}", value,
            f"a noise multiplier above {hi:g} drowns every update (and overflows the accountants)",
            f"set {setting} in [{lo:g}, {hi:g}] (typical: 0.5 to 20)")
    require(value == 0 or value >= lo or allow_infinite_epsilon, f"{owner}.{setting}", value,
            f"a noise multiplier below {lo:g} gives no meaningful guarantee (epsilon in the millions)",
            f"set {setting} in [{lo:g}, {hi:g}] (typical: 0.5 to 20), or allow_infinite_epsilon=True to run "
            "without a guarantee knowingly")
    require(value > 0 or allow_infinite_epsilon, f"{owner}.noise_multiplier", value,
            "a noise multiplier of 0 adds no noise: epsilon is infinite, there is no DP guarantee",
            f"set noise_multiplier > 0, or {owner}(allow_infinite_epsilon=True) to run without noise knowingly")


class GaussianNoise(CalibratedNoise, FederatedCallback):
    """Add Gaussian noise to client contributions (``local`` / ``distributed``) or to their sum
    (``central``).

    Args:
        std: the standard deviation ``sigma``: per client for ``local``, of the total noise on the
            sum for ``central`` and ``distributed``. Give one of ``std``, ``noise_multiplier`` and
            ``target_epsilon``.
        noise_multiplier: ``z``; ``sigma = z * C`` with ``C`` the norm bound of the bounding plugins.
        target_epsilon / delta / accountant: calibrate ``z`` before training so that this
            mechanism's guarantee after ``trainer.rounds`` rounds is at most the target.
        placement: ``"local"``, ``"central"`` or ``"distributed"`` (see the module docstring).
        segments: the payload segments it noises (jointly; default ``["update"]``).
        allow_infinite_epsilon: accept ``noise_multiplier=0`` (no noise, no guarantee).
    """

    order = ORDER_ADD_NOISE

    def __init__(self, std: float | None = None, noise_multiplier: float | None = None,
                 placement: str = "central", target_epsilon: float | None = None, delta: float | None = None,
                 accountant: str = "rdp", segments: tuple[str, ...] | list[str] = (UPDATE,),
                 allow_infinite_epsilon: bool = False, secure: bool | None = None) -> None:
        given = {"std": std, "noise_multiplier": noise_multiplier, "target_epsilon": target_epsilon}
        require(sum(v is not None for v in given.values()) == 1, "GaussianNoise", given,
                "exactly one of std, noise_multiplier and target_epsilon must be set",
                "pass std=..., noise_multiplier=... or target_epsilon=... (with delta)")
        require(secure is None, "GaussianNoise.secure", secure, "secure randomness is one switch for the whole run "
                "(noise and sampling)", "set FederatedTrainer(secure=True) instead")
        self.check_target_epsilon("GaussianNoise", target_epsilon)
        require(delta is None or 0 < delta < 1, "GaussianNoise.delta", delta, "must be in (0, 1)",
                "set delta well below 1/num_clients")
        if std is not None:
            require(isinstance(std, (int, float)) and not isinstance(std, bool) and math.isfinite(std) and std >= 0,
                    "GaussianNoise.std", std, "must be a finite number >= 0", "set std to a non-negative value")
            require(std > 0 or allow_infinite_epsilon, "GaussianNoise.std", std, "std 0 adds no noise: no DP guarantee",
                    "set std > 0, or allow_infinite_epsilon=True to run without noise knowingly")
        check_noise_multiplier("GaussianNoise", noise_multiplier, allow_infinite_epsilon)
        require(placement in PLACEMENTS, "GaussianNoise.placement", placement, "unknown placement",
                f"use one of {', '.join(PLACEMENTS)}")
        require(len(segments) >= 1, "GaussianNoise.segments", segments, "noises nothing", "name payload segments")
        self.std = std
        self.noise_multiplier = noise_multiplier
        self.placement = placement
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.accountant = accountant
        self.segments = tuple(segments)
        # Noise of distinct mechanisms must be independent: with one stream per (round, client), two
        # instances on different segments would add the same draws, and their difference would
        # release the segments' difference un-noised.
        self._tag = ",".join(self.segments)
        self.allow_infinite_epsilon = allow_infinite_epsilon
        self._bound: Callable[[], float] | None = None
        self._cohort_size = 1
        self._empty = False

    @property
    def state_key(self) -> str:
        """One key per set of segments, so instances on different segments can run together."""
        return "GaussianNoise" if self.segments == (UPDATE,) else f"GaussianNoise[{self._tag}]"

    @property
    def sensitivity(self) -> float | None:
        """The current norm bound ``C`` of the covered segments (``None`` without a bound)."""
        return None if self._bound is None else self._bound()

    @property
    def sigma(self) -> float:
        """The standard deviation in force (see ``std``)."""
        if self.std is not None:
            return float(self.std)
        assert self._bound is not None, "setup() has not run"
        return float(self.noise_multiplier) * self._bound()

    def setup(self, *, ctx) -> None:
        self._bound = ctx.norm_bound(self.segments, before=self)
        if self._bound is None and self.std is None:
            raise ConfigError(f"GaussianNoise.{'target_epsilon' if self.target_epsilon else 'noise_multiplier'}",
                              self.target_epsilon or self.noise_multiplier,
                              f"a noise multiplier needs a norm bound on {list(self.segments)} to scale, and no "
                              "UpdateClipping or UpdateNormalization bounds them before the noise",
                              "add UpdateClipping(C) or UpdateNormalization(C) to the plugins, or give std=")
        moving = ctx.moving_bound(self.segments, before=self)
        if moving is not None and self.std is not None:
            raise ConfigError("GaussianNoise.std", self.std,
                              f"{moving} moves the norm bound C_t every round, so a fixed std's noise multiplier "
                              "std / C_t would move with it while the ledger accounts one multiplier",
                              "give noise_multiplier= (sigma_t = z C_t follows the bound) or target_epsilon=")
        if self.std is not None and self._bound is not None and self.std > 0:
            check_noise_multiplier("GaussianNoise", self.std / self._bound(), self.allow_infinite_epsilon, "std / C")
        if self.target_epsilon is not None:
            if self.delta is None:
                self.delta = ctx.privacy.default_delta("client")
            self.noise_multiplier = 1.0  # a placeholder: the run calibrates the composition (see `calibration`)

    @property
    def calibration(self) -> tuple[float, float, str] | None:
        """``(target_epsilon, delta, accountant)`` when the run must calibrate this plugin's noise
        multiplier (after every plugin's set-up, so that the target holds for the composition of
        every mechanism in its guarantee, e.g. with an adaptive clip's noisy count), else ``None``."""
        return None if self.target_epsilon is None else (self.target_epsilon, self.delta, self.accountant)

    def use_noise_multiplier(self, z: float) -> None:
        """Set the calibrated multiplier (``sigma = z C``)."""
        self.noise_multiplier = float(z)

    def on_fit_start(self, *, ctx) -> None:
        z = self.noise_multiplier if self.std is None else (self.std / self.sensitivity if self._bound else None)
        if ctx.is_global_zero:  # (calibrated by now: the warning names the target and the std it gave)
            self.warn_if_useless("GaussianNoise", z, self.sensitivity, "raise target_epsilon (or delta), sample more "
                                 "clients per round, or train fewer rounds (`dpfl privacy calibrate` shows the "
                                 "multiplier a plan needs)" if self.target_epsilon is not None else
                                 "lower std / noise_multiplier, or raise the clip norm")

    def _mechanism(self, z: float) -> Mechanism:
        c = self.sensitivity
        return Mechanism.gaussian("GaussianNoise", z * c, c, self.placement, self.segments)

    def privacy_mechanisms(self, *, ctx) -> list[Mechanism]:
        if self._bound is None:
            return []  # std without a norm bound: no DP statement can be made
        return [self._mechanism(self.sigma / self.sensitivity)]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        # snr is logged under central and distributed noise only, and declared whatever the placement: what
        # a plugin declares is read against what its code writes (dpfl_lightning.plugins.metric_keys)
        return [MetricRelease("noise_std", "public", "GaussianNoise", "the noise standard deviation in force"),
                MetricRelease("snr", "noised", "GaussianNoise", "signal-to-noise ratio of the aggregate, estimated "
                              "from the noised sum (central and distributed placement)")]

    def value_bound(self, *, segment: str, bound: float | None) -> float | None:
        if self.placement == "central" or segment not in self.segments or bound is None:
            return bound
        return noised_value_bound(bound, client_noise_std(self._round_sigma, self.placement, self._cohort_size))

    def before_round(self, *, plan, server) -> None:
        self._empty = len(plan.cohort) == 0
        self._cohort_size = max(len(plan.cohort), 1)
        self._round_sigma = self.sigma  # an adaptive bound may change during the round

    def on_client_end(self, *, client) -> None:
        if self.placement == "central":
            return
        std = client_noise_std(self._round_sigma, self.placement, self._cohort_size)
        stream = client.random.stream(client.round_idx, client.client, rng.CLIENT_NOISE, tag=self._tag)
        for name in self.segments:  # the update holds its trainable entries only: no noise on frozen ones
            stream.add_normal_(client.payload[name], std)

    def on_aggregate(self, *, server) -> None:
        # distributed: a round with no client gets the whole std from the server, so that the sum carries
        # sigma whoever took part; else a Poisson neighbour whose only sampled client is removed would
        # release an exact zero against the client's noised update (a delta of q (1-q)^(M-1) a round)
        if self.placement == "local" or (self.placement == "distributed" and not self._empty):
            return
        stream = server.random.stream(server.round_idx, rng.SERVER_CLIENT, rng.CENTRAL_NOISE, tag=self._tag)
        for name in self.segments:
            frozen.add_noise_(stream, server.aggregate[name], self._round_sigma,
                              server.plan.trainable if name == UPDATE else None)

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        metrics["noise_std"] = self._round_sigma
        if self.placement != "local" and server.aggregate is not None and self._round_sigma > 0:
            metrics["snr"] = self.signal_to_noise(server.aggregate, self._round_sigma, server.plan.trainable)

    def signal_to_noise(self, aggregate, sigma: float, trainable=None) -> float:
        """``||signal|| / (sigma sqrt(d))`` of the noised sum (paper 003 Fig. 3), estimated from the
        noised sum alone (``E||s + noise||^2 = ||s||^2 + d sigma^2``): post-processing of the release.
        ``d`` counts the noised entries (the trainable part of the update)."""
        sq = sum(float(torch.linalg.vector_norm(aggregate[n], dtype=torch.float64)) ** 2 for n in self.segments)
        d = sum(frozen.count(trainable if n == UPDATE else None, aggregate[n].numel()) for n in self.segments)
        return math.sqrt(max(sq - d * sigma * sigma, 0.0)) / (sigma * math.sqrt(d))
