"""ContributionCheck: a message-level test, in ``dpfl audit``, of what each client really adds to the sum.

The ledger's sensitivity rests on one premise: every client's contribution to the aggregate, as it
is summed (after any weighting, before the noise), has L2 norm at most the bound it declares --
the clip bound ``C_t`` in force (each bounding plugin's group of segments,
:attr:`~dpfl_lightning.plugins.contexts.SetupContext.norm_bounds`), times the weight the ledger
assumes, which is 1 (a DP run refuses ``trainer.weighting="samples"``: the sum is divided by a
public denominator). A contribution above it is a sensitivity the ledger does not account, whatever
the noise: a clip skipped for some clients, a clip at ``2C``, or weights ``n_i / mean n`` put on the
clipped updates. Canaries see such a bug only when one of them meets it (a canary in a slot with a
heavy weight); this check sees every client, every round, with no canary and no statistics.

Where it reads (``order = ORDER_ADD_NOISE - 1``):

- ``on_client_end``: each bounded group's joint norm after every bounding and weighting plugin
  placed before the noise, and before any noise;
- ``on_client_released``: the row exactly as it is summed (after every plugin), when no client-level
  noise is added on the client (central noise only: the row is then un-noised). With local or
  distributed noise the released row carries its noise and only the first reading applies (a
  weighting plugin placed after the noise is then not seen).

A contribution above its bound by more than :data:`TOLERANCE` (relative: the clip holds in float64
exactly, :func:`~dpfl_lightning.plugins.sensitivity.scale_to_norm_`) counts once per client and
round. The ranks' counts are summed each round (``server.allgather`` in ``on_aggregate``).

Threat model. The check runs inside the process, where the trusted aggregator (or the simulation)
holds the clients' rows anyway; it keeps two counters and nothing else (no norm, no client id). It
is made only by ``dpfl audit``, whose runs insert canaries and are not for release: the count of
contributions above the bound is a statistic of the clients' data, printed in an audit run only,
and zero in every run that does what its ledger states.
"""

from __future__ import annotations

from dpfl_lightning.plugins.callback import ORDER_ADD_NOISE, FederatedCallback
from dpfl_lightning.plugins.sensitivity import joint_norm

TOLERANCE = 1e-6  # relative: float rounding of a norm computed again, never a clip at (1 + 1e-6) C


class ContributionCheck(FederatedCallback):
    """Count the clients' contributions above their declared bound (see the module docstring)."""

    order = ORDER_ADD_NOISE - 1

    def __init__(self) -> None:
        self.over = 0  # contributions above the bound, all ranks, rounds so far
        self.checked = 0  # contributions checked, all ranks
        self._over = self._checked = 0  # this rank's, this round
        self._groups: list = []
        self._released = False
        self._flagged = False

    def setup(self, *, ctx) -> None:
        self._groups = [(tuple(segs), get) for _, segs, get in ctx.norm_bounds]
        self._weight = 1.0  # the weight the ledger assumes for every client (uniform weighting)

    def on_fit_start(self, *, ctx) -> None:
        placements = {m.placement for m in ctx.mechanisms if m.granularity == "client"}
        self._released = placements <= {"central"}  # the released row is un-noised

    def _above(self, payload) -> bool:
        return any(joint_norm([payload[s] for s in segs]) > get() * self._weight * (1.0 + TOLERANCE)
                   for segs, get in self._groups if all(s in payload for s in segs))

    def on_client_end(self, *, client) -> None:
        self._flagged = self._above(client.payload)
        self._over += self._flagged
        self._checked += 1

    def on_client_released(self, *, client, released) -> None:
        if self._released and not self._flagged and self._above(released):
            self._over += 1

    def on_aggregate(self, *, server) -> None:
        counts = server.allgather((self._over, self._checked))  # collective: every rank, every round
        self.over += sum(o for o, _ in counts)
        self.checked += sum(c for _, c in counts)
        self._over = self._checked = 0

    @property
    def refuted(self) -> bool:
        """Whether some contribution exceeded its declared bound."""
        return self.over > 0

    def state_dict(self) -> dict:
        return {"over": self.over, "checked": self.checked}

    def load_state_dict(self, state: dict) -> None:
        self.over, self.checked = int(state.get("over", 0)), int(state.get("checked", 0))

