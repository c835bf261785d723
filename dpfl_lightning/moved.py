"""Import paths that moved when the package was split by concern, kept working with a deprecation.

``import dpfl_lightning.loggers`` (or a config's ``class_path: dpfl_lightning.loggers.WandbLogger``, or
a checkpoint pickled before the move) imports the module at its new path, warns once with
:class:`DeprecationWarning` naming that path, and gets the very same module object (so
``isinstance`` and monkeypatching see one module). ``dpfl_lightning.cli`` itself became a package:
its ``__init__`` forwards the old module's names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

# old path (under dpfl_lightning.) -> new path
MOVED = {
    "cli_parsers": "cli.parsers",
    "cli_config": "cli.run_objects",
    "cli_errors": "cli.parse_errors",
    "cli_help": "cli.help",
    "cli_help_data": "cli.help_data",
    "privacy_cli": "cli.privacy_command",
    "audit_cli": "cli.audit_command",
    "evaluation": "run.lightning_eval",
    "lightning_compat": "lightning.semantics",
    "callbacks": "lightning.callbacks",
    "lightning_options": "lightning.trainer_options",
    "export": "run.lightning_export",
    "schedule": "module.schedule",
    "optimizer_calls": "module.optimizer_calls",
    "logged_metrics": "module.logged_metrics",
    "loggers": "tracking.loggers",
    "sweep": "tracking.sweep",
    "reporting": "tracking.report",
    "run_files": "tracking.run_files",
    "plan": "federated.plan",
    "payload": "federated.payload",
    "releases": "federated.releases",
    "aggregation": "federated.aggregation",
    "sampling": "federated.sampling",
    "placement": "federated.placement",
    "frozen": "federated.frozen",
    "contexts": "plugins.contexts",
    "settings": "run.settings",
    "preemption": "run.preemption",
    "reproducibility": "run.reproducibility",
    "checkpoint": "run.checkpoint_format",
    "run.checkpoints": "run.checkpointing",
    "run.evaluation": "run.round_evaluation",
    "module.evaluation": "module.eval_pass",
    "run.reporting": "run.log_setup",
    "comm.base": "comm.communicator",
    "executor.base": "executor.interface",
    "plugins.base": "plugins.callback",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``dpfl_lightning.<old>`` and loads it as ``dpfl_lightning.<new>``, with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("dpfl_lightning.")
        if old == fullname or old not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        new = "dpfl_lightning." + MOVED[spec.name.removeprefix("dpfl_lightning.")]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already imported."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
