"""Communicators: one process (:class:`LocalCommunicator`), MPI ranks (:class:`MPICommunicator`),
torch.distributed/NCCL bootstrapped from MPI (:class:`TorchDistCommunicator`).

May import: the foundation (``errors``) only; ``federated``'s aggregation, the run and the trainer use it.
"""

from __future__ import annotations

import os

from dpfl_lightning.comm.communicator import Communicator
from dpfl_lightning.comm.exact_sum import ExactSum, FloatSum
from dpfl_lightning.comm.local import LocalCommunicator
from dpfl_lightning.comm.mpi import MPICommunicator
from dpfl_lightning.comm.torch_dist import TorchDistCommunicator
from dpfl_lightning.errors import ConfigError

_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE")


def launched_with_mpi() -> bool:
    """True when this process was started by ``mpiexec``/``mpirun`` (any MPI that sets these)."""
    return any(v in os.environ for v in _SIZE_VARIABLES + ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def make_communicator(kind: str = "auto", device_type: str = "cpu") -> Communicator:
    """Build the communicator for ``kind``: ``auto``, ``local``, ``mpi``, ``nccl`` or ``gloo``.

    ``auto`` is local for a process started on its own, MPI under ``mpiexec``, and NCCL (bootstrapped
    from MPI) when the ranks train on CUDA devices and there is more than one rank.
    """
    if kind == "local":
        return LocalCommunicator()
    if kind == "auto":
        if not launched_with_mpi():
            return LocalCommunicator()
        mpi = MPICommunicator()
        if mpi.size > 1 and device_type == "cuda":
            return TorchDistCommunicator("nccl", comm=mpi.comm)
        return mpi if mpi.size > 1 else LocalCommunicator()
    if kind == "mpi":
        return MPICommunicator()
    if kind in ("nccl", "gloo"):
        return TorchDistCommunicator(kind)
    raise ConfigError("trainer.communicator", kind, "unknown communicator", "use one of auto, local, mpi, nccl, gloo")


__all__ = [
    "Communicator",
    "ExactSum",
    "FloatSum",
    "LocalCommunicator",
    "MPICommunicator",
    "TorchDistCommunicator",
    "launched_with_mpi",
    "make_communicator",
]
