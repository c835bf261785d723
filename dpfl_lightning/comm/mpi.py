"""mpi4py communicator: in-place ``Allreduce`` on the tensors the trainer already holds.

mpi4py 4 reads CPU tensors through the buffer protocol, so the reduction runs on the tensor's own
memory, without a copy. The MPICH wheel from PyPI is not CUDA-aware: CUDA tensors are staged
through one pinned host buffer per dtype (reused across rounds). For GPU jobs prefer
:class:`~dpfl_lightning.comm.torch_dist.TorchDistCommunicator` (NCCL), bootstrapped from MPI.
"""

from __future__ import annotations

from typing import Any

import torch

from dpfl_lightning.comm.communicator import Communicator


def _mpi():
    from mpi4py import MPI  # imported lazily: a single-process run needs no MPI library

    return MPI


class MPICommunicator(Communicator):
    """All ranks of ``MPI.COMM_WORLD`` (or the given communicator)."""

    name = "mpi"

    def __init__(self, comm: Any = None) -> None:
        MPI = _mpi()
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = local.Get_rank()
        self.local_size = local.Get_size()
        local.Free()
        self._staging: dict[torch.dtype, torch.Tensor] = {}

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            if not tensor.is_contiguous():
                raise ValueError("MPICommunicator reduces contiguous tensors only")
            return tensor
        buf = self._staging.get(tensor.dtype)
        if buf is None or buf.numel() < tensor.numel():
            buf = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
            self._staging[tensor.dtype] = buf
        host = buf[: tensor.numel()].view(tensor.shape)
        host.copy_(tensor)
        return host

    def _reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        MPI = _mpi()
        host = self._host(tensor)
        self.comm.Allreduce(MPI.IN_PLACE, host, op=op)
        if host is not tensor:
            tensor.copy_(host)
        return tensor

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, _mpi().SUM)

    def allreduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, _mpi().MAX)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        host = self._host(tensor)
        self.comm.Bcast(host, root=root)
        if host is not tensor:
            tensor.copy_(host)
        return tensor

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.comm.gather(obj, root=root)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)
