"""What plugin hooks receive: a set-up context, a client context and a server context.

Hooks get what they need to do their job and nothing else: a plugin never reaches into the trainer,
the executor or the module's privates, so the trainer can change without breaking plugins.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from dpfl_lightning.errors import ReleaseWriteError
from dpfl_lightning.federated.payload import Aggregate
from dpfl_lightning.federated.plan import RoundPlan
from dpfl_lightning.rng import RandomSource

if TYPE_CHECKING:
    from dpfl_lightning.data.module import FederatedDataModule
    from dpfl_lightning.module import FederatedLightningModule
    from dpfl_lightning.privacy.planning import PrivacyPlanner
    from dpfl_lightning.federated.sampling import ClientSampler


@dataclass
class SetupContext:
    """Everything fixed for a run, given to ``configure_model``, ``setup``, ``payload_segments``,
    ``privacy_mechanisms``, ``released_metrics``, ``on_fit_start`` and ``on_fit_end``.

    ``module`` and ``model`` are ``None`` when only the privacy of a configuration is planned
    (``dpfl privacy epsilon``): a plugin's ``setup`` must then not touch them.
    """

    module: FederatedLightningModule | None
    data: FederatedDataModule
    sampler: ClientSampler
    plan: RoundPlan  # the default plan of every round (before plugins edit it)
    rounds: int
    random: RandomSource
    privacy: PrivacyPlanner
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rank: int = 0
    world_size: int = 1
    verbose: bool = True
    weighting: str = "uniform"  # the trainer's client weighting ("uniform" or "samples")
    normalize_update_by_lr: bool = False  # clients send (local - global) / lr
    norm_bounds: list[tuple[int, tuple[str, ...], Callable[[], float]]] = field(default_factory=list)
    moving_bounds: list[tuple[int, tuple[str, ...], str]] = field(default_factory=list)  # (position, segments, owner)
    positions: dict[int, int] = field(default_factory=dict)  # id(plugin) -> its position in the plugin list
    mechanisms: list = field(default_factory=list)  # every declared mechanism, filled before the ledger's setup
    #: every plugin's mechanisms as declared now (the bounds of the coming round); the ledger checks
    #: each round that none has drifted from what it accounts
    redeclare: Callable[[], list] | None = None
    num_parameters: int | None = None  # the model's trainable parameter count when planning without a module

    @property
    def model(self) -> Any:
        return None if self.module is None else self.module.inner

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def seed(self) -> int:
        return self.random.seed

    @property
    def secure(self) -> bool:
        return self.random.secure

    def norm_bound(self, segments: tuple[str, ...], before: Any) -> Callable[[], float] | None:
        """The L2 bound on the joint norm of ``segments`` that the bounding plugins running before
        ``before`` enforce on every client, as a function (an adaptive bound changes every round):
        the root of the sum of squared bounds of every bounded group of segments that touches
        them; ``None`` if some segment is not bounded."""
        limit = self.positions.get(id(before), len(self.positions))
        touched = [(segs, c) for pos, segs, c in self.norm_bounds if pos < limit and set(segs) & set(segments)]
        if not set(segments) <= {s for segs, _ in touched for s in segs}:
            return None
        getters = [c for _, c in touched]
        return lambda: math.sqrt(sum(c() ** 2 for c in getters))

    def moving_bound(self, segments: tuple[str, ...], before: Any) -> str | None:
        """The name of a bounding plugin running before ``before`` whose bound on ``segments`` moves
        from round to round (an adaptive clip norm), or ``None`` when every bound is fixed."""
        limit = self.positions.get(id(before), len(self.positions))
        return next((owner for pos, segs, owner in self.moving_bounds if pos < limit and set(segs) & set(segments)),
                    None)


class ReleasedRow(Mapping):
    """What ``on_client_released`` receives (as ``released`` and as ``client.payload``): copies of the
    row as it is summed, by segment, read-only. Assigning or deleting a segment raises
    :class:`~dpfl_lightning.errors.ReleaseWriteError`, one line naming the plugin, the hook and the rule;
    writing into a tensor in place changes a copy only (nothing that is summed)."""

    def __init__(self, rows: Mapping[str, torch.Tensor]) -> None:
        self._rows = dict(rows)
        self.reader = "a plugin"  # the plugin whose on_client_released runs (named in the error)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._rows[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __setitem__(self, name: str, value: Any) -> None:
        raise ReleaseWriteError(self.reader, f"assigned released[{name!r}]")

    def __delitem__(self, name: str) -> None:
        raise ReleaseWriteError(self.reader, f"deleted released[{name!r}]")

    def __getattr__(self, name: str) -> Any:  # a dict's writing methods, which this mapping does not have
        if name in ("update", "pop", "popitem", "setdefault", "clear"):
            def refuse(*args: Any, **kwargs: Any) -> None:
                raise ReleaseWriteError(self.reader, f"called released.{name}()")
            return refuse
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"ReleasedRow({', '.join(self._rows)})"


@dataclass
class ClientContext:
    """One client in one round, given to ``on_client_start``, ``wrap_optimizer``,
    ``on_before_optimizer_step``, ``on_client_end`` and ``on_client_released``.

    ``payload`` holds the client's named segments (modify them in place in ``on_client_end``; in
    ``on_client_released`` it is the read-only release, the row that is summed);
    ``state`` is the client's own state, which lives on the rank that trains it and is
    checkpointed by client id. ``skipped`` is true when the client's update was not finite: it is
    replaced by zeros before any ``on_client_end`` runs, so plugins process (bound, noise) a zero
    update, once, and stateful plugins leave the client's state as it was.
    """

    client: int
    round_idx: int
    plan: RoundPlan
    random: RandomSource
    state: dict[str, Any]
    model: Any = None
    payload: dict[str, torch.Tensor] = field(default_factory=dict)
    num_samples: int = 0
    steps: int = 0
    lr: float = 0.0
    skipped: bool = False
    scratch: dict[str, Any] = field(default_factory=dict)  # plugins' working space for this client and round


    @property
    def update(self) -> torch.Tensor:
        return self.payload["update"]


@dataclass
class ServerContext:
    """The server side of one round, given to ``before_round``, ``on_aggregate``,
    ``on_server_update`` and ``on_round_end``. Identical on every rank.

    ``aggregate`` holds the cohort's sums by segment (after the all-reduce); ``update`` the mean
    update the server optimizer applies (``on_server_update``); ``global_params`` the flat global
    model. ``my_clients`` are the clients of this round that this rank trained, whose state
    ``client_state(c)`` gives (set once ``before_round`` is over; there, ``clients_on_rank(plan)``
    gives the clients of ``plan`` this rank will train, as the plan stands: a plugin after it that
    edits the cohort or the local work may move them).

    Exchanges between ranks, for the plugins whose server side needs what each rank's clients made
    (keys of a secure aggregation): ``allgather(obj)`` returns every rank's ``obj`` by rank, and
    ``alltoall(objs)`` sends ``objs[r]`` to rank ``r`` (one entry per rank) and returns what each
    rank sent this one, by rank; on one process they return ``[obj]`` and ``objs``. Both are
    **collective**: every rank must call them the same number of times, in the same order, in the
    same hook -- in ``before_round`` and ``on_aggregate`` (every rank runs them), never behind a
    rank- or client-dependent condition, or the ranks wait on each other for ever. What they carry
    travels between the ranks' processes: it is not released, but it is no secret from the ranks.
    """

    round_idx: int
    plan: RoundPlan
    random: RandomSource
    num_clients: int
    global_params: torch.Tensor | None = None
    aggregate: Aggregate | None = None
    update: torch.Tensor | None = None
    my_clients: list[int] = field(default_factory=list)
    client_state: Callable[[int], dict[str, Any]] | None = None
    stop: Callable[[str], None] | None = None
    next_plan: Callable[[], RoundPlan | None] | None = None  # the next round's default plan (None after the last)
    clients_on_rank: Callable[[RoundPlan], list[int]] = field(default=lambda plan: list(plan.cohort))  # (see above)
    allgather: Callable[[Any], list[Any]] = field(default=lambda obj: [obj])  # collective (see above)
    alltoall: Callable[[list[Any]], list[Any]] = field(default=lambda objs: list(objs))  # collective (see above)
