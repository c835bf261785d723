"""The communicator of a single process: every collective is the identity."""

from __future__ import annotations

from typing import Any

import torch

from dpfl_lightning.comm.communicator import Communicator


class LocalCommunicator(Communicator):
    """One process holds every client. Collectives return their input."""

    name = "local"

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def allreduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None
