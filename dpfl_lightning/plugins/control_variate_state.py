"""Where a control-variate plugin keeps each client's vector (SCAFFOLD's ``c_i``, ScaffNew's ``h_i``),
and whether checkpoints may hold it.

Checkpoints leave the process that trains: they are releases. Each client's vector is built from
the message the client sent (SCAFFOLD: its ``dc``; ScaffNew: its ``D_i``) as it left the client,
after every client-side plugin, so it is exactly as private as those messages. By the client-level
mechanisms on that segment:

- none (no DP, or DP-SGD inside the clients): the message is a function of DP-SGD's noisy
  gradients and public state (paper 001 Claim 4.1; record-level DP towards the server). The vector
  lives in ``client.state`` and checkpoints hold it by client id.
- ``local`` noise: the vector is a sum of the client's local releases (post-processing, covered by
  the local guarantee towards the server). Checkpoints hold it.
- ``central`` noise: the message is clipped but not noised (what the trusted aggregator sees);
  ``distributed`` noise: it carries only the client's own noise share, which secure aggregation
  hides. The plugin holds the vector on the rank that trains the client and checkpoints never see
  it; a resumed run restarts every client's vector from a released value (SCAFFOLD: the server's
  ``c``; ScaffNew: 0, which keeps ``sum_i h_i = 0``).
"""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console

HELD_PLACEMENTS = ("central", "distributed")


def client_level_placements(mechanisms: list, segment: str) -> set[str]:
    """The placements of the client-level mechanisms that cover payload ``segment``."""
    return {m.placement for m in mechanisms if m.granularity == "client" and segment in m.covers}


def held_placement(mechanisms: list, segment: str) -> str | None:
    """``central`` or ``distributed`` when a mechanism of that placement covers ``segment`` (a vector
    built from it must stay out of checkpoints), else ``None``."""
    placements = client_level_placements(mechanisms, segment)
    return next((p for p in HELD_PLACEMENTS if p in placements), None)


def state_note(owner: str, name: str, segment: str, mechanisms: list, restart: str) -> str | None:
    """The run's privacy line about the vector ``name`` built from ``segment`` (``None`` without DP)."""
    held = held_placement(mechanisms, segment)
    kept_out = f"so checkpoints leave {name} out; a resumed run restarts every client's {name} from {restart}"
    if held == "central":
        return (f"{owner} (central noise): each client's {name} follows its clipped {segment} before the "
                f"aggregator's noise (the trusted aggregator's view), {kept_out}")
    if held == "distributed":
        return (f"{owner} (distributed noise): each client's {name} follows the {segment} it sent, which carries "
                f"only its own noise share (hidden by secure aggregation), {kept_out}")
    if "local" in client_level_placements(mechanisms, segment):
        return (f"{owner} (local noise): each client's {name} is built from the {segment} it released (clipped and "
                f"locally noised); checkpoints hold it by client id, covered by the local guarantee towards the server")
    if mechanisms:
        return (f"{owner}: each client's {name} is a function of what it sent ({segment}), covered by the run's "
                f"record-level guarantee towards the server; checkpoints hold it by client id")
    return None


def print_privacy_line(ctx: Any, line: str | None) -> None:
    """Print ``line`` with the run's privacy statement (rank 0, when the trainer prints a summary)."""
    if line and ctx.is_global_zero and ctx.verbose:
        Console(stderr=True, soft_wrap=True).print(f"[bold]privacy[/bold]: {line}")


class ClientVectors:
    """One float64 vector per client (``c_i``, ``h_i``) of a plugin, kept where the threat model
    allows (see the module docstring): in ``client.state[key]`` (checkpointed by client id) or, when
    ``held``, by this object on the rank that trains the client (never checkpointed). A client met
    for the first time in this ``fit`` starts from ``start``."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.held = False
        self.start: torch.Tensor | None = None
        self.met: dict[int, torch.Tensor] = {}  # every vector this rank has used in this fit, by client

    def reset(self, held: bool, start: torch.Tensor) -> None:
        """At the start of a ``fit``: where the vectors live and what an unmet client starts from."""
        self.held, self.start, self.met = held, start, {}

    def of(self, client: int, state: dict[str, Any]) -> torch.Tensor:
        """Client ``client``'s vector (``state``: its ``client.state``), created at ``start``."""
        if self.held:
            if client not in self.met:
                self.met[client] = self.start.clone()
            return self.met[client]
        if self.key not in state:
            state[self.key] = self.start.clone()
        self.met[client] = state[self.key]
        return state[self.key]


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
