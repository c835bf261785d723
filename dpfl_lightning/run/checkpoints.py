"""The run's checkpoints: what one holds (the global model, the plugins' and callbacks' states, the
per-client states by id, the released history, the configuration), written atomically on rank 0 with
``last.ckpt`` pointing at the newest; restoring one; stopping on a signal with one."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from dpfl_lightning import checkpoint as ckpt
from dpfl_lightning.comm import Communicator
from dpfl_lightning.errors import ConfigError, drain_output, require
from dpfl_lightning.export import save_lightning_checkpoint
from dpfl_lightning.preemption import Preempted, resume_hint
from dpfl_lightning.run.client_states import ClientStates
from dpfl_lightning.run.status import RunStatus
from dpfl_lightning.settings import TrainerSettings


def checkpoint_to_resume(ckpt_path: str | None, settings: TrainerSettings, announce: bool) -> str | None:
    """``"last"``: the run's ``last.ckpt`` if it exists (a first start has none), as in Lightning."""
    if ckpt_path != "last":
        return ckpt_path
    last = os.path.join(settings.checkpoint_dir, "last.ckpt")
    if os.path.isfile(last):
        return last
    if settings.enable_summary and announce:
        print(f"resume: no checkpoint at {last} yet; starting from round 0", file=sys.stderr, flush=True)
    return None


def write_lightning_checkpoint(module: Any, data: Any, comm: Communicator | None, path: str, history: list,
                               epoch: int | None = None, global_step: int | None = None) -> str:
    """The global model as a Lightning checkpoint (rank 0 writes; every rank calls this); ``epoch``
    defaults to the rounds in ``history`` and ``global_step`` to the reference client's steps by then."""
    done = int(history[-1].get("round", len(history))) if history else 0
    epoch = done if epoch is None else epoch
    if global_step is None:
        global_step = module.start_step(module.loop.steps_reference, done)
    module.load_global()
    if comm is None or comm.rank == 0:
        datamodule = getattr(data, "datamodule", None)
        save_lightning_checkpoint(module.inner, path, epoch, global_step,
                                  datamodule if hasattr(datamodule, "CHECKPOINT_HYPER_PARAMS_KEY") else None)
    if comm is not None and comm.size > 1:
        comm.barrier()
    return path


class RunCheckpoints:
    """Checkpoints of one fit."""

    def __init__(self, settings: TrainerSettings, comm: Communicator, module: Any, data: Any, plugins: list,
                 sampler: Any, lightning_run: Any, states: ClientStates, status: RunStatus,
                 config: Callable[[], dict[str, Any]]) -> None:
        self.settings, self.comm, self.module, self.data = settings, comm, module, data
        self.plugins, self.sampler, self.lightning_run = plugins, sampler, lightning_run
        self.states, self.status, self.config = states, status, config
        self.resume_changes: list[str] = []

    def _sampler_key(self) -> tuple:
        return self.sampler.kind, self.sampler.clients_per_round, self.sampler.rate

    def state(self, rounds_done: int) -> dict[str, Any] | None:
        """What a checkpoint after ``rounds_done`` rounds holds (rank 0; ``None`` elsewhere)."""
        client_states = self.states.gathered(self.settings.secure)
        if self.comm.rank != 0:
            return None
        module, s = self.module, self.settings
        return {
            **self.lightning_run.lightning_fields(rounds_done),  # Lightning's load_from_checkpoint reads these
            "format": ckpt.FORMAT,
            "round": rounds_done,
            "global_params": module.global_params.detach().cpu().clone(),
            "num_parameters": module.num_parameters,
            "num_clients": self.data.num_clients,
            "seed": s.seed,
            "secure": s.secure,
            "sampler": self._sampler_key(),
            "plugins": ckpt.plugin_states(self.plugins),
            "callbacks": self.lightning_run.callback_states(),
            "client_states": client_states,
            "config": self.config(),
            "history": list(self.status.history),
            "world_size": self.comm.size,
        }

    def save(self, path: str, rounds_done: int) -> None:
        """Write a checkpoint (rank 0; every rank must call this) and point ``last.ckpt`` at it."""
        state = self.state(rounds_done)
        if state is not None:
            ckpt.save_atomic(state, path)
            last = os.path.join(os.path.dirname(path), "last.ckpt")
            tmp = last + f".tmp-{os.getpid()}"
            if os.path.exists(tmp):
                os.unlink(tmp)
            os.link(path, tmp)
            os.replace(tmp, last)
        self.comm.barrier()

    def round_path(self, rounds_done: int) -> str:
        return os.path.join(self.settings.checkpoint_dir, f"round-{rounds_done:06d}.ckpt")

    def preempt(self, signum: int, rounds_done: int, loggers: list[Any], saved: bool) -> None:
        """Stop on a signal after ``rounds_done`` rounds: a checkpoint (unless this round wrote one),
        the resume command on rank 0, out before any rank exits; then :class:`Preempted`."""
        if not saved:
            self.save(self.round_path(rounds_done), rounds_done)
        last = os.path.join(self.settings.checkpoint_dir, "last.ckpt")
        for lg in loggers:
            lg.finalize("preempted")
        if self.comm.rank == 0:
            for line in resume_hint(last, rounds_done, signum, self.comm.size):
                print(line, file=sys.stderr, flush=True)
            drain_output()
        self.comm.barrier()
        raise Preempted(signum, last, rounds_done)

    def restore(self, state: dict[str, Any], device: Any) -> int:
        """Continue from ``state``: refused if it was written by another configuration; returns the
        rounds it had done."""
        module, data, s = self.module, self.data, self.settings
        for key, have in (("num_parameters", module.num_parameters), ("num_clients", data.num_clients),
                          ("seed", s.seed), ("sampler", self._sampler_key()), ("secure", s.secure)):
            if state.get(key) != have:
                raise ConfigError("resume", state.get(key), f"the checkpoint's {key} differs from this run's ({have})",
                                  f"resume with the configuration that wrote the checkpoint ({key}={state.get(key)})")
        require(state["round"] <= s.rounds, "trainer.rounds", s.rounds,
                f"the checkpoint is already at round {state['round']}", f"set rounds >= {state['round']}")
        fresh = ckpt.restore_plugins(self.plugins, state["plugins"], state["round"])
        self.lightning_run.saved_callback_states = state.get("callbacks", {})
        self.resume_changes = ckpt.config_changes(state.get("config") or {}, self.config())
        if self.comm.rank == 0 and s.enable_summary:
            if fresh:
                print(f"resume: plugins not in the checkpoint start from their initial state: {', '.join(fresh)}",
                      flush=True)
            for line in self.resume_changes:
                print(f"resume: changed since the checkpoint: {line}", flush=True)
        module.global_params.copy_(state["global_params"].to(module.global_params.device))
        module.load_global()
        self.states.restore(state["client_states"], device)
        self.status.history = list(state.get("history", []))
        return int(state["round"])
