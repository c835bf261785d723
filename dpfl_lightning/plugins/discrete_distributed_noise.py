"""DiscreteDistributedNoise: distributed DP as secure aggregation can run it -- integer noise shares,
sums modulo ``2^bits``, pairwise masks, dropouts.

Mechanisms: the distributed discrete Gaussian (Kairouz, Liu, Steinke, ICML 2021; exact sampler of
Canonne, Kamath, Steinke, NeurIPS 2020) or the Skellam mechanism (Agarwal, Kairouz, Liu, NeurIPS
2021); masks of SecAgg (Bonawitz et al., CCS 2017) or SecAgg+ (Bell et al., CCS 2020).

Stages of a client (after :class:`UpdateClipping` bounds its update by ``C``): clip to ``C`` again
(float64); rotate (randomized Walsh-Hadamard, padding to ``D``, a power of two, keyed by the round's
*public* key); divide by the granularity ``gamma``; unbiased randomized rounding, redone until the
integer vector's L2 norm is within Kairouz et al.'s inflated bound (so the sensitivity holds with
certainty; ``beta`` only sets how often a rounding is redone); add the client's noise share; reduce
modulo ``2^bits``; add the SecAgg masks (``secagg=True``). The row leaves the client as 16-bit
limbs in the payload segment ``integer_sum``; the client's float ``update`` segment is zeroed, so
the plain float aggregate carries nothing of it. A *dropped* client's row never reaches the sum.

Server: the limbs' exact sum (the trainer's all-reduce; bit-identical for any number of ranks,
:mod:`dpfl_lightning.comm.modular_sum`) back to residues modulo ``2^bits``; the dropped clients' masks
removed with the survivors' Shamir shares; signed integers times ``gamma``; the inverse rotation.
That estimate of the survivors' sum becomes the round's update sum before the server step; the
mean divides it by the trainer's denominator times ``1 - dropout`` (public constants).

Noise and threat model (audience ``client_distributed``: a server that sees only the modular sum;
every client in the sum added its share). ``noise_multiplier=z`` sets the total standard deviation
``sigma = z C`` of the noise in the sum. Each client adds a share of variance ``sigma^2 / m``, with
``m = min_survivors`` the fewest survivors a round tolerates: every round that runs has at least ``m``
shares in its sum, so at least the accounted noise (more shares are independent extra noise:
post-processing). A round with fewer survivors is skipped (``on_too_few="skip"``: nothing of it is
applied; the ledger still counts it) or stops the run (``"raise"``). The unit is one client's whole
update; the sensitivity is the rounding's bound (L2, and its L1 bound), in grid units; replace-one
doubles both. Accounting: Kairouz et al.'s RDP bound (with its ``tau`` term) for ``m`` discrete
Gaussians, or Agarwal et al.'s Skellam bound, as a :class:`~dpfl_lightning.privacy.discrete_accounting.DiscreteNoiseDpEvent`
that the ledger composes (per participation towards the server; per round towards model observers,
under zero-out neighbours: a client that is not in the sum takes its share with it, so add/remove's
neighbours differ in variance, and the share reveals the coin, so Poisson sampling amplifies by joint
convexity only -- :data:`~dpfl_lightning.privacy.accountants.RELATIONS`,
:func:`~dpfl_lightning.privacy.discrete_accounting.revealed_coin_rdp`).

Short rounds and hidden sampling: whether a round is short depends only on the cohort and the
dropout coins (keyed by seed, round and client), never on data. Under a fixed-size sampler
(``uniform``, ``cyclic``, ``full``) the survivors' count is Binomial(cohort size, ``1 - dropout``)
whoever is in the cohort, the same law for neighbouring datasets (add/remove or replace-one) and
independent of whether the target client was sampled: coupled on these data-independent coins, a
skip (or a stop) releases nothing about anyone, and a round that runs has at least ``m`` shares
whatever survivor set it runs with, so its curve holds for the mixture (joint convexity). These
samplers declare no stop probability and the ledger charges nothing.

Under Poisson sampling (and ``amplified_cyclic``) the cohort's *size* depends on whether the target
client is in the population (add/remove), and the guarantee towards model observers is amplified by
keeping the sampling hidden: a skipped round -- visible as a round where the model did not move --
reveals "the cohort was small", and at the threshold (``m - 1`` survivors without the client, ``m``
with it) the privacy loss of that bit is unbounded. So ``"skip"`` is refused under these samplers and
``on_too_few`` defaults to ``"raise"``: the run stops before anything of the short round is applied.
The stop is observable too, and it is accounted by the standard "bad event" argument
(:mod:`dpfl_lightning.privacy.guarantees`): with ``B`` the stop and ``I`` the ideal mechanism that
never stops (every round with at least ``m`` shares, as the ledger accounts), ``M'`` (this run) and
``I`` agree off ``B`` on the same coins, so ``P[M'(D) in S] <= P[I(D) in S] + P_D[B] <= e^eps P[I(D')
in S] + delta_I + P_D[B] <= e^eps P[M'(D') in S] + delta_I + P_D[B] + e^eps P_D'[B]``: ``M'`` is
``(eps, delta_I + (1 + e^eps) s)``-DP, ``s`` = :attr:`shortfall_bound` (rounds times :attr:`stop_per_round`,
the chance that a round has fewer survivors than ``min_survivors`` or than the SecAgg threshold --
the default strict majority of the cohort, or the holders of a SecAgg+ secret -- or a cohort under 2,
summed over the Binomial cohort sizes, for the population -- under ``amplified_cyclic``, every size
its groups have (``M`` split into ``ceil(M / clients_per_round)`` groups) -- and for the neighbours one
client smaller or larger: from the settings alone). The plugin declares ``stop_per_round`` as its mechanism's
``stop_probability``; the guarantees towards model observers (``client_distributed_models``, or
``client_central`` beside a central noise) report the least ``eps`` with ``eps >= eps_I(delta -
(1 + e^eps) s)``, and a run where none exists is refused at set-up. The guarantee towards the server
(``client_distributed``, per participation without amplification) is not charged: the server runs
SecAgg with the cohort, so it knows who took part and who dropped, the stop is a function of those,
and that guarantee already treats them as public (:mod:`dpfl_lightning.privacy.guarantees`' table).

The default ``min_survivors`` under these samplers is the largest ``m`` whose charge
``(1 + e^eps) s`` is at most :data:`~dpfl_lightning.privacy.guarantees.STOP_SHARE` (10%) of delta, with
``eps`` this mechanism's epsilon towards model observers at ``(1 - STOP_SHARE) delta`` after the
run's rounds -- with ``target_epsilon``, at the multiplier the calibration of its main guarantee
(towards the server) gives; ``target_epsilon`` itself would be a loose upper reference (e.g. 10
where the models guarantee is ~4, halving ``m``). ``m`` barely moves ``eps`` (the total noise
accounted is ``z C`` whatever ``m``), so the choice is iterated until ``m`` stays (once or twice).
``delta`` is the plugin's ``delta``, else the run's default; a ledger given a smaller delta, or other
mechanisms in the models guarantee, see a larger share (the ledger charges what is there either
way). Where the SecAgg threshold's stops alone (a strict majority of ~40 with 10% dropouts: ~7e-9 a
round) exceed the share, ``m`` cannot help: the default is then the largest ``m`` that adds at most
10% to them, with a warning. Fewer shares mean more noise in the sum when more clients survive
(each share has variance ``sigma^2 / m``): the price of a stop that is charged to delta. Under
fixed-size samplers the default is the ``1e-6`` quantile of the survivors' count (``"skip"``: nothing
is charged).

Pairings: the float ``update`` leaves every client as zeros, so a plugin that reads the released
update (SCAFFOLD's ``c_i`` and ``dc``, ScaffNew's ``D_i``, FedEXP's norms) would see zeros, and
another noise on the update would be on zeros or replaced by the decoded sum while still
accounted: each is refused at set-up (:meth:`DiscreteDistributedNoise.check_pairings`); an adaptive
clip is refused as a moving bound.

The modulus: ``gamma`` is the finest grid for which a coordinate of the sum of up to ``n_max``
clients (the cohort's size, or a ``1 - 1e-12`` quantile of it under Poisson sampling) leaves
``[-2^(bits-1), 2^(bits-1))`` with probability below ``wraparound_target`` (Chernoff bound from the
settings alone); :attr:`wraparound_rate` (per coordinate) and the round's union bound, logged as
``wraparound_bound``, are functions of the settings, never measured on clients' data. A bit width
that cannot hold the sum is refused.

Randomness: the noise from the client's ``CLIENT_NOISE`` stream (secure mode: the CSPRNG, with the
exact integer sampler -- no floating-point attack on the noise exists: the noise is an integer drawn
from its exact distribution), the rounding's coins from a stream of their own, dropouts keyed by
(seed, round, client), the rotation by (seed, round). Each rank holds the masks' secrets of the
clients it trains only, and the ranks run the protocol's exchanges in ``before_round`` (public
keys to every rank, each Shamir share to its holder's rank) and ``on_aggregate`` (the surviving
holders' reveals to every rank, each of which unmasks the same sum bit for bit), through the
server context's collectives (:meth:`~dpfl_lightning.comm.secagg.SecAggRound.exchange`). In
simulation mode the secrets are keyed by (seed, round, client) -- the run is the same on any number
of ranks, and the masks protect nothing towards who knows the seed (they reproduce the arithmetic,
failures and cost); in secure mode they are X25519 keys and seeds from the OS, drawn on the rank
that trains the client, in no log or checkpoint.
"""

