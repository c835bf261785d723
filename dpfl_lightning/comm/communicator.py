"""What the trainer needs from whatever connects the ranks."""

from __future__ import annotations

from typing import Any

import torch


class Communicator:
    """Collectives over the ranks of one job. Every rank calls every method in the same order.

    Tensors are reduced in place. A communicator never sees a client's update on its own: the
    trainer hands it the rank's sum of already clipped / noised contributions (see
    :mod:`dpfl_lightning.comm.exact_sum`).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    name: str = "base"

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def allreduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with ``root``'s (in place)."""
        raise NotImplementedError

    def allgather_object(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``root`` (``None`` elsewhere)."""
        raise NotImplementedError

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (used when one rank fails, so the others do not hang)."""
        raise SystemExit(code)

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Release resources (process groups); the default has none."""
