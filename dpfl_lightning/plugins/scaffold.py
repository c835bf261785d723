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
  ``c <- c + (1/M) sum_{sampled} dc`` (line 20, ``c + l * mean dc`` with ``l = m/M``), so ``c`` stays
  the mean of all ``c_i`` under partial participation.

``c_i`` belongs to the client id: it lives in the client's state (on the rank that trains it,
checkpointed by id); ``c`` is this plugin's state.

Privacy: with :class:`~dpfl_lightning.plugins.DPSGD` every quantity that leaves a client -- ``dy``
and ``dc`` -- is a function of the DP-SGD-noised gradients and of public ``c`` (Claim 4.1 of paper
001): ``dc`` is a ``model`` segment, covered by the record-level mechanism, and costs no extra
privacy (the ledger reports the same epsilon as DP-SGD + FedAvg). With client-level DP instead,
clip ``update`` and ``dc`` jointly (``UpdateClipping(C, segments=["update", "dc"])``) and noise both.

``warm_start`` (DP-SCAFFOLD-warm, Sec. 3.3 of paper 001): the first ``warm_start_rounds`` rounds
(default ``ceil(M / m)``, enough for the expected cohort to have met every client once) do not
move the model: sampled clients compute ``K`` (noisy) gradients at ``x0`` with learning rate 0 and
set ``c_i^0`` to their mean, sent as ``dc``; the server sets ``c`` to the mean over all clients.
These rounds are rounds of the run: they count in ``trainer.rounds`` and the privacy ledger accounts
them like every other round (``K`` DP-SGD steps per participation).

Local training must be plain SGD (no momentum, no weight decay, one learning rate for every
parameter group) with one optimizer: the control-variate update reads the learning rate of every
step as its step size.

A client skipped because its update is not finite (``on_nonfinite="skip"``) sends ``dc = 0`` and
keeps the ``c_i`` it had before the round.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dpfl_lightning.errors import ConfigError, require
from dpfl_lightning.payload import Segment
from dpfl_lightning.plugins.base import ORDER_LOCAL_TRAINING, FederatedCallback
from dpfl_lightning.releases import MetricRelease


def check_plain_sgd(owner: str, optimizer: torch.optim.Optimizer) -> None:
    inner = getattr(optimizer, "original_optimizer", optimizer)
    ok = type(inner) is torch.optim.SGD and all(g.get("momentum", 0) == 0 and g.get("weight_decay", 0) == 0
                                                  for g in inner.param_groups)
    if not ok:
        raise ConfigError(owner, type(inner).__name__, "the control-variate update assumes plain SGD local steps "
                          "(no momentum, no weight decay)", "return torch.optim.SGD(params, lr=...) from "
                          "configure_optimizers")
    lrs = sorted({float(g["lr"]) for g in inner.param_groups})
    if len(lrs) > 1:
        raise ConfigError(owner, f"param group lrs {lrs}", "the control-variate update divides the whole update by "
                          "one step size", "give every parameter group the same learning rate")


class FlatGrads:
    """Adds a flat vector to the gradients of the parameters laid out over the module's buffer."""

    def __init__(self, parameters: list[torch.nn.Parameter], slices: list[tuple[int, int]]) -> None:
        self.pairs = list(zip(parameters, slices))

    def add_(self, vector: torch.Tensor) -> None:
        for p, (o, n) in self.pairs:
            if p.grad is not None:
                p.grad.add_(vector[o : o + n].view_as(p.grad))

    def accumulate_into(self, out: torch.Tensor) -> None:
        for p, (o, n) in self.pairs:
            if p.grad is not None:
                out[o : o + n].add_(p.grad.reshape(-1))