from __future__ import annotations

import math
import time
import warnings

import torch
from scipy import stats

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.payload import UPDATE, Segment
from dpfl_lightning.federated.releases import MetricRelease
from dpfl_lightning.federated.short_rounds import cohort_law, group_sizes, stop_chance
from dpfl_lightning.federated.secure_sum import IntegerSumRound, IntegerSumSettings, StageTimes, row_length
from dpfl_lightning.plugins.calibrated_noise import CalibratedNoise
from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, FederatedCallback
from dpfl_lightning.plugins.gaussian_noise import check_noise_multiplier
from dpfl_lightning.privacy import discrete_accounting as da
from dpfl_lightning.privacy.accountants import epsilon
from dpfl_lightning.privacy.calibrate import calibrate_guarantee
from dpfl_lightning.privacy.guarantees import STOP_SHARE, guarantees, stop_penalty
from dpfl_lightning.privacy.mechanisms import Mechanism
from dpfl_lightning.privacy.quantization import padded_dim
from dpfl_lightning.plugins.sensitivity import required_update_bound

SEGMENT = "integer_sum"
ROTATION = rng.register_purpose("DiscreteDistributedNoise.rotation", private=False)  # public per-round key
ROUNDING = rng.register_purpose("DiscreteDistributedNoise.rounding")
COHORT_TAIL = 1e-12  # the cohort sizes the modulus is sized for: all but this tail
SURVIVOR_TAIL = 1e-6  # default min_survivors under fixed-size samplers: rounds skipped with at most this probability
HIDDEN_SIZE_SAMPLERS = ("poisson", "amplified_cyclic")  # the cohort's size is random and amplification hides it
FIX = "drop it, or use GaussianNoise(placement='distributed') (float shares) instead of DiscreteDistributedNoise"
FIXES = {"GaussianNoise": "use one noise on the update: DiscreteDistributedNoise alone (GaussianNoise on other "
                          "segments is fine)",
         "CorrelatedNoise": "use one noise on the update: DiscreteDistributedNoise or CorrelatedNoise",
         "PrivUnitRandomizer": "use one randomizer on the update: DiscreteDistributedNoise or PrivUnitRandomizer"}


