"""The pieces of one ``FederatedTrainer.fit``, each built from the settings, the communicator, the
module, the data and the plugins, none of them from the trainer: :mod:`~.setup` (device, ranks,
randomness, mechanisms, ledger, releases), :mod:`~.hooks` (the plugins by hook), :mod:`~.client_phase`
and :mod:`~.client_states` (a client's update, one way, and per-client state by id),
:mod:`~.server_phase` (reduce, the server step), :mod:`~.evaluation`, :mod:`~.round_row` (the metric
row and its release kinds), :mod:`~.checkpoints`, :mod:`~.reporting` (loggers, summary) and
:mod:`~.status`."""
