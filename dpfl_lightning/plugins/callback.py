"""FederatedCallback: the base of every plugin, a set of typed no-op hooks.

The trainer calls the hooks of its plugins in ``order`` (lowest first; equal orders keep list
order). A round runs::

    before_round(plan, server)          edit the RoundPlan (local steps, batch sampling, lr); stop
    for each client of this rank:
        on_client_start(client)
        wrap_optimizer(client, optimizer)           each fresh local optimizer (DP-SGD)
        on_before_optimizer_step(client, optimizer) before every local step (control variates)
        on_client_end(client)               bound, noise, randomize ``client.payload`` in place
        on_client_released(client, released)  read what the client sent (state built from the release)
    one exact all-reduce of every segment of every client's payload
    on_aggregate(server)                noise on the sums (central), read extra sums
    on_server_update(server)            scale ``server.update`` (the mean update), control variates
    the server optimizer's step         the one place the global model moves
    evaluation
    on_round_end(server, metrics)       account, add metrics (declared in ``released_metrics``)

Hooks take keyword arguments only and receive narrow contexts (:mod:`dpfl_lightning.plugins.contexts`),
never the trainer. Set-up hooks declare what a plugin adds to a run: the payload segments it sends
(:meth:`payload_segments`), the DP mechanisms it runs (:meth:`privacy_mechanisms`) and the metrics
it logs (:meth:`released_metrics`). State a plugin keeps across rounds goes in :meth:`state_dict`;
checkpoints store it under :attr:`state_key`, so adding or removing a stateless plugin does not
break a resume. Per-client state goes in ``client.state`` (it lives with the client, on the rank
that trains it, and is checkpointed by client id); a plugin that keeps it sets
``keeps_client_state = True`` (see :mod:`dpfl_lightning.federated.placement`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dpfl_lightning.plugins.contexts import ClientContext, ServerContext, SetupContext
    from dpfl_lightning.federated.payload import Segment
    from dpfl_lightning.federated.plan import RoundPlan
    from dpfl_lightning.privacy.mechanisms import Mechanism
    from dpfl_lightning.federated.releases import MetricRelease

# Where a plugin runs relative to the others (exported by ``dpfl_lightning.plugins``). Sensitivity must
# be bounded before noise is added, and noise must be added before anything leaves the client or
# reaches the server optimizer.
ORDER_LOCAL_TRAINING = 40  # plugins that change how clients train (DP-SGD, control variates)
ORDER_BOUND_SENSITIVITY = 100  # clipping, normalization
ORDER_ADD_NOISE = 200  # Gaussian, correlated, discrete noise; local randomizers
ORDER_DEFAULT = 500  # a plugin that sets no order: after the noise, before the server's steps
ORDER_SERVER_STEP = 800  # global step sizes
ORDER_SERVER_OPTIMIZER = 900
ORDER_LEDGER = 950  # the privacy ledger: accounts the round once everything else ran


class FederatedCallback:
    """Base class of plugins. Every hook is a no-op; override the ones you need."""

    order: int = ORDER_DEFAULT
    #: True when the plugin keeps state in ``client.state`` across rounds: every client then trains
    #: on the rank that keeps its state (``client % ranks``) instead of a balanced placement.
    keeps_client_state: bool = False

    @property
    def state_key(self) -> str:
        """The key of this plugin's state in checkpoints (like Lightning's ``Callback.state_key``).
        Two plugins of the same class with state must override it."""
        return type(self).__qualname__

    # ------------------------------------------------------------------ set-up
    def configure_model(self, *, ctx: SetupContext, model: Any) -> Any:
        """Before the module is laid out over its flat buffer: return the model to train (the
        given one, changed in place, or a replacement)."""
        return model

    def setup(self, *, ctx: SetupContext) -> None:
        """Once, before the first round (and before the mechanisms are collected); validate here."""

    def payload_segments(self, *, ctx: SetupContext) -> list[Segment]:
        """The segments this plugin adds to every client's payload."""
        return []

    def privacy_mechanisms(self, *, ctx: SetupContext) -> list[Mechanism]:
        """The DP mechanisms this plugin runs (after ``setup``); every segment that leaves a client
        in a DP run must be covered by one."""
        return []

    def released_metrics(self, *, ctx: SetupContext) -> list[MetricRelease]:
        """The metrics this plugin adds in ``on_round_end``, and what kind of release each is (``source``:
        the plugin's class name). A DP run withholds a metric that is not declared; its set-up reads
        ``on_round_end``'s code and warns once, naming each such key (:mod:`~.metric_keys`)."""
        return []

    def value_bound(self, *, segment: str, bound: float | None) -> float | None:
        """The largest magnitude any value of payload ``segment`` can have, for any client, after
        this plugin's ``on_client_end``, given ``bound`` before it (``None``: unknown). Asked at the
        start of every round, in plugin order: bounding plugins return their norm bound, noise
        widens it by a Gaussian tail, a plugin that writes a segment gives its range. The exact
        aggregation fixes its grid from these in advance and streams (see
        :mod:`dpfl_lightning.federated.aggregation`)."""
        return bound

    def on_fit_start(self, *, ctx: SetupContext) -> None:
        """Before the first round of this ``fit`` call (also after a resume)."""

    def on_fit_end(self, *, ctx: SetupContext) -> None:
        """After the last round, also when training failed."""

    # ------------------------------------------------------------------ a round
    def before_round(self, *, plan: RoundPlan, server: ServerContext) -> None:
        """Before anything of the round happens: edit ``plan``; call ``server.stop(reason)`` to end
        training here (e.g. the privacy budget would be exceeded). Every rank sees the same plan."""

    def on_client_start(self, *, client: ClientContext) -> None:
        """This rank starts training ``client.client``; the model holds the global model."""

    def wrap_optimizer(self, *, client: ClientContext, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Each of the client's fresh local optimizers passes through here (DP-SGD wraps it)."""
        return optimizer

    def on_before_optimizer_step(self, *, client: ClientContext, optimizer: torch.optim.Optimizer) -> None:
        """Gradients of one local step are ready; a plugin may change them (control variates)."""

    def on_client_end(self, *, client: ClientContext) -> None:
        """The client finished: modify ``client.payload`` in place (clip, normalize, noise). Runs once
        per client and round; with ``client.skipped`` its update was not finite and was replaced by
        zeros before any plugin saw it (leave its per-client state as it was)."""

    def on_client_released(self, *, client: ClientContext, released: Mapping[str, torch.Tensor]) -> None:
        """What the client sent, after every plugin's ``on_client_end`` (every bound and noise, in any
        plugin order) and before it is added to the rank's sums: ``released`` holds exactly the row
        that is summed, by segment (with ``weighting="samples"`` the update times the ``weight``
        segment; a skipped client's noised zero update). Read-only: the mapping (also
        ``client.payload`` during this hook) refuses assignment and deletion with
        :class:`~dpfl_lightning.errors.ReleaseWriteError`, one line naming the plugin and the rule, and
        its tensors are copies, so writing into them changes nothing that is summed. Build per-client state that must follow the release here
        (SCAFFOLD's ``c_i``, ScaffNew's ``D_i``). Privacy: a segment is only as private as the
        mechanisms that cover it before it leaves the client (``central`` noise: the clipped,
        un-noised value the trusted aggregator sees); keep what you derive in ``client.state`` or
        plugin state, never print or log it. Called only when some plugin overrides it (the copies
        cost one row per client)."""

    def on_aggregate(self, *, server: ServerContext) -> None:
        """The cohort's sums are in ``server.aggregate``; modify them in place (central noise)."""

    def on_server_update(self, *, server: ServerContext) -> None:
        """``server.update`` is the mean update (float64): scale it in place (global step sizes) or
        apply it (server optimizer)."""

    def evaluation_params(self, *, params: torch.Tensor) -> torch.Tensor:
        """The flat parameters evaluation should see, given ``params`` (the global model, or what a
        plugin before chose): e.g. the average of the last two iterates (paper 002 App. G).
        Training continues from the global model."""
        return params

    def on_round_end(self, *, server: ServerContext, metrics: dict[str, float]) -> None:
        """The round is over; add what should be logged to ``metrics`` (declare it in
        :meth:`released_metrics`)."""

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state but the checkpoint has {sorted(state)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"
