"""Executors: how a rank trains its share of a round's cohort (sequentially or vectorised)."""

from dpfl_lightning.executor.base import ClientHooks, Executor, RoundWork, TrainedClient
from dpfl_lightning.executor.sequential import SequentialExecutor
from dpfl_lightning.executor.vmap import VmapExecutor

EXECUTORS = {"sequential": SequentialExecutor, "vmap": VmapExecutor}

__all__ = ["EXECUTORS", "ClientHooks", "Executor", "RoundWork", "SequentialExecutor", "TrainedClient", "VmapExecutor"]
