"""ScaffNew (Mishchenko et al. 2022) and DP-ScaffNew (paper 000, Alg. 2).

Every client ``i`` holds a control variate ``h_i`` with ``sum_i h_i = 0``. Each local iteration is
``x_hat = x - eta (g - h_i)`` (line 6), and after it a coin shared by all clients, 1 with
probability ``p`` (line 3), decides whether they communicate. A round of this framework is the
stretch of iterations between two communications: its number of local steps is drawn from the
shared coin -- the number of flips up to the first 1, ``Geometric(p)`` -- through the round plan,
keyed by (seed, round) so that every client and every rank draws the same. On communication:

- each client sends ``D_i = clip(x_hat_i - x) + N(0, sigma^2 I)`` (line 8: the bounding and noise
  plugins, ``UpdateClipping`` and local ``GaussianNoise``);
- ``x <- x + mean D`` (line 9: the server optimizer, SGD with lr 1);
- ``h_i <- h_i + (p / eta)(mean D - D_i)`` with the *noisy* ``D_i`` (line 10), so that the ``h_i``
  keep summing to zero (up to float64 rounding: each update adds ``(p/eta)(N mean D - sum D_i)``).

Every client takes part in every round (Alg. 2 is full participation), and every client counts once
in the mean (``trainer.weighting="uniform"``): with weights the ``h_i`` would stop summing to zero.

Privacy. Each ``h_i`` follows the ``D_i`` the client sent, as it left the client (line 10 uses the
message ``Delta_t^(i)``), so it is as private as those messages (see
:mod:`~dpfl_lightning.plugins.control_variate_state`):

- ``local`` noise (Alg. 2's threat model, local DP towards the server): ``D_i`` is the local
  release, ``h_i`` a function of released ``D``s (post-processing, costs nothing), and checkpoints
  hold it by client id;
- ``distributed`` noise: ``D_i`` carries the client's own noise share, so the ``h_i`` still sum to
  zero, but the share is hidden by secure aggregation: checkpoints leave ``h_i`` out;
- ``central`` noise: ``D_i`` is clipped, not noised; the clients cannot know the aggregator's noise
  ``xi`` on the sum, so ``sum_i h_i`` moves by ``(p / eta) xi`` each round instead of staying zero,
  and ``h_i`` is the aggregator's un-noised view: checkpoints leave it out;
- DP-SGD inside the clients: ``D_i`` is a function of the noisy gradients; checkpoints hold ``h_i``.

A resumed run whose checkpoints leave the ``h_i`` out restarts every ``h_i`` at 0 (they sum to zero,
as Alg. 2 line 1 asks). The ledger accounts one release per communication, the rounds that
happened. Local training must be plain SGD.
"""

from __future__ import annotations

import math
import torch

from dpfl_lightning import rng
from dpfl_lightning.errors import require
from dpfl_lightning.federated.payload import UPDATE, full_update
from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, FederatedCallback
from dpfl_lightning.plugins.control_variate_state import (ClientVectors, FlatGrads, held_placement, print_privacy_line,
                                                          state_note)
from dpfl_lightning.plugins.setup_checks import check_plain_sgd, check_raw_model_difference, check_uniform_weighting
from dpfl_lightning.federated.releases import MetricRelease


def geometric_steps(u: float, p: float) -> int:
    """The number of coin flips up to and including the first 1, for a uniform ``u`` in [0, 1)."""
    if p >= 1.0:
        return 1
    return 1 + int(math.floor(math.log1p(-u) / math.log1p(-p)))


