"""Per-client state by client id (SCAFFOLD's ``c_i``, ScaffNew's ``h_i``): kept by the rank that owns
the client, written into checkpoints by id, restored by the owner."""

from __future__ import annotations

import warnings
from typing import Any

from lightning.fabric.utilities.apply_func import move_data_to_device

from dpfl_lightning.federated import placement
from dpfl_lightning.comm import Communicator
from dpfl_lightning.errors import ConfigError
from dpfl_lightning.federated.plan import RoundPlan


class ClientStates:
    """The states this rank keeps, ``by_client[c]``, and which clients it trains."""

    def __init__(self, comm: Communicator, keeps_state: bool) -> None:
        self.comm = comm
        self.keeps_state = keeps_state
        self.by_client: dict[int, dict[str, Any]] = {}
        self._warned_secure = False

    def owner(self, client: int) -> int:
        """The rank that keeps ``client``'s state (see :mod:`dpfl_lightning.federated.placement`)."""
        return placement.owner(client, self.comm.size)

    def of(self, client: int) -> dict[str, Any]:
        return self.by_client.setdefault(client, {})

    def my_clients(self, plan: RoundPlan, client_num_samples: Any) -> list[int]:
        """The clients of ``plan`` this rank trains: by id where per-client state lives, else a
        placement that balances the ranks' local steps."""
        size, rank = self.comm.size, self.comm.rank
        if size == 1:
            return list(plan.cohort)
        if self.keeps_state:
            return [c for c in plan.cohort if self.owner(c) == rank]
        work = [plan.steps_for(client_num_samples(c)) for c in plan.cohort]
        return placement.balanced(list(plan.cohort), work, size)[rank]

    def end_round(self, clients: list[int]) -> None:
        """Drop the empty states the round's contexts opened (an empty entry costs ~130 B for every
        client ever sampled: 130 MB for 10^6); refuse state no plugin declared."""
        for c in clients:
            if not self.by_client.get(c, True):
                del self.by_client[c]
        if self.keeps_state:
            return
        written = next((self.by_client[c] for c in clients if self.by_client.get(c)), None)
        if written:
            raise ConfigError("plugins", sorted(map(str, written)), "a plugin wrote client.state (per-client state "
                              "kept across rounds) but none declares keeps_client_state = True, so the client could "
                              "train on another rank next round, without its state",
                              "set keeps_client_state = True on the plugin class that keeps it")

    def gathered(self, secure: bool) -> dict[int, dict[str, Any]] | None:
        """Every rank's non-empty states, on rank 0 (every rank calls this); ``None`` elsewhere. Only
        clients with state: an empty entry would still say that the client took part once."""
        parts = self.comm.gather_object({c: s for c, s in self.by_client.items() if s}, root=0)
        if self.comm.rank != 0:
            return None
        states: dict[int, dict[str, Any]] = {}
        for part in parts:
            states.update(part)
        if secure and states and not self._warned_secure:
            self._warned_secure = True
            warnings.warn("secure mode: the checkpoints hold per-client state (e.g. SCAFFOLD's c_i) of the clients "
                          "that took part, so successive checkpoints reveal the cohorts that the guarantee keeps "
                          "secret: keep checkpoints as private as the clients' data", stacklevel=3)
        return states

    def restore(self, states: dict[int, dict[str, Any]], device: Any) -> None:
        """This rank's share of a checkpoint's states (checkpoints load on the CPU)."""
        self.by_client = {c: move_data_to_device(s, device) for c, s in states.items()
                          if self.owner(c) == self.comm.rank}
        if self.by_client and not self.keeps_state:
            warnings.warn("resume: the checkpoint holds per-client state, but no plugin of this run keeps any "
                          "(keeps_client_state); it is dropped", RuntimeWarning, stacklevel=3)
            self.by_client = {}