def paired_reason(plugin) -> str | None:
    """Why ``plugin`` cannot run next to :class:`DiscreteDistributedNoise`, or ``None``."""
    from dpfl_lightning.plugins.correlated_noise import CorrelatedNoise
    from dpfl_lightning.plugins.fedexp import FedEXP
    from dpfl_lightning.plugins.gaussian_noise import GaussianNoise
    from dpfl_lightning.plugins.privunit_randomizer import PrivUnitRandomizer
    from dpfl_lightning.plugins.scaffnew import ScaffNew
    from dpfl_lightning.plugins.scaffold import SCAFFOLD

    if isinstance(plugin, SCAFFOLD):
        return ("SCAFFOLD builds each c_i from the dc and update the client released (on_client_released), and "
                "dc would leave un-noised outside the integer sum")
    if isinstance(plugin, ScaffNew):
        return "ScaffNew builds each D_i from the update the client released (on_client_released), which would be 0"
    if isinstance(plugin, FedEXP):
        return ("FedEXP's step size reads each client's update norm after the noise, which would be 0 (eta_g stuck "
                "at 1, or xi noise on nothing)")
    if isinstance(plugin, GaussianNoise) and UPDATE in plugin.segments:
        return ("GaussianNoise on the update would noise the zeroed float update or the sum the integer pipeline "
                "replaces: accounted noise that never reaches the model")
    if isinstance(plugin, (CorrelatedNoise, PrivUnitRandomizer)):
        return (f"{type(plugin).__name__} randomizes the update too; its output would be zeroed or replaced by the "
                "decoded sum while the ledger accounts it")
    return None