class ScaffNew(FederatedCallback):
    """ScaffNew / DP-ScaffNew's control variates and shared coin (see the module docstring).

    Args:
        p: the probability of communicating after a local step (paper 000: ``p* = sqrt(mu/L)``).
        max_local_steps: cap on one round's local steps (``None``: none); the cap changes the
            algorithm, so leave it unset to follow Alg. 2.
    """

    order = ORDER_ADD_NOISE + 50  # after DP-SGD (its optimizer is wrapped) and before the server steps
    keeps_client_state = True  # h_i

    def __init__(self, p: float, max_local_steps: int | None = None) -> None:
        require(isinstance(p, (int, float)) and 0 < p <= 1, "ScaffNew.p", p, "must be in (0, 1]",
                "set the communication probability p, e.g. sqrt(mu / L)")
        require(max_local_steps is None or max_local_steps >= 1, "ScaffNew.max_local_steps", max_local_steps,
                "must be >= 1", "leave it unset")
        self.p = float(p)
        self.max_local_steps = max_local_steps
        self.steps: list[int] = []
        self._h = ClientVectors("h")
        self._sent: dict[int, tuple[torch.Tensor, float]] = {}  # this round's D_i and step size, by client
        self._note: str | None = None

    @property
    def control_variates(self) -> dict[int, torch.Tensor]:
        """The ``h_i`` this rank has used in this ``fit``, by client (the others are 0)."""
        return dict(self._h.met)

    @property
    def privacy_note(self) -> str | None:
        """What the run's privacy statement says about ``h_i`` (``None`` without DP)."""
        return self._note

    def setup(self, *, ctx) -> None:
        check_uniform_weighting("ScaffNew", "the h_i sum to zero only if the server takes the plain mean of D_i", ctx)
        check_raw_model_difference("ScaffNew", "h_i update (p / gamma)(x - x_hat_i)", ctx)
        require(ctx.sampler.kind == "full", "trainer.sampling", ctx.sampler.kind,
                "ScaffNew (paper 000 Alg. 2) runs every client in every round", "leave clients_per_round unset")
        self.num_clients = ctx.data.num_clients
        if ctx.module is not None:
            from dpfl_lightning.module import parse_optimizers

            _, scheds = parse_optimizers(ctx.model.configure_optimizers())
            require(not scheds, "model.configure_optimizers", "an LR scheduler",
                    "ScaffNew's h_i update divides by the one step size gamma of every local step (paper 000 Alg. 2)",
                    "return a plain SGD optimizer without a scheduler (client_lr_decay changes gamma between rounds)")
            self._grads = FlatGrads(ctx.module.parameter_list, ctx.module.parameter_slices)
            self._d = ctx.module.num_parameters
            self._device = ctx.device

    def on_fit_start(self, *, ctx) -> None:
        held = held_placement(ctx.mechanisms, UPDATE) is not None
        self._h.reset(held, torch.zeros(self._d, dtype=torch.float64, device=self._device))
        self._sent = {}
        self._note = state_note("ScaffNew", "h_i", UPDATE, ctx.mechanisms, "0")
        print_privacy_line(ctx, self._note)

    def released_metrics(self, *, ctx) -> list[MetricRelease]:
        return [MetricRelease("local_steps", "public", "ScaffNew", "this round's steps, drawn from the shared coin")]

    def before_round(self, *, plan, server) -> None:
        u = server.random.stream(plan.round_idx, rng.SERVER_CLIENT, rng.COIN).uniform(1).item()
        steps = geometric_steps(u, self.p)
        if self.max_local_steps is not None:
            steps = min(steps, self.max_local_steps)
        plan.local_steps, plan.local_epochs = steps, None
        self._round_steps = steps

    def on_client_start(self, *, client) -> None:
        h = self._h.of(client.client, client.state)
        client.scratch["scaffnew_h"] = (-h).to(torch.float32)  # g - h_i

    def wrap_optimizer(self, *, client, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        check_plain_sgd("ScaffNew", optimizer)
        inner = getattr(optimizer, "original_optimizer", None)
        if inner is not None:  # DP-SGD: shift its noisy gradient
            inner.register_step_pre_hook(lambda opt, args, kwargs: self._grads.add_(client.scratch["scaffnew_h"]))
        client.scratch["scaffnew_dp"] = inner is not None
        return optimizer

    def on_before_optimizer_step(self, *, client, optimizer: torch.optim.Optimizer) -> None:
        if not client.scratch.get("scaffnew_dp"):
            self._grads.add_(client.scratch["scaffnew_h"])

    def on_client_released(self, *, client, released) -> None:
        # D_i as it leaves the client (after clipping and local noise or the noise share; a skipped
        # client's is its noised zero update), and the step size of this round, for the update of h_i
        self._sent[client.client] = (full_update(released["update"], client.plan.trainable).double(), client.lr)

    def on_server_update(self, *, server) -> None:
        mean = server.update  # mean D (the server optimizer applies it next)
        for c in server.my_clients:
            D, eta = self._sent.pop(c)
            self._h.of(c, server.client_state(c)).add_(mean - D, alpha=self.p / eta)  # line 10

    def on_round_end(self, *, server, metrics: dict[str, float]) -> None:
        metrics["local_steps"] = float(self._round_steps)
        self.steps.append(self._round_steps)
