"""``lightning.Trainer`` arguments a user may give :class:`~dpfl_lightning.FederatedTrainer`, and what
the federated trainer calls them: one table, read by the command line (``--trainer.max_epochs``,
:mod:`dpfl_lightning.cli.parse_errors`) and by ``FederatedTrainer(max_epochs=...)`` in Python, which both
refuse the argument with its counterpart instead of a bare ``TypeError``."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from dpfl_lightning.errors import ConfigError

#: lightning.Trainer options a user may try, and what the federated trainer calls them
LIGHTNING_TRAINER_OPTIONS = {
    "max_epochs": "a federated run is counted in rounds: set trainer.rounds (and trainer.local_epochs or "
                  "trainer.local_steps for each client's work in a round)",
    "min_epochs": "a federated run is counted in rounds: set trainer.rounds",
    "max_steps": "set trainer.rounds and trainer.local_steps (a client's optimizer steps in a round)",
    "min_steps": "set trainer.rounds and trainer.local_steps",
    "max_time": "set trainer.rounds; a scheduler's time limit is met with SIGUSR1 before it (the run stops after "
                "the round with a checkpoint, launchers/slurm.sbatch)",
    "devices": "ranks are processes: launch mpiexec -n N python -m mpi4py -m dpfl_lightning fit ... "
               "(launchers/mpirun.sh); each rank uses one device, chosen by trainer.accelerator",
    "num_nodes": "ranks are processes: launch mpiexec -n N python -m mpi4py -m dpfl_lightning fit ... on the "
                 "nodes (launchers/slurm.sbatch)",
    "strategy": "ranks are MPI processes (mpiexec -n N); trainer.communicator picks mpi, nccl or gloo",
    "sync_batchnorm": "BatchNorm statistics are never aggregated (each client starts from the initial buffers); "
                      "use GroupNorm or LayerNorm",
    "use_distributed_sampler": "the clients are split among the ranks; no sampler to set",
    "logger": "set trainer.loggers (a list, e.g. dpfl_lightning.tracking.loggers.WandbLogger); the CSV log is always written",
    "default_root_dir": "set trainer.log_dir",
    "enable_model_summary": "set trainer.enable_summary",
    "check_val_every_n_epoch": "set trainer.eval_every (in rounds)",
    "val_check_interval": "set trainer.eval_every (in rounds)",
    "num_sanity_val_steps": "no sanity check runs: the first validation is after round trainer.eval_every",
    "enable_checkpointing": "set trainer.checkpoint_every (in rounds) or trainer.final_checkpoint",
    "limit_train_batches": "set trainer.local_steps",
    "log_every_n_steps": "every round is logged",
    "fast_dev_run": "set trainer.rounds 1",
}


class UnknownTrainerArgument(ConfigError, TypeError):
    """An argument ``FederatedTrainer`` does not take: a :class:`ConfigError` naming its counterpart, and
    a ``TypeError``, as Python raises for an unexpected keyword argument."""


def lightning_trainer_arguments() -> list[str]:
    """The keyword arguments of ``lightning.Trainer`` (of the installed version)."""
    import lightning

    return [n for n in inspect.signature(lightning.Trainer.__init__).parameters if n != "self"]


def unknown_argument(name: str, value: Any, accepted: Iterable[str], owner: str = "FederatedTrainer") -> ConfigError:
    """The error for ``owner(name=value)``: a ``lightning.Trainer`` argument gets its federated
    counterpart, a misspelt one the closest argument ``owner`` takes."""
    setting = f"trainer.{name}"
    if name in LIGHTNING_TRAINER_OPTIONS:
        return UnknownTrainerArgument(setting, value, f"{owner} has no {name} (a lightning.Trainer argument)",
                                      LIGHTNING_TRAINER_OPTIONS[name])
    if name in lightning_trainer_arguments():
        return UnknownTrainerArgument(setting, value, f"{owner} has no {name} (a lightning.Trainer argument with no "
                                      "counterpart in a federated run)", f"leave it out; {owner}'s arguments are "
                                      f"listed in help({owner})")
    near = difflib.get_close_matches(name, list(accepted), n=1, cutoff=0.6)
    fix = f"the closest argument is {near[0]}" if near else f"see help({owner}) for its arguments"
    return UnknownTrainerArgument(setting, value, f"{owner} takes no argument {name}", fix)


def refuse_unknown_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a class's ``__init__`` so that a keyword argument it does not take (``max_epochs``) raises
    :func:`unknown_argument`'s error instead of Python's ``TypeError``; the signature stays the same
    (``inspect.signature`` and the command line read the wrapped one)."""
    accepted = [n for n in inspect.signature(init).parameters if n != "self"]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        for name, value in kwargs.items():
            if name not in accepted:
                raise unknown_argument(name, value, accepted, type(self).__name__)
        init(self, *args, **kwargs)

    return checked
