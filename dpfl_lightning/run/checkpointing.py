"""The run's checkpoints: what one holds (the global model, the plugins' and callbacks' states, the
per-client states by id, the released history, the configuration), written atomically on rank 0 with
``last.ckpt`` pointing at the newest; restoring one; stopping on a signal with one; which
``version_N`` of the run a fit writes and where its checkpoints go (the layout: :mod:`dpfl_lightning.tracking.run_files`)."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from dpfl_lightning.run import checkpoint_format as ckpt
from dpfl_lightning.tracking import run_files
from dpfl_lightning.comm import Communicator
from dpfl_lightning.errors import ConfigError, drain_output, require
from dpfl_lightning.run.lightning_export import save_lightning_checkpoint
from dpfl_lightning.tracking.loggers import latest_version
from dpfl_lightning.run.preemption import Preempted, resume_hint
from dpfl_lightning.run.client_states import ClientStates
from dpfl_lightning.run.setup import collect_mechanisms
from dpfl_lightning.run.status import RunStatus
from dpfl_lightning.run.settings import TrainerSettings


def checkpoint_to_resume(ckpt_path: str | None, settings: TrainerSettings, comm: Communicator) -> str | None:
    """``"last"``: the newest ``last.ckpt`` of the run (in ``checkpoint_dir`` if set, else in its newest
    ``version_N/checkpoints`` that has one), if there is one (a first start has none), as rank 0
    finds it; other paths as they are."""
    if ckpt_path != "last":
        return ckpt_path
    root = run_files.run_root(settings.log_dir, settings.run_name)
    last = run_files.newest_checkpoint(root, (run_files.LAST,), settings.checkpoint_dir) if comm.rank == 0 else None
    last = comm.broadcast_object(last, root=0) if comm.size > 1 else last
    if last is None and settings.enable_summary and comm.rank == 0:
        where = settings.checkpoint_dir or os.path.join(root, "version_*", run_files.CHECKPOINTS)
        print(f"resume: no checkpoint at {os.path.join(where, run_files.LAST)} yet; starting from round 0",
              file=sys.stderr, flush=True)
    return last


def fit_version(settings: TrainerSettings, ckpt_path: str | None, state: dict[str, Any] | None) -> int:
    """The ``version_N`` of the run a fit writes (call on rank 0). A resumed fit continues the version of
    its checkpoint: the ``N`` of ``version_N/checkpoints`` that holds it; for a checkpoint in the run's
    own shared directory (a set ``checkpoint_dir``, or ``<run>/checkpoints`` of older runs) the version
    it was written by (else the newest with a ``metrics.csv``). A new fit, or one resumed from another
    run's checkpoint, takes a new version, as a Lightning logger does."""
    root = run_files.run_root(settings.log_dir, settings.run_name)
    if state is not None and ckpt_path:
        version = run_files.checkpoint_version(ckpt_path, root)
        shared = settings.checkpoint_dir or os.path.join(root, run_files.CHECKPOINTS)
        if version is None and os.path.isdir(shared) and os.path.samefile(os.path.dirname(os.path.abspath(ckpt_path)),
                                                                          shared):
            version = state.get("log_version")
            if version is None or not os.path.isdir(os.path.join(root, f"version_{version}")):
                version = latest_version(settings.log_dir, settings.run_name)
        if version is not None:
            return int(version)
    return run_files.claim_version(root)


def open_version(settings: TrainerSettings, comm: Communicator, status: RunStatus, ckpt_path: str | None,
                 state: dict[str, Any] | None) -> int:
    """Choose the fit's version on rank 0 (see :func:`fit_version`), tell every rank, and record it and
    the checkpoint directory (``checkpoint_dir``, else ``<run>/version_N/checkpoints``) in ``status``."""
    version = fit_version(settings, ckpt_path, state) if comm.rank == 0 else None
    status.version = version = comm.broadcast_object(version, root=0) if comm.size > 1 else version
    root = run_files.run_root(settings.log_dir, settings.run_name)
    status.checkpoint_dir = settings.checkpoint_dir or run_files.version_checkpoint_dir(root, version)
    return version


def planned_checkpoint_dir(settings: TrainerSettings) -> str:
    """Before a fit: ``checkpoint_dir`` if set, else the directory ``fit(ckpt_path="last")`` would resume
    from, else the one a new fit would write (the next version's)."""
    if settings.checkpoint_dir:
        return settings.checkpoint_dir
    root = run_files.run_root(settings.log_dir, settings.run_name)
    last = run_files.newest_checkpoint(root, (run_files.LAST,))
    return os.path.dirname(last) if last else run_files.version_checkpoint_dir(root, (run_files.versions(root)
                                                                                       or [-1])[-1] + 1)


def write_lightning_checkpoint(module: Any, data: Any, comm: Communicator | None, path: str, history: list,
                               epoch: int | None = None, global_step: int | None = None) -> str:
    """The global model as a Lightning checkpoint (rank 0 writes; every rank calls this); ``epoch``
    defaults to the rounds in ``history`` and ``global_step`` to what the run's checkpoints write
    (:meth:`~dpfl_lightning.module.replay.ScheduleReplay.written_step`: in a DP run, never one client's steps)."""
    require(module is not None, "save_lightning_checkpoint", path, "there is no trained model yet",
            "call it after fit (or set final_checkpoint=True)")
    done = int(history[-1].get("round", len(history))) if history else 0
    epoch = done if epoch is None else epoch
    if global_step is None:
        global_step = module.schedules.written_step(done)
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
            "log_version": self.status.version,  # the run's version_N that wrote it (a resume continues it)
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
        return os.path.join(self.status.checkpoint_dir, f"round-{rounds_done:06d}.ckpt")

    def preempt(self, signum: int, rounds_done: int, loggers: list[Any], saved: bool) -> None:
        """Stop on a signal after ``rounds_done`` rounds: a checkpoint (unless this round wrote one),
        the resume command on rank 0, out before any rank exits; then :class:`Preempted`."""
        if not saved:
            self.save(self.round_path(rounds_done), rounds_done)
        last = os.path.join(self.status.checkpoint_dir, run_files.LAST)
        for lg in loggers:
            lg.finalize("preempted")
        if self.comm.rank == 0:
            for line in resume_hint(last, rounds_done, signum, self.comm.size):
                print(line, file=sys.stderr, flush=True)
            drain_output()
        self.comm.barrier()
        raise Preempted(signum, last, rounds_done)

    def restore(self, state: dict[str, Any], run: Any) -> int:
        """Continue ``run`` (its :class:`~dpfl_lightning.run.setup.RunSetup`) from ``state``: refused if it
        was written by another configuration; returns the rounds it had done."""
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
        self.states.restore(state["client_states"], run.device)
        self.status.history = list(state.get("history", []))
        if run.ledger is not None:  # restored plugins (calibrated noise) are in force now
            collect_mechanisms(self.plugins, run.ctx)
            run.ledger.setup(ctx=run.ctx)
        return int(state["round"])
