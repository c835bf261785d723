"""The ``dpfl`` command line: parsing, help, and the verbs that are only reached from it.

Owns: :mod:`~.command` (``dpfl`` and its subcommands, exit codes), :mod:`~.parsers` (the parsers, help
from docstrings), :mod:`~.run_objects` (a parsed configuration to a run's objects),
:mod:`~.parse_errors` (a parse error as one line), :mod:`~.help` and :mod:`~.help_data` (``--help``
without torch; the data is generated), :mod:`~.privacy_command` (``dpfl privacy``),
:mod:`~.audit_command` (``dpfl audit``) and :mod:`~.sweep_command` (``dpfl sweep`` and ``dpfl report``
with the privacy of what a sweep releases; the sweeps and reports themselves are in
:mod:`dpfl_lightning.tracking`); ``dpfl validate | test | predict`` in :mod:`dpfl_lightning.run.lightning_eval`.

May import: every other part of the package (it is the top). Nothing but ``__main__`` imports it.
``dpfl_lightning.cli`` was one module before the split: its names (``main`` ...) load from
:mod:`~.command` on first use, so the ``dpfl`` entry point ``dpfl_lightning.cli:main`` keeps working.
"""

from __future__ import annotations

import importlib
from typing import Any


# the names of the one-module ``dpfl_lightning.cli`` of before the split (its ``__all__``), from :mod:`~.command`
FORWARDED = frozenset({"build_parser", "expect_model_labels", "federated_data", "fit_parser", "main", "parse",
                       "run_config_text", "run_fit", "run_stage", "seed_model"})


def __getattr__(name: str) -> Any:
    if name not in FORWARDED:  # a submodule not imported yet is then imported by the import system
        raise AttributeError(f"module 'dpfl_lightning.cli' has no attribute {name!r}")
    return getattr(importlib.import_module("dpfl_lightning.cli.command"), name)
