"""Executors: how a rank trains its share of a round's cohort (sequentially or vectorised, or ``auto``:
vectorised where that gives the sequential executor's bits).

May import: ``plugins`` (the client context's type), ``data``, ``module``, ``federated``, the foundation.
Only the run and the trainer import it; an executor never sees the trainer.
"""

from dpfl_lightning.executor.auto import AutoExecutor
from dpfl_lightning.executor.interface import ClientHooks, Executor, RoundWork, TrainedClient
from dpfl_lightning.executor.sequential import SequentialExecutor
from dpfl_lightning.executor.vmap import VmapExecutor

EXECUTORS = {"sequential": SequentialExecutor, "vmap": VmapExecutor, "auto": AutoExecutor}


def make_executor(name: str, batch_size: int | None) -> Executor:
    """The executor ``trainer.executor`` names (``auto`` checks its choice at set-up, at ``batch_size``)."""
    return AutoExecutor(batch_size) if name == "auto" else EXECUTORS[name]()


def executor_choice(executor: Executor) -> str:
    """What trains the clients, and for ``auto`` why: ``vmap`` or ``sequential (vmap cannot run: ...)``."""
    return getattr(executor, "choice", executor.name)


__all__ = ["EXECUTORS", "AutoExecutor", "ClientHooks", "Executor", "RoundWork", "SequentialExecutor", "TrainedClient",
           "VmapExecutor", "executor_choice", "make_executor"]
