"""AutoExecutor (``executor="auto"``): the vmap executor where it runs the module and its plugins
with the sequential executor's result, bit for bit; the sequential executor otherwise.

The choice is the vmap executor's own: :meth:`VmapExecutor.refusal` runs its set-up (every refusal
it would raise) and then checks one vectorised gradient against the same gradient taken client by
client, at the run's batch size, on synthetic data. It depends on the module, the plugins, the batch
size and the data's shapes, never on a client's records (the summary prints it in a DP run).
"""

from __future__ import annotations

from typing import Iterator

from dpfl_lightning.executor.base import Executor, RoundWork, TrainedClient
from dpfl_lightning.executor.sequential import SequentialExecutor
from dpfl_lightning.executor.vmap import VmapExecutor


class AutoExecutor(Executor):
    """Chooses at set-up (see the module docstring); :attr:`choice` says which and why."""

    name = "auto"

    def __init__(self, batch_size: int | None = None) -> None:
        self.batch_size = batch_size
        self.chosen: Executor | None = None
        self.choice = "auto (not set up)"

    def setup(self, module, data, changes_local_steps: list[str]) -> None:
        if self.batch_size is None:
            reason = "batch_size=None (whole-client batches) cannot be checked for equal bits ahead"
        else:
            vmap = VmapExecutor()
            reason = vmap.refusal(module, data, changes_local_steps, exact_batch=self.batch_size)
        if reason is None:
            self.chosen, self.choice = vmap, "vmap"
        else:
            self.chosen, self.choice = SequentialExecutor(), f"sequential (vmap cannot run: {reason})"
            self.chosen.setup(module, data, changes_local_steps)

    def train(self, work: RoundWork) -> Iterator[TrainedClient]:
        return self.chosen.train(work)