class DiscreteDistributedNoise(CalibratedNoise, FederatedCallback):
    """Integer noise shares summed modulo ``2^bits`` under secure aggregation (module docstring).

    Args:
        mechanism: ``"discrete_gaussian"`` or ``"skellam"``.
        noise_multiplier: ``z``: the noise in the sum has standard deviation ``z C`` a coordinate (at
            least ``min_survivors`` shares); or ``target_epsilon`` (with ``delta``, ``accountant``).
        bits: the modulus ``2^bits`` (1..62).
        beta: the conditional rounding's parameter (Kairouz et al.: ``exp(-1/2)``).
        secagg: mask the rows (SecAgg; ``neighbours=k``: SecAgg+'s k-regular graph; ``threshold``: t).
        dropout: each client's row is lost with this probability (keyed by seed, round, client).
        min_survivors: the fewest survivors a round tolerates (shares are sized for it); default
            under Poisson (and amplified cyclic) sampling the largest whose stop the ledger charges
            at most 10% of delta (module docstring), else the ``1e-6`` quantile of the survivors'
            count, from the sampler and ``dropout``.
        on_too_few: ``"skip"`` a round with fewer survivors, or ``"raise"``; default ``"raise"``
            under Poisson (and amplified cyclic) sampling, where ``"skip"`` is refused (module
            docstring: the skip would reveal the hidden cohort's size), ``"skip"`` otherwise.
        wraparound_target: the per-coordinate wrap-around probability ``gamma`` is chosen for.
    """

    order = ORDER_ADD_NOISE

    def __init__(self, mechanism: str = "discrete_gaussian", noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, delta: float | None = None, accountant: str = "rdp",
                 bits: int = 16, beta: float = math.exp(-0.5), secagg: bool = True, neighbours: int | None = None,
                 threshold: int | None = None, dropout: float = 0.0, min_survivors: int | None = None,
                 on_too_few: str | None = None, wraparound_target: float = 1e-9) -> None:
        require(mechanism in da.MECHANISMS, "DiscreteDistributedNoise.mechanism", mechanism, "unknown mechanism",
                f"use one of {da.MECHANISMS}")
        require((noise_multiplier is None) != (target_epsilon is None), "DiscreteDistributedNoise",
                {"noise_multiplier": noise_multiplier, "target_epsilon": target_epsilon},
                "exactly one of noise_multiplier and target_epsilon must be set", "pass noise_multiplier=... or "
                "target_epsilon=... (with delta)")
        check_noise_multiplier("DiscreteDistributedNoise", noise_multiplier, False)
        self.check_target_epsilon("DiscreteDistributedNoise", target_epsilon)
        require(isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 62,
                "DiscreteDistributedNoise.bits", bits, "must be an integer in 1..62", "use e.g. 16, 20 or 32")
        require(0 <= beta < 1, "DiscreteDistributedNoise.beta", beta, "must be in [0, 1)", "use exp(-0.5)")
        require(0 <= dropout < 1, "DiscreteDistributedNoise.dropout", dropout, "must be in [0, 1)", "use e.g. 0.1")
        require(min_survivors is None or (isinstance(min_survivors, int) and min_survivors >= 1),
                "DiscreteDistributedNoise.min_survivors", min_survivors, "must be an integer >= 1",
                "give the fewest survivors a round tolerates, or leave it unset")
        require(on_too_few in (None, "skip", "raise"), "DiscreteDistributedNoise.on_too_few", on_too_few,
                "unknown policy", "use 'skip' or 'raise'")
        require(0 < wraparound_target < 1, "DiscreteDistributedNoise.wraparound_target", wraparound_target,
                "must be in (0, 1)", "use e.g. 1e-9")
        self.mechanism, self.noise_multiplier, self.target_epsilon = mechanism, noise_multiplier, target_epsilon
        self.delta, self.accountant, self.bits, self.beta = delta, accountant, bits, beta
        self.secagg, self.neighbours, self.threshold, self.dropout = secagg, neighbours, threshold, dropout
        self.min_survivors, self.on_too_few, self.wraparound_target = min_survivors, on_too_few, wraparound_target
        self._bound = None
        self._round: IntegerSumRound | None = None
        self._skip = False
        self.stop_per_round = 0.0  # the chance a round is short (set-up; declared as the stop probability when hidden)
        self.shortfall_bound = 0.0
        self._hidden = False
        self.stage_seconds: list[StageTimes] = []  # per round on this rank (timing: never logged in a DP run)
        self.skipped_rounds: list[int] = []

    # ------------------------------------------------------------------ set-up
    def setup(self, *, ctx) -> None:
        require(ctx.weighting == "uniform", "trainer.weighting", ctx.weighting, "the secure sum is an unweighted "
                "sum of clients' rows", "use weighting='uniform' with DiscreteDistributedNoise")
        self._bound = required_update_bound(ctx, self, "DiscreteDistributedNoise", self.mechanism,
                                            "integer noise is sized to a norm bound on the update")
        moving = ctx.moving_bound((UPDATE,), before=self)
        if moving is not None:
            raise ConfigError("DiscreteDistributedNoise", moving, "the grid gamma and the modulus are fixed at set-up "
                              "for one norm bound, and this plugin moves it every round",
                              "use a fixed UpdateClipping(C) with DiscreteDistributedNoise")
        self._d = ctx.module.num_parameters if ctx.module is not None else ctx.num_parameters
        require(self._d is not None, "DiscreteDistributedNoise", "num_parameters", "the update's size is unknown",
                "give the model (or its parameter count) when planning")
        self._padded = padded_dim(self._d)
        trials, p = cohort_law(ctx.sampler)
        self._sizes = group_sizes(ctx.sampler)
        self._check_too_few_policy(ctx.sampler.kind)
        self._hidden = ctx.sampler.kind in HIDDEN_SIZE_SAMPLERS
        self._law = (trials, p)
        self._n_max = max(1, int(stats.binom.ppf(1 - COHORT_TAIL, trials, p))) if p < 1 else trials
        chosen = self.min_survivors is None
        if chosen:
            keep = p * (1 - self.dropout)
            self.min_survivors = trials if keep >= 1 else max(1, int(stats.binom.ppf(SURVIVOR_TAIL, trials, keep)))
        require(self.min_survivors <= trials, "DiscreteDistributedNoise.min_survivors", self.min_survivors,
                f"exceeds the largest cohort the sampler draws ({trials})", f"use min_survivors <= {trials}")
        if self.target_epsilon is not None:
            if self.delta is None:
                self.delta = ctx.privacy.default_delta("client")
            self.noise_multiplier = 1.0  # a placeholder: the run calibrates it (see `calibration`)
        self._configure()
        if chosen and self._hidden:
            self._choose_hidden_min_survivors(ctx)
        self.stop_per_round = self._stop_chance(self.min_survivors)
        self.shortfall_bound = min(1.0, ctx.rounds * self.stop_per_round)

    def _stop_chance(self, m: int) -> float:
        """:func:`stop_chance` with ``m`` shares; under a hidden-size sampler the largest over the
        cohort laws it draws from (every amplified-cyclic group size) and the add/remove neighbours,
        one client smaller or larger (all enter the bad-event argument; SecAgg+'s per-secret failures
        grow with the cohort)."""
        p = self._law[1]
        sizes = {n for g in self._sizes for n in ((g - 1, g, g + 1) if self._hidden else (g,)) if n >= 1}
        return max(stop_chance(m, n, p, self.dropout, self.secagg, self.threshold, self.neighbours) for n in sizes)

    def _models_epsilon(self, ctx, delta: float) -> float:
        """This mechanism's own epsilon towards model observers after the run's rounds, at the delta
        left after the stop's share (and secure mode's participation tail). With ``target_epsilon``:
        at the multiplier the run's calibration will give (this mechanism's main guarantee, towards
        the server, at the target), which leaves the placeholder multiplier in force again."""
        sampling = ctx.sampler.accounted()
        if self.target_epsilon is not None:
            def main(z: float):
                self.use_noise_multiplier(z)
                return guarantees(self.privacy_mechanisms(ctx=ctx), sampling)[0]

            base = main(1.0)
            z = calibrate_guarantee(main, lambda p: ctx.privacy.compositions(base, p, self.delta), self.target_epsilon,
                                    self.delta - ctx.privacy.tail(self.delta))
            self.use_noise_multiplier(z)
        g = next(g for g in guarantees(self.privacy_mechanisms(ctx=ctx), sampling) if g.audience == "models")
        eps = epsilon(g.release, ctx.rounds, delta * (1 - STOP_SHARE) - ctx.privacy.tail(delta)).epsilon
        if self.target_epsilon is not None:
            self.use_noise_multiplier(1.0)
        return eps

    def _choose_hidden_min_survivors(self, ctx) -> None:
        """The default ``min_survivors`` under a hidden-size sampler (module docstring): the largest
        ``m`` with ``(1 + e^eps) rounds stop(m) <= STOP_SHARE delta``, ``eps`` this mechanism's models
        epsilon at ``m`` (iterated until ``m`` stays, at most 4 times); where the SecAgg threshold's
        stops alone exceed that, the largest ``m`` that adds at most 10% to them (and a warning)."""
        delta = self.delta if self.delta is not None else ctx.privacy.default_delta("client")
        trials, floor = self._law[0], self._stop_chance(1)  # floor: the SecAgg threshold's stops alone
        for _ in range(4):
            eps = self._models_epsilon(ctx, delta)
            allowed = STOP_SHARE * delta / max(ctx.rounds, 1) / stop_penalty(eps, 1.0)
            allowed = max(allowed, floor * (1 + STOP_SHARE))  # m cannot go below the floor: add at most 10% to it
            lo, hi = 1, trials  # the largest m with stop(m) <= allowed (stop grows with m)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self._stop_chance(mid) <= allowed else (lo, mid - 1)
            if lo == self.min_survivors:
                break
            self.min_survivors = lo
            self._configure()
        if ctx.is_global_zero and stop_penalty(eps, ctx.rounds * floor) > STOP_SHARE * delta:
            warnings.warn(f"DiscreteDistributedNoise: under {ctx.sampler.kind} sampling the SecAgg threshold alone "
                          f"stops a round with probability {floor:.3g} (dropout={self.dropout:g}), so the stop's "
                          f"charge to the models guarantee, (1 + e^eps) x {ctx.rounds * floor:.3g} at eps ~ {eps:.3g}, "
                          f"is above {STOP_SHARE:.0%} of delta={delta:g} whatever min_survivors; fewer dropouts, more "
                          "noise or fewer rounds lower it (the ledger refuses the run where it exceeds delta)",
                          RuntimeWarning, stacklevel=2)

    def _check_too_few_policy(self, kind: str) -> None:
        """Default ``on_too_few`` by sampler; refuse ``"skip"`` where the sampling is hidden and random
        in size (module docstring)."""
        hidden = kind in HIDDEN_SIZE_SAMPLERS
        self.policy = self.on_too_few or ("raise" if hidden else "skip")
        if hidden and self.policy == "skip":
            raise ConfigError("DiscreteDistributedNoise.on_too_few", "skip", f"under {kind} sampling the cohort's "
                              "size depends on whether a client is in the population, and a skipped round reveals "
                              "that it was small, which the amplified guarantee assumes hidden (the ledger does not "
                              "account it)", "use on_too_few='raise' (the default here) with a min_survivors the "
                              "run meets with near certainty, or a fixed-size sampler (sampling='uniform')")

    def check_pairings(self, *, plugins: list, ctx) -> None:
        """Refuse, at set-up, the plugins that would read the zeroed float update or put noise on it
        that never reaches the sum (module docstring)."""
        for other in plugins:
            reason = paired_reason(other)
            if reason is not None:
                raise ConfigError("trainer.plugins", f"{type(other).__name__} with DiscreteDistributedNoise",
                                  f"{reason}; DiscreteDistributedNoise sends each client's update only as an "
                                  "integer row that the secure sum reveals summed, and zeroes the float update "
                                  "before it leaves the client", FIXES.get(type(other).__name__, FIX))

    def _configure(self) -> None:
        """The grid and the shares for the current noise multiplier (all public settings)."""
        c = self.clip
        self.local_std = self.noise_multiplier * c / math.sqrt(self.min_survivors)
        choice = da.choose_gamma(self.bits, c, self._n_max, self._padded, self.local_std, self.mechanism,
                                 self.wraparound_target)
        self.gamma = choice.gamma
        s2 = (self.local_std / self.gamma) ** 2
        self.noise_parameter = s2 if self.mechanism == "discrete_gaussian" else s2 / 2
        self.wraparound_rate = choice.wraparound_per_coordinate
        self.wraparound_round = choice.wraparound_any_coordinate
        # the accounting's share: sqrt of the parameter the sampler uses, rounded down (never above it)
        self._accounted_std = self.gamma * math.sqrt(s2) * (1 - 1e-12)

    @property
    def clip(self) -> float:
        """The norm bound ``C`` in force (set-up)."""
        assert self._bound is not None, "setup() has not run"
        return float(self._bound())

    @property
    def calibration(self) -> tuple[float, float, str] | None:
        return None if self.target_epsilon is None else (self.target_epsilon, self.delta, self.accountant)

    def use_noise_multiplier(self, z: float) -> None:
        self.noise_multiplier = float(z)
        self._configure()

    def settings(self) -> IntegerSumSettings:
        return IntegerSumSettings(self.mechanism, self.bits, self.gamma, self.beta, self.clip, self.noise_parameter,
                                  self.secagg, self.neighbours, self.threshold, self.dropout)

    def payload_segments(self, *, ctx) -> list[Segment]:
        return [Segment(SEGMENT, row_length(self.bits, self._padded), "model", "DiscreteDistributedNoise")]

    def curves(self) -> tuple[da.DiscreteRdp, da.DiscreteRdp]:
        """One round's RDP curves (add/remove, replace-one) of ``min_survivors`` shares."""
        add = da.round_rdp(self.mechanism, self.clip, self.gamma, self._padded, self.beta, self._accounted_std,
                           self.min_survivors)
        s = self._accounted_std / self.gamma
        if self.mechanism == "discrete_gaussian":
            rep = da.ddg_rdp(2 * add.l2, 2 * add.l1, s, self.min_survivors, self._padded)
        else:
            rep = da.skellam_rdp(2 * add.l2, 2 * add.l1, self.min_survivors * s * s / 2)
        return add, rep

    def privacy_mechanisms(self, *, ctx) -> list[Mechanism]:
        add, rep = self.curves()
        what = (f"{'distributed discrete Gaussian' if self.mechanism == 'discrete_gaussian' else 'Skellam'} noise "
                f"(z={self.noise_multiplier:.4g}, {self.min_survivors}+ shares, modulo 2^{self.bits}, "
                f"gamma={self.gamma:.3g})")
        return [Mechanism("DiscreteDistributedNoise", "client", "distributed", da.DiscreteNoiseDpEvent(add),
                          da.DiscreteNoiseDpEvent(rep), self.clip, (UPDATE, SEGMENT), what,
                          noise_multiplier=self.noise_multiplier,
                          stop_probability=self.stop_per_round if self._hidden else 0.0,
                          share_per_participant=True)]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [MetricRelease("noise_std", "public", "DiscreteDistributedNoise", "the accounted noise std in the sum"),
                MetricRelease("wraparound_bound", "public", "DiscreteDistributedNoise",
                              "bound on the chance that a coordinate of a round's sum wraps (settings alone)")]

    def value_bound(self, *, segment: str, bound: float | None) -> float | None:
        if segment == SEGMENT:
            return float((1 << 16) - 1)
        return bound  # the update segment leaves the client zeroed

    def on_fit_start(self, *, ctx) -> None:
        if ctx.is_global_zero:
            self.warn_if_useless("DiscreteDistributedNoise", self.noise_multiplier, self.clip,
                                 "raise target_epsilon, sample more clients per round, or train fewer rounds")

    # ------------------------------------------------------------------ a round
    def before_round(self, *, plan, server) -> None:
        t0 = time.perf_counter()
        dim = self._d if plan.trainable is None else int(plan.trainable.sum())
        key = server.random.key(plan.round_idx, rng.SERVER_CLIENT, ROTATION)
        mine = server.clients_on_rank(plan)  # the SecAgg secrets of these clients live on this rank only
        self._round = r = IntegerSumRound(self.settings(), plan.round_idx, tuple(plan.cohort), dim, server.random, key,
                                          local_clients=mine, allgather=server.allgather, alltoall=server.alltoall)
        need = max(self.min_survivors, r.secagg.threshold if r.secagg is not None else 1)
        self._skip = len(r.survivors) < need or (self.secagg and len(plan.cohort) < 2)
        if self._skip:
            if self.policy == "raise":
                raise RuntimeError(f"DiscreteDistributedNoise: round {plan.round_idx + 1} has fewer surviving clients "
                                   f"than the {need} it tolerates (min_survivors / the SecAgg threshold); nothing of "
                                   "it was applied. Fix: lower min_survivors or dropout, sample more clients, or (with "
                                   "a fixed-size sampler) set on_too_few='skip'")
            self.skipped_rounds.append(plan.round_idx)
        r.times.per_client["setup"] = time.perf_counter() - t0

    def on_client_end(self, *, client) -> None:
        r = self._round
        update = client.payload[UPDATE]
        if not self._skip:
            noise = client.random.stream(client.round_idx, client.client, rng.CLIENT_NOISE,
                                         tag="DiscreteDistributedNoise")
            coins = client.random.stream(client.round_idx, client.client, ROUNDING)
            limbs = r.client_row(client.client, update, noise, coins)
            if limbs is not None:
                client.payload[SEGMENT][: limbs.numel()].copy_(limbs)
        update.zero_()  # the float update never leaves the client

    def on_aggregate(self, *, server) -> None:
        agg = server.aggregate
        if self._skip:
            agg.denominator = 0.0  # nothing of this round is applied
            return
        total = self._round.decode_sum(agg[SEGMENT])  # collective: the ranks all-gather their reveals
        target = agg.sums[UPDATE]
        trainable = server.plan.trainable
        if trainable is None or total.numel() == target.numel():
            target.copy_(total)
        else:
            target.zero_()
            target[trainable] = total.to(target.dtype)
        agg.denominator *= 1.0 - self.dropout

    def summed_noise_variance(self) -> float | None:
        """The declared variance of one coordinate of the noise in this round's decoded sum (after
        :meth:`on_aggregate`), from public values only: the survivors' count (the server runs SecAgg
        with them) times one share's variance in grid units (the discrete Gaussian's exact variance,
        or Skellam's ``2 lam``) times ``gamma^2``; the rotation is orthogonal. None for a skipped round."""
        from dpfl_lightning.privacy.noise_whitening import share_variance

        if self._skip or self._round is None:
            return None
        shares = len(self._round.survivors)
        return shares * share_variance(self.mechanism, self.noise_parameter) * self.gamma ** 2

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        metrics["noise_std"] = self._accounted_std * math.sqrt(self.min_survivors)
        metrics["wraparound_bound"] = self.wraparound_round
        if self._round is not None:
            self.stage_seconds.append(self._round.times)
