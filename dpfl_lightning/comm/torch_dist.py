"""torch.distributed communicator (NCCL on GPU, gloo on CPU), bootstrapped from MPI.

``mpiexec`` gives every process its MPI rank; rank 0 picks a free TCP port on its host (or
``MASTER_ADDR`` / ``MASTER_PORT``) and broadcasts ``host:port`` over MPI, and every rank then joins the torch.distributed process group
with that address. Tensor collectives go through torch.distributed (NCCL reads CUDA memory
directly); Python objects and aborts still go through MPI.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dpfl_lightning.comm.mpi import MPICommunicator


def _host_address() -> str:
    """An address of this host that the other nodes can reach: ``MASTER_ADDR`` if set, else the
    hostname's address unless it is a loopback one (``/etc/hosts`` often maps the hostname to
    127.0.1.1), else the address of the interface that routes outwards (no packet is sent)."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    if not addr.startswith("127."):
        return addr
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return addr  # single-node: loopback is fine


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TorchDistCommunicator(MPICommunicator):
    """Tensor reductions over a torch.distributed group of the MPI ranks.

    Args:
        backend: ``"nccl"`` for CUDA tensors, ``"gloo"`` for CPU tensors.
        timeout_s: how long a collective may wait before the job fails instead of hanging.
    """

    name = "torch_dist"

    def __init__(self, backend: str = "nccl", timeout_s: float = 600.0, comm: Any = None) -> None:
        super().__init__(comm)
        self.backend = backend
        if self.rank == 0:
            port = int(os.environ.get("MASTER_PORT", 0)) or _free_port()
            address = f"tcp://{_host_address()}:{port}"
        else:
            address = None
        address = self.comm.bcast(address, root=0)
        if backend == "nccl":
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        dist.init_process_group(
            backend=backend,
            init_method=address,
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=timeout_s),
        )

    def allreduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def allreduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src=root)
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
