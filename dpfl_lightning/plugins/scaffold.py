"""SCAFFOLD control variates (Karimireddy et al. 2020), and DP-SCAFFOLD with DP-SGD clients
(paper 001, Noble et al., Alg. 1).

Round ``t`` with server model ``x`` and server control variate ``c``; client ``i`` holds ``c_i``:

- every local step is ``y <- y - eta_l (g + c - c_i)`` (Alg. 1 line 13, eq. (1)); with DP-SGD the
  correction is added to the *noisy* clipped gradient ``H~`` that Opacus produced;
- after ``K`` steps, ``c_i+ = c_i - c + (x - y_K) / (K eta_l)`` (line 14, option II of SCAFFOLD),
  with ``K`` the optimizer steps the client took (not its batches: with
  ``accumulate_grad_batches=k`` a step follows every ``k``-th batch) and ``K eta_l`` the sum of the
  learning rates of those steps (a step-interval lr scheduler or the client lr decay changes them),
  and the client sends ``(dy, dc) = (y_K - x, c_i+ - c_i)`` -- two named segments of the one
  all-reduce (``update`` and ``dc``);
- the server steps ``x <- x + eta_g mean(dy)`` (the server optimizer) and
  ``c <- c + (1/M) sum_{sampled} dc`` (line 20, ``c + l * mean dc`` with ``l = m/M``);
- the client sets ``c_i <- c_i + dc`` with the ``dc`` it *sent* (line 17, ``c_i = c_i+`` when
  nothing changes ``dc`` on its way), so ``c`` stays the mean of all ``c_i`` under partial
  participation.

Privacy. With :class:`~dpfl_lightning.plugins.DPSGD` every quantity that leaves a client -- ``dy``
and ``dc`` -- is a function of the DP-SGD-noised gradients and of public ``c`` (Claim 4.1 of paper
001): ``dc`` is a ``model`` segment, covered by the record-level mechanism, and costs no extra
privacy (the ledger reports the same epsilon as DP-SGD + FedAvg). With client-level DP, clip
``update`` and ``dc`` jointly (``UpdateClipping(C, segments=["update", "dc"])``) and noise both:
each client adds the ``dc`` it sent -- clipped and noised, read in ``on_client_released`` after
every plugin's ``on_client_end`` -- to ``c_i``, in any plugin order. By threat model (see
:mod:`~dpfl_lightning.plugins.control_variate_state`):

- ``local`` noise: ``c_i`` is the sum of the client's local releases, ``c = mean(c_i)`` exactly
  (to the aggregation's rounding), and checkpoints hold ``c_i`` by client id;
- ``distributed`` noise: ``c_i`` includes the client's own noise share, ``c = mean(c_i)``; the share
  is not a release, so checkpoints leave ``c_i`` out;
- ``central`` noise: a client cannot know the aggregator's noise, so ``c_i`` follows its clipped
  ``dc`` and ``c - mean(c_i)`` is the aggregator's noise on the ``dc`` sums divided by ``M`` (summed
  over the rounds); ``c_i`` is the aggregator's un-noised view and checkpoints leave it out.

A resumed run whose checkpoints leave ``c_i`` out restarts every client's ``c_i`` from the
checkpointed (released) ``c``, which keeps ``c = mean(c_i)``. A run whose client-level noise covers
the update but not ``dc`` is refused (``c`` would move the model with an un-noised sum).

``warm_start`` (DP-SCAFFOLD-warm, Sec. 3.3 of paper 001): the first ``warm_start_rounds`` rounds
(default ``ceil(M / m)``) do not move the model: their cohorts are the blocks of ``m`` clients of
one random permutation of the population (keyed by the run's random source: the same on every
rank, from the CSPRNG in secure mode), so the default meets every client exactly once; each
computes ``K`` (noisy) gradients at ``x0`` with learning rate 0 and sets ``c_i^0`` to their mean,
sent as ``dc``; the server sets ``c`` to the mean over all clients. These rounds count in
``trainer.rounds``. Accounting: the ledger counts each client's participations from the rounds'
cohorts, and the planner (calibration, secure mode's participation bound) knows that those rounds
meet a client at most once per pass. A fixed partition block is not a sampled cohort, so a guarantee
amplified by client sampling (client-level central or distributed noise towards model observers)
does not hold for those rounds: that combination is refused.

Local training must be plain SGD (no momentum, no weight decay, one learning rate for every
parameter group) with one optimizer: the control-variate update reads the learning rate of every
step as its step size.

A client skipped because its update is not finite (``on_nonfinite="skip"``) sends ``dc = 0`` (plus
its local noise or noise share) and keeps the ``c_i`` it had before the round (plus that noise).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpfl_lightning import rng
from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.federated.payload import UPDATE, Segment, full_update
from dpfl_lightning.plugins.callback import ORDER_LOCAL_TRAINING, FederatedCallback
from dpfl_lightning.plugins.control_variate_state import (ClientVectors, FlatGrads, client_level_placements, held_placement,
                                                          print_privacy_line, state_note)
from dpfl_lightning.plugins.scaffold_commit import SCAFFOLDCommit
from dpfl_lightning.plugins.setup_checks import check_plain_sgd, check_raw_model_difference
from dpfl_lightning.federated.releases import MetricRelease

WARM_COHORTS = rng.register_purpose("SCAFFOLD.warm_cohorts")  # the warm start's permutation of the population


class SCAFFOLD(FederatedCallback):
    """SCAFFOLD / DP-SCAFFOLD control variates (see the module docstring).

    Args:
        warm_start: DP-SCAFFOLD-warm's initial control variates (the mean of ``K`` gradients at ``x0``).
        warm_start_rounds: rounds spent on it (default ``ceil(M / m)``: every client exactly once;
            fewer rounds meet ``warm_start_rounds * m`` clients, the others start from ``c_i = 0``;
            more rounds start another pass over a fresh permutation).

    ``c_i`` follows the ``dc`` each client sent, after every bound and noise (``on_client_released``);
    ``commit`` (the former companion plugin) is a deprecated no-op.
    """

    order = ORDER_LOCAL_TRAINING + 1  # after DP-SGD: its optimizer is the one wrapped
    keeps_client_state = True  # c_i

    def __init__(self, warm_start: bool = False, warm_start_rounds: int | None = None) -> None:
        require(warm_start_rounds is None or warm_start_rounds >= 1, "SCAFFOLD.warm_start_rounds", warm_start_rounds,
                "must be >= 1", "leave it unset (ceil(M/m)) or give a positive number of rounds")
        self.warm_start = bool(warm_start)
        self.warm_start_rounds = warm_start_rounds
        self.c: torch.Tensor | None = None
        self._c_i = ClientVectors("c_i")
        self._note: str | None = None
        self._rounds_done = 0
        self._warm_perm: tuple[int, torch.Tensor] | None = None  # (pass, permutation)

    @property
    def commit(self) -> SCAFFOLDCommit:
        """Deprecated: a no-op plugin (warns). SCAFFOLD sets ``c_i <- c_i + dc`` with the ``dc`` each
        client sent itself, in ``on_client_released``; drop ``scaffold.commit`` from the plugins."""
        return SCAFFOLDCommit(self)

    @property
    def control_variates(self) -> dict[int, torch.Tensor]:
        """The ``c_i`` this rank has used in this ``fit``, by client (the others are at their start)."""
        return dict(self._c_i.met)

    @property
    def privacy_note(self) -> str | None:
        """What the run's privacy statement says about ``c_i`` (``None`` without DP)."""
        return self._note

    # ------------------------------------------------------------------ set-up
    def _warm_rounds(self, ctx) -> tuple[int, int]:
        """The warm start's rounds and the most times they meet a client ((0, 0) without it)."""
        if not self.warm_start:
            return 0, 0
        require(ctx.sampler.kind != "poisson", "SCAFFOLD.warm_start", True, "the warm start's cohorts are blocks of "
                "a fixed size m (partitions of the population)", "use uniform or full sampling")
        cover = math.ceil(ctx.data.num_clients / ctx.sampler.expected_cohort)  # rounds of one partition
        rounds = cover if self.warm_start_rounds is None else self.warm_start_rounds
        require(rounds < ctx.rounds, "SCAFFOLD.warm_start_rounds", rounds,
                f"the warm start would take all {ctx.rounds} rounds", "raise trainer.rounds or lower warm_start_rounds")
        return rounds, math.ceil(rounds / cover)

    def configure_model(self, *, ctx, model: Any) -> Any:
        # the first set-up hook: the planner must know the warm rounds before DP-SGD calibrates its noise
        if self.warm_start and ctx.sampler.kind != "poisson":
            ctx.privacy.meet_at_most(*self._warm_rounds(ctx))
        return model

    def setup(self, *, ctx) -> None:
        check_raw_model_difference("SCAFFOLD", "c_i update (x - y_i) / (K eta_l)", ctx)
        self.num_clients = ctx.data.num_clients
        self._cohort = int(ctx.sampler.expected_cohort)
        warm, times = self._warm_rounds(ctx)
        if warm and ctx.privacy.block_rounds != warm:  # planning without a model: no configure_model
            ctx.privacy.meet_at_most(warm, times)
        if self.warm_start:
            self.warm_start_rounds = warm
            self._cover = math.ceil(self.num_clients / self._cohort)
        if ctx.module is None:
            return
        self._grads = FlatGrads(ctx.module.parameter_list, ctx.module.parameter_slices)
        if self.c is None:
            self.c = torch.zeros(ctx.module.num_parameters, dtype=torch.float64, device=ctx.device)

    def on_fit_start(self, *, ctx) -> None:
        mechanisms = ctx.mechanisms
        at_clients = client_level_placements(mechanisms, "dc")
        require(at_clients or not client_level_placements(mechanisms, UPDATE), "SCAFFOLD", "dc",
                "client-level DP covers the update but not dc, whose un-noised sum would move c and the model",
                "bound and noise both: UpdateClipping(C, segments=['update', 'dc']) and GaussianNoise(..., "
                "segments=['update', 'dc'])")
        amplified = sorted({m.placement for m in mechanisms if m.granularity == "client"} - {"local"})
        require(not (self.warm_start and amplified), "SCAFFOLD.warm_start", True,
                f"client-level {'/'.join(amplified)} noise is accounted per round as amplified by client sampling, "
                "and the warm start's cohorts are blocks of one partition, not sampled",
                "use warm_start=False, local noise or DP-SGD clients")
        held = held_placement(mechanisms, "dc")
        require(not (ctx.secure and 0 < self._rounds_done < self.warm_start_rounds), "resume", self._rounds_done,
                "a secure run resumed inside the warm start would draw a fresh partition (its secret is not "
                "checkpointed) and could meet clients twice", "resume from a checkpoint after the warm start")
        self._c_i.reset(held is not None, self.c.clone() if held else torch.zeros_like(self.c))
        self._warm_perm = None
        self._note = state_note("SCAFFOLD", "c_i", "dc", mechanisms, "the checkpointed c")
        print_privacy_line(ctx, self._note)

    def payload_segments(self, *, ctx) -> list[Segment]:
        d = ctx.module.num_parameters if ctx.module is not None else 1
        return [Segment("dc", d, "model", "SCAFFOLD")]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [MetricRelease("warm_start", "public", "SCAFFOLD", "1 during the warm-start rounds")]

    # ------------------------------------------------------------------ a round
    def _warming(self, round_idx: int) -> bool:
        return self.warm_start and round_idx < self.warm_start_rounds

    def _warm_cohort(self, server, round_idx: int) -> tuple[int, ...]:
        """Round ``round_idx``'s warm-start cohort: block ``round_idx mod ceil(M/m)`` of ``m`` clients (the
        last may be smaller) of a random permutation of the population, a fresh one per pass."""
        passed, block = divmod(round_idx, self._cover)
        if self._warm_perm is None or self._warm_perm[0] != passed:
            perm = server.random.stream(passed, rng.SERVER_CLIENT, WARM_COHORTS).randperm(self.num_clients)
            self._warm_perm = (passed, perm)
        members = self._warm_perm[1][block * self._cohort : (block + 1) * self._cohort]
        return tuple(sorted(int(c) for c in members))

    def before_round(self, *, plan, server) -> None:
        if self._warming(plan.round_idx):
            plan.lr_factor = 0.0  # gradients at x0: the model does not move
            plan.cohort = self._warm_cohort(server, plan.round_idx)  # the ledger accounts this cohort

    def on_client_start(self, *, client) -> None:
        c_i = self._c_i.of(client.client, client.state)
        scratch = client.scratch
        scratch["scaffold_correction"] = (self.c - c_i).to(torch.float32)
        scratch["scaffold_grads"] = torch.zeros_like(self.c) if self._warming(client.round_idx) else None
        scratch["scaffold_steps"] = 0  # K: the optimizer steps taken
        scratch["scaffold_lr_sum"] = 0.0  # K eta_l: the sum of their learning rates

    def wrap_optimizer(self, *, client, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        check_plain_sgd("SCAFFOLD", optimizer)
        scratch = client.scratch
        if scratch.get("scaffold_wrapped"):
            raise ConfigError("SCAFFOLD", "several local optimizers", "the control-variate update counts the steps "
                              "and step sizes of one optimizer over all parameters",
                              "return one torch.optim.SGD over all parameters from configure_optimizers")
        scratch["scaffold_wrapped"] = True
        inner = getattr(optimizer, "original_optimizer", None)
        if inner is not None:  # DP-SGD: the noisy clipped gradient is in .grad once its step calls this one
            if scratch["scaffold_grads"] is None:
                inner.register_step_pre_hook(lambda opt, args, kwargs: self._grads.add_(scratch["scaffold_correction"]))
        scratch["scaffold_dp"] = inner is not None
        warm = scratch["scaffold_grads"]

        def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            # runs only for a step that happened (not for a batch that only accumulated, nor for a
            # step the loss scaler skipped), with the learning rate that step used
            scratch["scaffold_steps"] += 1
            scratch["scaffold_lr_sum"] += float(opt.param_groups[0]["lr"])
            if warm is not None:  # warm start: the mean of the (noisy) gradients at x0
                self._grads.accumulate_into(warm)

        (inner or optimizer).register_step_post_hook(after_step)
        return optimizer

    def on_before_optimizer_step(self, *, client, optimizer: torch.optim.Optimizer) -> None:
        scratch = client.scratch
        if not scratch.get("scaffold_dp") and scratch["scaffold_grads"] is None:
            self._grads.add_(scratch["scaffold_correction"])  # g + c - c_i

    def on_client_end(self, *, client) -> None:
        scratch, dc = client.scratch, client.payload["dc"]
        c_i = self._c_i.of(client.client, client.state)
        if client.skipped:  # its update was not finite: it sends dc = 0 (noised, if noise follows), c_i kept
            dc.zero_()
            return
        steps, lr_sum = scratch["scaffold_steps"], scratch["scaffold_lr_sum"]
        if self._warming(client.round_idx):
            new = scratch["scaffold_grads"] / max(steps, 1)  # c_i^0: the mean gradient at x0
        elif lr_sum > 0:
            # c_i+ = c_i - c + (x - y_K) / (K eta_l), with y_K - x the update
            new = c_i - self.c - full_update(client.payload["update"], client.plan.trainable).double() / lr_sum
        else:  # no step moved the model: nothing to learn about the client's gradients
            new = c_i
        dc.copy_(new - c_i)

    def on_client_released(self, *, client, released) -> None:
        """``c_i <- c_i + dc`` with the ``dc`` the client sent, after every bound and noise (line 17:
        what the server adds to ``c``); a skipped client adds what its zero ``dc`` carries (its noise,
        if any), as the server does. A non-finite ``dc`` (a plugin wrote it) is not committed: the
        aggregation refuses the round."""
        dc = released["dc"]
        if not bool(torch.isfinite(dc).all()):
            return
        self._c_i.of(client.client, client.state).add_(dc.double())

    def on_server_update(self, *, server) -> None:
        # after every on_aggregate (noise on dc, if any): c + l * mean dc = c + (1/M) sum dc
        self.c.add_(server.aggregate["dc"], alpha=1.0 / self.num_clients)
        if self._warming(server.round_idx):
            server.update.zero_()  # warm-start rounds only set the control variates

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        if self.warm_start:
            metrics["warm_start"] = float(self._warming(server.round_idx))
        self._rounds_done = server.round_idx + 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"c": None if self.c is None else self.c.detach().cpu().clone(), "rounds": self._rounds_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("c") is not None:
            device = self.c.device if self.c is not None else "cpu"
            self.c = state["c"].to(device)
        self._rounds_done = int(state.get("rounds", 0))
