"""CanaryClients: canary clients for an empirical privacy audit of a run, as it is configured.

A canary's update is a fixed random direction ``u_i`` (isotropic, unit norm) scaled far above the clip
bound in force, ``boost * C_t u_i`` (``boost = 100`` by default). The run's own plugins bound and noise
it as any update (this plugin runs after local training and before the bounding plugins:
``ORDER_BOUND_SENSITIVITY - 10``), so a clip that does not clip -- skipped for some clients, or at a
bound larger than the one declared -- lets ``100 C_t`` through and shows, and the noise the canary
meets is the noise the configuration really adds. Scores, one per threat model:

- ``final`` (only the final model is seen): ``cos(u_i, theta_T - theta_0)``;
- ``rounds`` (every round's model is seen): ``max_t cos(u_i, theta_t - theta_{t-1})``, the
  max-statistic of Andrew et al. (2024);
- ``messages`` (what the server sees, for local and distributed noise only): the sum over the rounds
  slot ``i`` took part in of ``<u_i, message_t> / C_t``, over the square root of their count. The
  message is the slot's own noised payload for local noise (read after the noise by
  :meth:`CanaryClients.message_reader`, a second plugin to add to the run, and summed over the cohort
  in a ``released`` payload segment, one value per canary) and the securely aggregated, noised sum
  for distributed noise. Its guarantee is the ledger's guarantee towards the server.

How canaries take part. ``canaries = m`` client ids, drawn once from the seed, are *canary slots*: they
never send their own data. Canary ``i`` lives on slot ``i`` and is *inserted* with probability 1/2
(a coin keyed by the seed; ``inserted="all"`` / ``"none"`` for the in and out worlds of a many-run
audit). An inserted canary's slot sends ``boost C_t u_i``; the slot of a canary left out sends a zero
update, or ``-boost C_t u_i`` when every client-level mechanism is local (the guarantee is then
replace-one towards the server, and the two messages are replace-one neighbours). Slots are sampled
like every client, by the run's sampler, so the population and sampling rate are exactly the ones the
ledger accounts. For the noised sum -- every noise placement -- a zero update is the same as an absent
client, so the worlds with and without canary ``i`` are neighbours under the ledger's relation. (A
plugin that also sends a statistic of the update's norm, such as adaptive clipping's count bit, sends
different bits in the two worlds: that bit is a mechanism the ledger accounts.) A slot's other
payload segments (e.g. SCAFFOLD's control-variate delta) are zeroed too.

Canaries inserted and left out give the one-run estimates of :mod:`dpfl_lightning.privacy.audit` (the
Gaussian fit of Andrew et al.) and the f-DP audits of :mod:`dpfl_lightning.privacy.audit_bounds`
(Mahloujifar et al.). They are logged as ``audit_eps_*`` (``noised`` releases: functions of the
released models and of the seed), the last round's in the run's summary and W&B.

Randomness: directions, coins and slots come from :class:`~dpfl_lightning.rng.RandomSource` of the
run's seed, keyed by (seed, canary), in simulation and in secure mode alike, so they do not depend on
the number of ranks, and the auditor (who knows the seed) knows them. A canary run trains a model
without the slots' data: use it to audit a configuration, not to ship its model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.payload import UPDATE, Segment, trainable_part
from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, ORDER_BOUND_SENSITIVITY, FederatedCallback
from dpfl_lightning.plugins.sensitivity import scale_to_norm_
from dpfl_lightning.privacy.audit import Estimate, LowerBound, gaussian_fit_estimate, one_run_lower_bound
from dpfl_lightning.privacy.audit_bounds import NOISE_BLOCKS, GdpBound, NoiseCheck, gdp_lower_bound, noise_check
from dpfl_lightning.privacy.guarantees import guarantees
from dpfl_lightning.federated.releases import MetricRelease

CANARY = rng.register_purpose("CanaryClients.canary")
INSERTIONS = ("random", "all", "none")
THREAT_MODELS = {"final": "only the final model is seen", "rounds": "every round's model is seen",
                 "messages": "the server sees the messages"}
MESSAGE = "canary_message"  # the payload segment of local message scores (one value per canary)
NOISE = "canary_noise"  # the payload segment of the canary messages' noise statistics (see CanaryMessages)
NOISE_CHECKS = {"sum": "noise in the released sum", "messages": "noise in each message"}
#: the noise check's level is its share of the audit's confidence divided by this (see :meth:`CanaryClients.noise_checks`)
NOISE_CHECK_STRICTER = 100
_CACHE_VALUES = 1 << 24  # directions kept in memory up to this many values (64 MiB); else redrawn each round


@dataclass(frozen=True)
class CanaryAudit:
    """The one-run estimates of one threat model (see :data:`THREAT_MODELS`)."""

    threat_model: str
    estimate: Estimate | None  # Gaussian fit (Andrew et al.); None without 2 inserted and 2 unseen canaries
    bound: LowerBound | None  # Steinke et al.; None unless canaries are inserted at random
    gdp: GdpBound | None = None  # Mahloujifar et al.'s Gaussian-DP bound; None unless inserted at random


class CanaryClients(FederatedCallback):
    """Insert canary clients and estimate epsilon from them (see the module docstring).

    Args:
        canaries: the number ``m`` of canaries (and of client ids that become canary slots; at most
            the number of clients).
        inserted: ``random`` (each canary with probability 1/2: the one-run audit), ``all`` or ``none``
            (the two worlds of a many-run audit).
        norm: the canaries' norm when no plugin bounds the update (with a bounding plugin:
            ``boost`` times the bound in force).
        boost: an inserted canary's norm over the bound in force, ``C_t`` (default 100: a clip that
            does not clip lets it through).
        delta: the delta of the estimates (default: the privacy ledger's default).
        confidence: joint confidence of the two lower bounds (each at ``1 - (1 - confidence) / 2``)
            and of each estimate's interval.
        every: compute and log the estimates every this many rounds, and after the last planned round.
    """

    order = ORDER_BOUND_SENSITIVITY - 10

    def __init__(self, canaries: int = 100, inserted: str = "random", norm: float | None = None,
                 delta: float | None = None, confidence: float = 0.95, every: int = 1, boost: float = 100.0) -> None:
        require(isinstance(canaries, int) and canaries >= 1, "CanaryClients.canaries", canaries, "must be >= 1",
                "set canaries to a positive number, e.g. 100")
        require(inserted in INSERTIONS, "CanaryClients.inserted", inserted, "unknown", f"use one of {INSERTIONS}")
        require(norm is None or (math.isfinite(norm) and norm > 0), "CanaryClients.norm", norm, "must be > 0",
                "leave it unset (the clip bound) or give a positive norm")
        require(delta is None or 0 < delta < 1, "CanaryClients.delta", delta, "must be in (0, 1)",
                "leave it unset (the ledger's) or set e.g. 1e-5")
        require(0 < confidence < 1, "CanaryClients.confidence", confidence, "must be in (0, 1)", "set e.g. 0.95")
        require(isinstance(every, int) and every >= 1, "CanaryClients.every", every, "must be >= 1", "set e.g. 1")
        require(math.isfinite(boost) and boost >= 1, "CanaryClients.boost", boost, "must be >= 1",
                "leave it at 100 (far above the clip bound) or give a factor >= 1")
        self.canaries = canaries
        self.inserted = inserted
        self.norm = norm
        self.delta = delta
        self.confidence = confidence
        self.every = every
        self.boost = boost
        self.opposite = False  # out-canaries send -update (local noise only: replace-one neighbours)
        self.messages: str | None = None  # "local", "distributed" or None: how message scores are read
        self.scores: dict[str, torch.Tensor] = {}  # threat model -> every canary's score so far
        self._initial: torch.Tensor | None = None

    # ------------------------------------------------------------------ set-up
    def setup(self, *, ctx) -> None:
        m, population = self.canaries, ctx.data.num_clients
        require(m <= population, "CanaryClients.canaries", m,
                f"every canary needs a client slot of its own and there are {population} clients",
                f"set canaries <= {population}")
        self._bounds = [get for _, segs, get in ctx.norm_bounds if UPDATE in segs]
        self._source = rng.RandomSource(ctx.seed)  # keyed by the seed in secure mode too: the auditor knows it
        slots = self._source.stream(0, rng.SERVER_CLIENT, CANARY, tag="slots").randperm(population)[:m]
        self._slot_of = {int(c): i for i, c in enumerate(slots.tolist())}
        coins = [self._source.stream(0, i, CANARY, tag="coin").uniform(1)[0] < 0.5 for i in range(m)]
        self.is_inserted = torch.tensor([{"random": bool(c), "all": True, "none": False}[self.inserted] for c in coins])

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        why = "canary estimates of epsilon: functions of the released models and of the seed"
        return [MetricRelease("audit_eps_*", "noised", "CanaryClients", why),
                MetricRelease("audit_noise_ratio_*", "noised", "CanaryClients", "the noise check's bound: a function "
                              "of the noised sum and of the canary slots' noised messages")]

    def on_fit_start(self, *, ctx) -> None:
        levels = {m.granularity for m in ctx.mechanisms}
        if levels and "client" not in levels:
            raise ConfigError("CanaryClients", "record-level DP", "record-level DP is not audited: canary clients "
                              "measure client-level privacy and this run's guarantee is per record (DP-SGD)",
                              "audit a configuration with client-level noise (UpdateClipping + GaussianNoise)")
        if not self._bounds and self.norm is None:
            raise ConfigError("CanaryClients.norm", None, "no UpdateClipping or UpdateNormalization bounds the update, "
                              "so there is no clip bound to scale the canaries to", "add a bounding plugin or set norm")
        client = [m for m in ctx.mechanisms if m.granularity == "client"]
        placements = {m.placement for m in client}
        self.opposite = placements == {"local"}
        self.messages = "local" if placements == {"local"} else "distributed" if placements == {"distributed"} else None
        self._delta = self.delta if self.delta is not None else self._ledger_delta(ctx)
        params = ctx.module.global_params
        if self._initial is None:  # a resumed run keeps the initial model of its checkpoint
            self._initial = params.detach().clone()
            self._max = torch.full((self.canaries,), -math.inf, dtype=torch.float64)
            self._message_sum = torch.zeros(self.canaries, dtype=torch.float64)
            self._message_count = torch.zeros(self.canaries, dtype=torch.float64)
            self.noise = {k: torch.zeros(2, NOISE_BLOCKS, dtype=torch.float64) for k in NOISE_CHECKS}
        self._initial = self._initial.to(params.device)
        self._previous = params.detach().clone()
        self._cached = self._block(0, self.canaries) if self.canaries * params.numel() <= _CACHE_VALUES else None

    @staticmethod
    def _ledger_delta(ctx) -> float:
        """The delta the privacy ledger reports at by default (see :class:`PrivacyLedger`)."""
        calibrated = ctx.privacy.calibrations
        if calibrated:
            return min(d for d, _ in calibrated)
        levels = {g.granularity for g in guarantees(ctx.mechanisms, ctx.sampler.accounted())} or {"client"}
        return min(ctx.privacy.default_delta(level) for level in levels)

    # ------------------------------------------------------------------ directions
    @property
    def slots(self) -> dict[int, int]:
        """Client id -> the canary living on it (a function of the seed and the number of clients)."""
        return dict(self._slot_of)

    def slot_of(self, client: int) -> int | None:
        """The canary living on client ``client``, or None."""
        return self._slot_of.get(client)

    def direction(self, canary: int) -> torch.Tensor:
        """Canary ``canary``'s unit direction (float32, on the model's device)."""
        return self._cached[canary] if self._cached is not None else self._block(canary, canary + 1)[0]

    def _block(self, lo: int, hi: int) -> torch.Tensor:
        """Unit directions of canaries ``lo .. hi-1`` as rows (float32, on the model's device)."""
        d = self._initial.numel()
        rows = [self._source.stream(0, i, CANARY, tag="direction").normal((d,), 1.0, dtype=torch.float64)
                for i in range(lo, hi)]
        block = torch.stack(rows)
        block /= torch.linalg.vector_norm(block, dim=1, keepdim=True)
        return block.to(device=self._initial.device, dtype=torch.float32)

    def _blocks(self):
        if self._cached is not None:
            yield self._cached
            return
        step = max(1, _CACHE_VALUES // self._initial.numel())
        for lo in range(0, self.canaries, step):
            yield self._block(lo, min(lo + step, self.canaries))

    # ------------------------------------------------------------------ a round
    def on_client_end(self, *, client) -> None:
        canary = self._slot_of.get(client.client)
        if canary is None:
            return
        for segment in client.payload.values():  # a slot sends nothing of its own
            segment.zero_()
        inserted = bool(self.is_inserted[canary])
        if inserted or self.opposite:
            update = client.payload[UPDATE]
            update.copy_(trainable_part(self.direction(canary), client.plan.trainable, update.numel()))  # as the update: no frozen entry
            scale_to_norm_([update], self.bound() * (self.boost if self._bounds else 1.0), only_if_above=False)
            if not inserted:
                update.neg_()

    def bound(self) -> float:
        """The clip bound in force (``norm`` without a bounding plugin)."""
        return min(get() for get in self._bounds) if self._bounds else self.norm

    def message_reader(self) -> CanaryMessages:
        """The plugin that reads each slot's noised message for the ``messages`` score under local
        noise: add it to the run's plugins next to this one."""
        return CanaryMessages(self)

    def _score_messages(self, server) -> None:
        """Add this round's message scores of the slots that took part (see the module docstring)."""
        if self.messages == "local" and MESSAGE in server.aggregate:
            values = server.aggregate[MESSAGE].double().cpu()
        elif self.messages == "distributed":
            update = server.aggregate[UPDATE].to(torch.float32)
            values = torch.cat([block @ update for block in self._blocks()]).double().cpu() / self.bound()
        else:
            return
        took_part = torch.zeros(self.canaries, dtype=torch.bool)
        for c in server.plan.cohort:
            i = self._slot_of.get(int(c))
            if i is not None:
                took_part[i] = True
        self._message_sum += torch.where(took_part, values, torch.zeros_like(values))
        self._message_count += took_part.double()

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        params = server.global_params.detach()
        moves = torch.stack([params - self._initial, params - self._previous], dim=1)  # [d, 2]
        norms = torch.linalg.vector_norm(moves, dim=0).clamp_min(torch.finfo(moves.dtype).tiny)
        cosines = torch.cat([block @ moves for block in self._blocks()]).double().cpu() / norms.double().cpu()
        self._max = torch.maximum(self._max, cosines[:, 1])
        self.scores = {"final": cosines[:, 0], "rounds": self._max.clone()}
        if server.aggregate is not None and NOISE in server.aggregate:
            self.noise["messages"] += server.aggregate[NOISE].double().cpu().reshape(2, NOISE_BLOCKS)
        if server.aggregate is not None and self.messages is not None:
            self._score_messages(server)
            self.scores["messages"] = self._message_sum / self._message_count.clamp_min(1.0).sqrt()
        self._previous.copy_(params)
        last = server.next_plan is None or server.next_plan() is None
        if last or (server.round_idx + 1) % self.every == 0:
            metrics.update(self.metrics())

    # ------------------------------------------------------------------ results
    def audit(self) -> dict[str, CanaryAudit]:
        """The estimates of both threat models from the scores so far."""
        out = {}
        ins = self.is_inserted.numpy()
        each = 1.0 - (1.0 - self.confidence) / len(self.scores)
        for name in self.scores:
            s = self.scores[name].numpy()
            estimate = bound = gdp = None
            if ins.sum() >= 2 and (~ins).sum() >= 2:
                estimate = gaussian_fit_estimate(s[ins], s[~ins], self._delta, self.confidence)
                if self.inserted == "random":  # the bounds need each canary in with probability 1/2
                    bound = one_run_lower_bound(s, ins, self._delta, each)
                    gdp = gdp_lower_bound(s, ins, self._delta, each)
            out[name] = CanaryAudit(name, estimate, bound, gdp)
        return out

    def noise_checks(self, confidence: float | None = None) -> dict[str, NoiseCheck]:
        """The chi-square test of the declared noise (:func:`~dpfl_lightning.privacy.audit_bounds.
        noise_check`) in the released sum (central, distributed, correlated and discrete noise, every
        round) and in the canary slots' messages (local noise), where they were read; each at
        ``confidence`` (default: ``confidence`` split between the two) made :data:`NOISE_CHECK_STRICTER`
        times stricter: a valid test still errs at its level (an honest run refuted at 1% is one of
        the shipped configs' seeds in a hundred), and noise 2x below reads a bound of ~0.5, far
        below 1 at any of these levels."""
        each = confidence if confidence is not None else 1.0 - (1.0 - self.confidence) / len(NOISE_CHECKS)
        each = 1.0 - (1.0 - each) / NOISE_CHECK_STRICTER
        out = {k: noise_check(v[0].numpy(), v[1].numpy(), each) for k, v in self.noise.items()}
        return {k: v for k, v in out.items() if v is not None}

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, a in self.audit().items():
            if a.estimate is not None:
                out.update({f"audit_eps_{name}": a.estimate.epsilon, f"audit_eps_{name}_low": a.estimate.low,
                            f"audit_eps_{name}_high": a.estimate.high})
            if a.bound is not None:
                out[f"audit_eps_lb_{name}"] = a.bound.epsilon
            if a.gdp is not None:
                out[f"audit_eps_gdp_{name}"] = a.gdp.epsilon
        for name, check in self.noise_checks().items():
            out[f"audit_noise_ratio_{name}"] = check.upper
        return out

    @property
    def delta_used(self) -> float:
        return self._delta

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        if self._initial is None:
            return {}
        return {"initial": self._initial.detach().cpu().clone(), "max": self._max.clone(),
                "message_sum": self._message_sum.clone(), "message_count": self._message_count.clone(),
                "noise": {k: v.clone() for k, v in self.noise.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._initial, self._max = state["initial"].clone(), state["max"].clone()
            zeros = torch.zeros(self._max.shape, dtype=torch.float64)
            self._message_sum = state.get("message_sum", zeros).clone()
            self._message_count = state.get("message_count", zeros).clone()
            empty = {k: torch.zeros(2, NOISE_BLOCKS, dtype=torch.float64) for k in NOISE_CHECKS}
            self.noise = {k: v.clone() for k, v in state.get("noise", empty).items()}


def block_squares(values: torch.Tensor, blocks: int = NOISE_BLOCKS) -> torch.Tensor:
    """``[sums of squares; counts]`` of ``blocks`` contiguous blocks of a flat vector (float64, [2, blocks])."""
    v = values.detach().reshape(-1).double()
    edges = [v.numel() * b // blocks for b in range(blocks + 1)]
    squares = torch.stack([v[lo:hi].square().sum() for lo, hi in zip(edges, edges[1:])]).cpu()
    counts = torch.tensor([hi - lo for lo, hi in zip(edges, edges[1:])], dtype=torch.float64)
    return torch.stack([squares, counts])


def _noised_entries(update: torch.Tensor, trainable: torch.Tensor | None) -> torch.Tensor:
    """The entries of an ``update`` segment the noise is added to (its trainable entries)."""
    return update if trainable is None or update.numel() != trainable.numel() else update[trainable]


class CanaryMessages(FederatedCallback):
    """Reads what the server sees, after every noise plugin (``ORDER_ADD_NOISE + 50``).

    - Message scores (local noise): each canary slot's score ``<u_i, message> / C_t``, sent in the
      ``released`` segment ``canary_message`` at the canary's index; the all-reduce sums them over the
      cohort, so the ``messages`` score is the same for any number of ranks.
    - The noise check (:func:`~dpfl_lightning.privacy.audit_bounds.noise_check`): ``||y_b||^2 /
      sigma_t^2`` and the number of entries of each block ``b`` of a released value ``y`` that the
      declared Gaussian noise of std ``sigma_t = z C_t`` covers: the noised sum every round (the
      central and distributed multipliers, ``z = sqrt(sum z_k^2)``), and each canary slot's noised
      message (local multipliers; sent in the ``released`` segment ``canary_noise``). Functions of
      the released values only; canary slots hold no data.
    - Correlated noise (:class:`~dpfl_lightning.plugins.correlated_noise.CorrelatedNoise`): the sum
      whitened with the declared strategy and std, ``(R^{-1} y)_t`` with ``R R^T = L D^2 L^T`` and
      ``D`` the rows' declared ``z sens C_t`` (:class:`~dpfl_lightning.privacy.noise_whitening.
      Whitener`: ``D^{-1} C y`` for a square ``C``), i.i.d. ``N(0, 1)`` under the declaration, on at
      most ``2^23 / T`` evenly spaced coordinates. A resumed run checks the rounds of segments it
      saw from their start only.
    - Discrete noise (:class:`~dpfl_lightning.plugins.discrete_distributed_noise.DiscreteDistributedNoise`):
      the decoded sum over the declared variance of its summed integer shares (survivors x one
      share's variance x ``gamma^2``; :meth:`~dpfl_lightning.plugins.discrete_distributed_noise.
      DiscreteDistributedNoise.summed_noise_variance`).

    Made by :meth:`CanaryClients.message_reader`."""

    order = ORDER_ADD_NOISE + 50

    def __init__(self, canaries: CanaryClients) -> None:
        self.canaries = canaries
        self._active = self._local = False
        self._z_local = self._z_sum = 0.0
        self._bound = 1.0
        self._correlated = self._discrete = None  # the noise plugins whose declared noise the sum check reads
        self._whitener = self._coords = None

    def check_pairings(self, *, plugins: list, ctx) -> None:
        """Not a refusal: finds the correlated and the discrete noise plugins on the update, whose
        declared noise is not one Gaussian of std ``z C_t`` a round (class docstring)."""
        from dpfl_lightning.plugins.correlated_noise import CorrelatedNoise
        from dpfl_lightning.plugins.discrete_distributed_noise import DiscreteDistributedNoise

        self._correlated = next((p for p in plugins if isinstance(p, CorrelatedNoise)), None)
        self._discrete = next((p for p in plugins if isinstance(p, DiscreteDistributedNoise)), None)

    def payload_segments(self, *, ctx) -> list[Segment]:
        placements = {m.placement for m in ctx.mechanisms if m.granularity == "client"}
        self._active = placements == {"local"}
        self._local = "local" in placements
        out = [Segment(MESSAGE, self.canaries.canaries, "released", "CanaryMessages")] if self._active else []
        return out + ([Segment(NOISE, 2 * NOISE_BLOCKS, "released", "CanaryMessages")] if self._local else [])

    def on_fit_start(self, *, ctx) -> None:
        gaussian = [m for m in ctx.mechanisms if m.granularity == "client" and UPDATE in m.covers and m.is_gaussian
                    and m.noise_multiplier]
        self._z_local = math.sqrt(sum(m.noise_multiplier ** 2 for m in gaussian if m.placement == "local"))
        self._z_sum = math.sqrt(sum(m.noise_multiplier ** 2 for m in gaussian
                                    if m.placement != "local" and m.stream is None))
        if self._correlated is not None and self._z_sum > 0:
            self._correlated = None  # two noises in one sum: neither is whitened alone, the sum is not checked
            self._z_sum = 0.0
        self._whitener = None

    def before_round(self, *, plan, server) -> None:
        self._bound = self.canaries.bound()  # the bound the round's noise is scaled to

    def on_client_end(self, *, client) -> None:
        canary = self.canaries.slot_of(client.client) if self._local else None
        if canary is None:
            return
        update = client.payload[UPDATE]
        if self._z_local > 0:
            sigma = self._z_local * self._bound
            stats = block_squares(_noised_entries(update, client.plan.trainable))
            stats[0] /= sigma * sigma
            client.payload[NOISE] += stats.reshape(-1).to(client.payload[NOISE])
        if self._active:
            direction = trainable_part(self.canaries.direction(canary), client.plan.trainable, update.numel())
            client.payload[MESSAGE][canary] = torch.dot(direction, update) / self.canaries.bound()

    def on_aggregate(self, *, server) -> None:
        if self._correlated is not None:
            self._whitened_sum(server)
            return
        if self._discrete is not None:
            self._discrete_sum(server)
            return
        agg = server.aggregate
        if self._z_sum <= 0 or agg is None or UPDATE not in agg or agg.num_clients == 0:
            return  # (no client: no distributed share was added; skipping a round only weakens the test)
        sigma = self._z_sum * self._bound
        stats = block_squares(_noised_entries(server.aggregate[UPDATE], server.plan.trainable))
        stats[0] /= sigma * sigma
        self.canaries.noise["sum"] += stats

    def _whitened_sum(self, server) -> None:
        """The correlated noise's check: this round's sum whitened (class docstring)."""
        from dpfl_lightning.privacy.noise_whitening import Whitener, coordinate_subset

        noise, agg, t = self._correlated, server.aggregate, server.round_idx - self._correlated.start
        if t == 0:  # a segment starts (the run, or a secure resume's restart): a new history
            self._whitener = Whitener(noise.strategy.inverse, noise.strategy.rows_per_round)
        w = self._whitener
        if w is None or w.round != t or agg is None or UPDATE not in agg:
            self._whitener = None  # a round not seen (a resume, a missing sum): the segment's history is gone
            return
        y = _noised_entries(agg[UPDATE], server.plan.trainable).reshape(-1)
        if t == 0:
            self._coords = coordinate_subset(y.numel(), max(NOISE_BLOCKS * 1024, (1 << 23) // noise.T))
        if self._coords is not None:
            y = y[self._coords.to(y.device)]
        scale = float(noise.noise_multiplier) * noise.sensitivity * self._bound  # declared: z sens C_t
        self.canaries.noise["sum"] += block_squares(w.next(y, scale))

    def _discrete_sum(self, server) -> None:
        """The discrete noise's check: the decoded sum over its declared summed-share variance."""
        agg, variance = server.aggregate, self._discrete.summed_noise_variance()
        if variance is None or agg is None or UPDATE not in agg:
            return  # a skipped round: no share was added
        stats = block_squares(_noised_entries(agg[UPDATE], server.plan.trainable))
        stats[0] /= variance
        self.canaries.noise["sum"] += stats
