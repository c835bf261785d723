"""Experiment tracking: what runs write and what is read back from it.

Owns: :mod:`~.loggers` (round metrics to CSV, Weights & Biases and the console, from rank 0),
:mod:`~.run_files` (the on-disk layout of runs, and reading it back), :mod:`~.sweep` (``dpfl sweep``:
a sweep file's configurations as runs) and :mod:`~.report` (``dpfl report``: plots and tables from
the runs' logs).

May import: ``federated`` and the foundation (``errors``) only -- tracking never runs a model; a
sweep starts ``dpfl fit`` processes. ``run``, the trainer and the command line import it.
"""