class SCAFFOLD(FederatedCallback):
    """SCAFFOLD / DP-SCAFFOLD control variates (see the module docstring).

    Args:
        warm_start: DP-SCAFFOLD-warm's initial control variates (the mean of ``K`` gradients at ``x0``).
        warm_start_rounds: rounds spent on it (default ``ceil(M / m)``).
    """

    order = ORDER_LOCAL_TRAINING + 1  # after DP-SGD: its optimizer is the one wrapped
    keeps_client_state = True  # c_i

    def __init__(self, warm_start: bool = False, warm_start_rounds: int | None = None) -> None:
        require(warm_start_rounds is None or warm_start_rounds >= 1, "SCAFFOLD.warm_start_rounds", warm_start_rounds,
                "must be >= 1", "leave it unset (ceil(M/m)) or give a positive number of rounds")
        self.warm_start = bool(warm_start)
        self.warm_start_rounds = warm_start_rounds
        self.c: torch.Tensor | None = None
        self._warm = 0

    def setup(self, *, ctx) -> None:
        require(not ctx.normalize_update_by_lr, "trainer.normalize_update_by_lr", True,
                "SCAFFOLD's c_i update (x - y_i) / (K eta_l) needs the raw model difference", "leave it False")
        require(ctx.sampler.kind != "poisson" or not self.warm_start, "SCAFFOLD.warm_start", True,
                "the warm start spreads clients over rounds of a fixed-size cohort", "use uniform or full sampling")
        self.num_clients = ctx.data.num_clients
        if self.warm_start and self.warm_start_rounds is None:
            self.warm_start_rounds = math.ceil(self.num_clients / ctx.sampler.expected_cohort)
        require(not self.warm_start or self.warm_start_rounds < ctx.rounds, "SCAFFOLD.warm_start_rounds",
                self.warm_start_rounds, f"the warm start would take all {ctx.rounds} rounds",
                "raise trainer.rounds or lower warm_start_rounds")
        if ctx.module is None:
            return
        self._grads = FlatGrads(ctx.module.parameter_list, ctx.module.parameter_slices)
        if self.c is None:
            self.c = torch.zeros(ctx.module.num_parameters, dtype=torch.float64, device=ctx.device)

    def payload_segments(self, *, ctx) -> list[Segment]:
        d = ctx.module.num_parameters if ctx.module is not None else 1
        return [Segment("dc", d, "model", "SCAFFOLD")]

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [MetricRelease("warm_start", "public", "SCAFFOLD", "1 during the warm-start rounds")]

    def _warming(self, round_idx: int) -> bool:
        return self.warm_start and round_idx < self.warm_start_rounds

    def before_round(self, *, plan, server) -> None:
        if self._warming(plan.round_idx):
            plan.lr_factor = 0.0  # gradients at x0: the model does not move

    def on_client_start(self, *, client) -> None:
        state = client.state
        if "c_i" not in state:
            state["c_i"] = torch.zeros_like(self.c)
        scratch = client.scratch
        scratch["scaffold_correction"] = (self.c - state["c_i"]).to(torch.float32)
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
        scratch, c_i, dc = client.scratch, client.state["c_i"], client.payload["dc"]
        if client.replay:  # a non-finite client is skipped: no control-variate change, c_i as before the round
            dc.zero_()
            before = scratch.pop("scaffold_c_i_before", None)
            if before is not None:
                c_i.copy_(before)
            return
        steps, lr_sum = scratch["scaffold_steps"], scratch["scaffold_lr_sum"]
        if self._warming(client.round_idx):
            new = scratch["scaffold_grads"] / max(steps, 1)  # c_i^0: the mean gradient at x0
        elif lr_sum > 0:
            # c_i+ = c_i - c + (x - y_K) / (K eta_l), with y_K - x the update
            new = c_i - self.c - client.payload["update"].double() / lr_sum
        else:  # no step moved the model: nothing to learn about the client's gradients
            new = c_i
        dc.copy_(new - c_i)
        if bool(torch.isfinite(dc).all()):
            # what the server adds up, so that c stays the mean of the c_i; undone on a replay (a
            # segment found non-finite after this plugin)
            scratch["scaffold_c_i_before"] = c_i.clone()
            c_i.add_(dc.double())

    def on_server_update(self, *, server) -> None:
        # after every on_aggregate (noise on dc, if any): c + l * mean dc = c + (1/M) sum dc
        self.c.add_(server.aggregate["dc"], alpha=1.0 / self.num_clients)
        if self._warming(server.round_idx):
            server.update.zero_()  # warm-start rounds only set the control variates

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        if self.warm_start:
            metrics["warm_start"] = float(self._warming(server.round_idx))

    def state_dict(self) -> dict[str, Any]:
        return {"c": None if self.c is None else self.c.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("c") is not None:
            device = self.c.device if self.c is not None else "cpu"
            self.c = state["c"].to(device)
