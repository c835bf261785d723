"""The pieces of one ``FederatedTrainer.fit``, each built from the settings, the communicator, the
module, the data and the plugins, none of them from the trainer: :mod:`~.settings` (the trainer's
settings, one frozen object), :mod:`~.setup` (device, ranks, randomness, mechanisms, ledger,
releases), :mod:`~.hooks` (the plugins by hook), :mod:`~.client_phase` and :mod:`~.client_states` (a
client's update, one way, and per-client state by id), :mod:`~.server_phase` (reduce, the server
step), :mod:`~.round_evaluation` (evaluation during a fit), :mod:`~.round_row` (the metric row and its
release kinds), :mod:`~.checkpoint_format` (a checkpoint file: contents, atomic writes, restoring
plugins), :mod:`~.checkpointing` (when and where a fit checkpoints, resuming, stopping on a signal
with :mod:`~.preemption`), :mod:`~.lightning_export` (the final model as a Lightning checkpoint),
:mod:`~.lightning_eval` (``validate | test | predict`` of a trained run under ``lightning.Trainer``),
:mod:`~.stages` (what each stage takes), :mod:`~.log_setup` (loggers, summary),
:mod:`~.reproducibility`, :mod:`~.memory` and :mod:`~.status`.

May import: ``executor``, ``plugins``, ``data``, ``module``, ``federated``, ``privacy``, ``comm``,
``tracking`` and the foundation (``errors``, ``rng``). Never the trainer, ``lightning`` or the command line.
"""
